"""LLM speed levers: attention over the used cache prefix, bf16 and int8 backbones.

- a bucketed cached forward equals the whole-cache one (fp32, to 1e-6) across bucket boundaries;
- bf16 and int8 run, stay within the default's KL bound against fp32 on the tiny folder (teacher-forced,
  perf/llm_quality.py's measure) and decode deterministically;
- a seed's tokens do not depend on the batch the scheduler decodes them in, in every precision.
(Exactly N tokens per stream, the benchmarks' knob, is perf's: tests/test_bench_official.py.)
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cosyvoice_triton.messages import LLMRequest, SamplingParams
from cosyvoice_triton.models.llm_precision import Int8DynamicLinear, Int8WeightOnlyLinear
from cosyvoice_triton.models.qwen2 import KV_BUCKET, kv_bucket
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.perf.llm_quality import quality_table
from cosyvoice_triton.random_folder.write import write_random_model
from cosyvoice_triton.llm.scheduler import LLMScheduler

pytestmark = pytest.mark.timeout(300)

MAX_SEQ_LEN = 512
KL_BOUND = 1e-3  # nats per step: the bound a default precision must meet


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("tiny") / "model", size="tiny", backbone_weights=False)


def ids(n: int, limit: int, seed: int) -> torch.Tensor:
    return torch.randint(limit, (1, n), generator=torch.Generator().manual_seed(seed))  # (1, n)


def test_kv_bucket_rounds_up_to_the_bucket_and_stops_at_the_cache() -> None:
    assert kv_bucket(1, 4096) == KV_BUCKET
    assert kv_bucket(KV_BUCKET, 4096) == KV_BUCKET
    assert kv_bucket(KV_BUCKET + 1, 4096) == 2 * KV_BUCKET
    assert kv_bucket(4000, 4096) == 4096


def test_bucketed_attention_equals_attention_over_the_whole_cache(model_dir: Path) -> None:
    llm = SpeechLM.from_model_dir(model_dir, max_batch=2, max_seq_len=MAX_SEQ_LEN)
    config = llm.config
    prompt = llm.build_prompt(ids(40, config.qwen.vocab_size, 1), ids(10, config.qwen.vocab_size, 2),
                              ids(70, config.speech_token_size, 3))  # (1, L, D), L = 122
    forced = ids(20, config.speech_token_size, 4)  # crosses the first bucket boundary (128)
    length = prompt.shape[1]
    slots = torch.tensor([0])

    def run(bucketed: bool) -> torch.Tensor:
        llm.setup_caches(2)
        kv = kv_bucket(length, MAX_SEQ_LEN) if bucketed else None
        rows = [llm.step_logits(prompt, torch.arange(length)[None], slots, kv)]
        for k in range(forced.shape[1]):
            kv = kv_bucket(length + k + 1, MAX_SEQ_LEN) if bucketed else None
            rows.append(llm.step_logits(llm.embed_speech(forced[:, k:k + 1]), torch.tensor([[length + k]]), slots, kv))
        return torch.cat(rows)  # (21, V)

    whole, bucketed = run(False), run(True)
    assert torch.allclose(bucketed, whole, rtol=0, atol=1e-6), (bucketed - whole).abs().max()


@pytest.mark.parametrize("precision", ["bf16", "int8", "int8-dynamic"])
def test_reduced_precision_stays_within_the_kl_bound(model_dir: Path, precision: str) -> None:
    rows, models, _ = quality_table(str(model_dir), precisions=("fp32", precision), steps=60,
                                    text_tokens=12, prompt_tokens=20)
    quality = {row.precision: row for row in rows}
    assert quality["fp32"].mean_kl == 0.0
    assert 0.0 < quality[precision].mean_kl <= KL_BOUND  # it differs from fp32, but only by rounding
    assert quality[precision].top1_agreement >= 0.9
    backbone = models[precision].backbone
    if precision == "int8":
        assert isinstance(backbone.layers[0].mlp.up_proj, Int8WeightOnlyLinear)
        assert backbone.layers[0].mlp.up_proj.weight.dtype == torch.int8
    elif precision == "int8-dynamic":  # float32 around the quantized engine's int8 products
        assert isinstance(backbone.layers[0].self_attn.q_proj, Int8DynamicLinear)
        assert models[precision].llm_embedding.weight.dtype == torch.float32
    else:
        assert backbone.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert backbone.rope_cos.dtype == torch.float32


def request(llm: SpeechLM, name: str, text_len: int, speech_len: int, seed: int) -> LLMRequest:
    config = llm.config
    return LLMRequest(stream_id=name, text_tokens=ids(text_len, config.qwen.vocab_size, seed)[0].tolist(),
                      prompt_text_tokens=ids(3, config.qwen.vocab_size, seed + 50)[0].tolist(),
                      prompt_speech_tokens=ids(speech_len, config.speech_token_size, seed + 90)[0].tolist(),
                      sampling=SamplingParams(), seed=seed)


def run_engine(llm: SpeechLM, requests: list[LLMRequest], max_batch: int) -> list[list[int]]:
    scheduler = LLMScheduler(llm, max_batch=max_batch, max_seq_len=MAX_SEQ_LEN)
    streams = [scheduler.submit(r) for r in requests]
    scheduler.start()
    try:
        return [[token for chunk in stream for token in chunk] for stream in streams]
    finally:
        scheduler.stop()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "int8-dynamic"])
def test_a_seed_gives_the_same_tokens_alone_and_in_any_batch(model_dir: Path, precision: str) -> None:
    llm = SpeechLM.from_model_dir(model_dir, max_seq_len=MAX_SEQ_LEN, precision=precision)
    target = request(llm, "target", 4, 12, seed=7)
    companions = [request(llm, f"other-{i}", 2 + i, 5 + 40 * i, seed=20 + i) for i in range(3)]
    alone = run_engine(llm, [target], max_batch=1)[0]
    assert len(alone) > 10
    assert run_engine(llm, [target], max_batch=1)[0] == alone  # run to run
    assert run_engine(llm, [target, *companions], max_batch=4)[0] == alone
    assert run_engine(llm, [companions[2], target, companions[0]], max_batch=2)[1] == alone
