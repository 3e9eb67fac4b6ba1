"""Batch invariance on the CPU: a stream's tokens and audio do not depend on what runs beside it.

The LLM (models/llm_precision.py, "Batch-invariant decode"): a stream's logits at a
decode step are the same bits whatever else decodes beside it (how many rows, which, in which order, at which
attended cache length) and at any torch thread count, for every LLM precision; so a seed gives the same tokens
under any load. Checked on this CPU's kernels and, in a child process, on its AVX2 kernels (ATen, MKL and
oneDNN capped at AVX2, as an AVX2-only CPU runs them; `auto` then picks int8-dynamic). token2wav: a stream's
audio is the same bits in any flow batch (token2wav/scheduler.py)."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.llm.scheduler import LLMScheduler
from cosyvoice_triton.messages import ChunkPolicy
from cosyvoice_triton.models.flow_cache import FlowCacheSettings
from cosyvoice_triton.models.auto_precision import resolve_flow_precision, resolve_llm_precision
from cosyvoice_triton.models.llm_precision import LLM_PRECISIONS
from cosyvoice_triton.models.qwen2 import kv_bucket
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.perf.decode_rows import released_width_lm
from cosyvoice_triton.pipeline.threads import CoreShare, RowWorkers, ThreadPlan
from cosyvoice_triton.pipeline.chunk_policy import ChunkSchedule
from cosyvoice_triton.token2wav.scheduler import ChunkRequest, Token2WavScheduler

from test_llm_scheduler import make_request, read_all
from test_token2wav_scheduler import Voice, golden_prompt, random_prompt

pytestmark = pytest.mark.timeout(300)

MAX_SEQ_LEN = 1024
# Prompt lengths of the eight slots: rows at positions in different cache buckets (kv_bucket), so a batch
# attends over more positions than a short row's own step does.
PROMPTS = (20, 150, 60, 300, 10, 90, 5, 400)
BATCHES = ([0, 1], [1, 0], [2, 0, 3], [0, 1, 2, 3], [3, 1, 4, 0, 2], [7, 6, 5, 4, 3, 2, 1, 0])
THREADS = (1, 2, 3)
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def available(precision: str) -> bool:
    """int8-dynamic needs the x86 quantized engine (fbgemm); the others run on any CPU."""
    engines = torch.backends.quantized.supported_engines
    return precision != "int8-dynamic" or "x86" in engines or "fbgemm" in engines


PRECISIONS = [p for p in LLM_PRECISIONS if available(p)]


def prefilled(llm: SpeechLM) -> list[int]:
    """Prefill slot s with a prompt of PROMPTS[s] text tokens; the next position of each slot."""
    g = torch.Generator().manual_seed(0)
    none = torch.zeros(1, 0, dtype=torch.long)
    positions = []
    for slot, length in enumerate(PROMPTS):
        x = llm.build_prompt(torch.randint(0, llm.config.qwen.vocab_size, (1, length), generator=g), none, none)
        llm.step_logits(x, torch.arange(x.shape[1])[None], torch.tensor([slot]),
                        kv_bucket(x.shape[1], llm.max_seq_len))
        positions.append(x.shape[1])
    return positions


def decode(llm: SpeechLM, positions: list[int], rows: list[int]) -> torch.Tensor:
    """One decode step of `rows` (slots) together, each at its next position, as the scheduler calls it:
    attending over the batch's bucket -> logits (B, V)."""
    tokens = torch.tensor([[3 * row + 5] for row in rows])  # (B, 1)
    input_pos = torch.tensor([[positions[row]] for row in rows])  # (B, 1)
    kv_len = kv_bucket(max(positions[row] for row in rows) + 1, llm.max_seq_len)
    return llm.step_logits(llm.embed_speech(tokens), input_pos, torch.tensor(rows), kv_len)


def rows_differing_from_solo(llm: SpeechLM) -> list[tuple]:
    """(threads, batch, row, max abs difference) of every row whose logits are not its solo step's bits."""
    positions = prefilled(llm)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        solo = [decode(llm, positions, [row])[0] for row in range(len(PROMPTS))]
        differing = []
        for threads in THREADS:
            torch.set_num_threads(threads)
            for batch in BATCHES:
                for row, logits in zip(batch, decode(llm, positions, batch)):
                    if not torch.equal(logits, solo[row]):
                        differing.append((threads, batch, row, float((logits - solo[row]).abs().max())))
        return differing
    finally:
        torch.set_num_threads(before)


def tiny_llm(model_dir: Path, precision: str) -> SpeechLM:
    return SpeechLM.from_model_dir(model_dir, max_batch=len(PROMPTS), max_seq_len=MAX_SEQ_LEN, precision=precision)


def full_size_layers(precision: str) -> SpeechLM:
    """The released model's widths with one random layer, decoding as from_model_dir sets it up on a CPU: the
    kernels the full model runs."""
    return released_width_lm(precision, len(PROMPTS), MAX_SEQ_LEN, layers=1)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_rows_logits_in_any_batch_are_its_solo_steps_bits(tiny_model_dir, precision):
    assert rows_differing_from_solo(tiny_llm(tiny_model_dir, precision)) == []


@pytest.mark.parametrize("precision", PRECISIONS)
def test_at_the_released_widths_too(precision):
    """The released model's matrix shapes take other kernel paths (MKL's gemv vs gemm, blocking by length)."""
    assert rows_differing_from_solo(full_size_layers(precision)) == []


def test_a_scheduled_streams_logits_are_its_solo_runs_bits_at_every_step(tiny_model_dir):
    """Through the scheduler (slots, positions, cache buckets, streams ending at other times): six streams
    decoded together and each alone give the same logits at every step, in the precision `auto` picks here."""
    llm = SpeechLM.from_model_dir(tiny_model_dir, max_batch=6, max_seq_len=MAX_SEQ_LEN, precision="auto")
    requests = [make_request(llm, f"s{i}", 2 + i, prompt_text_len=i, prompt_speech_len=5 * i, seed=40 + i)
                for i in range(6)]
    recorded: dict[str, list[torch.Tensor]] = {request.stream_id: [] for request in requests}
    inner = llm.step_logits

    def recording(x, input_pos, slots, kv_len=None):
        logits = inner(x, input_pos, slots, kv_len)
        for slot, row in zip(slots.tolist(), logits):
            recorded[owner[slot]].append(row.clone())
        return logits

    llm.step_logits = recording  # the instance attribute shadows the method
    owner: dict[int, str] = {}
    logits_of = {}
    for together in (True, False):
        for request in requests:
            recorded[request.stream_id] = []
        scheduler = LLMScheduler(llm, max_batch=6 if together else 1, max_seq_len=MAX_SEQ_LEN)
        # Slots go out from 0 up, in submission order; alone, every stream has slot 0.
        owner.update({i if together else 0: r.stream_id for i, r in enumerate(requests)})
        try:
            if together:
                streams = [scheduler.submit(request) for request in requests]
                scheduler.start()
                tokens = [read_all(stream) for stream in streams]
            else:
                scheduler.start()
                tokens = []
                for request in requests:
                    owner[0] = request.stream_id
                    tokens.append(read_all(scheduler.submit(request)))
        finally:
            scheduler.stop()
        logits_of[together] = ({k: torch.stack(v) for k, v in recorded.items()}, tokens,
                               scheduler.stats.peak_batch_size)
    (batched, batched_tokens, peak), (alone, alone_tokens, _) = logits_of[True], logits_of[False]
    assert peak == 6 and batched_tokens == alone_tokens
    for request in requests:
        assert torch.equal(batched[request.stream_id], alone[request.stream_id]), request.stream_id


def check_in_this_process(model_dir: str) -> None:
    """Every precision's rows (tiny folder) and `auto`'s (released widths): what the AVX2 child runs."""
    for precision in PRECISIONS:
        assert rows_differing_from_solo(tiny_llm(Path(model_dir), precision)) == [], precision
    assert rows_differing_from_solo(full_size_layers(resolve_llm_precision("auto"))) == []


def test_on_an_avx2_cpus_kernels_too(tiny_model_dir):
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); "
            "import test_batch_invariance as t; "
            "assert torch.backends.cpu.get_cpu_capability() == 'AVX2', torch.backends.cpu.get_cpu_capability(); "
            "assert t.resolve_llm_precision('auto') in ('int8-dynamic', 'fp32'); "
            "t.check_in_this_process(sys.argv[2]); print('ok')")
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(tiny_model_dir)],
                          env={**os.environ, **AVX2_ENV}, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-4000:]


def chunked(voice: Voice) -> list[ChunkRequest]:
    """The voice's tokens cut into chunks where its chunk policy says."""
    schedule = ChunkSchedule(voice.policy, voice.prompt.speech_tokens.shape[1])
    ends = [0]
    while schedule.needed <= len(voice.tokens):
        ends.append(schedule.advance()[1])
    spans = list(zip(ends, ends[1:] + [len(voice.tokens)]))
    return [ChunkRequest(voice.stream_id, voice.tokens[start:end], finalize=j == len(spans) - 1,
                         prompt=voice.prompt if j == 0 else None, seed=voice.seed)
            for j, (start, end) in enumerate(spans)]


@pytest.mark.parametrize("precision", ["fp32", "auto"])
def test_a_streams_audio_in_any_flow_batch_is_its_solo_runs_bits(flow, hift, golden, precision):
    """token2wav as served on a CPU (the flow cache, each stream's estimator rows and encoder alone, spread by
    RowWorkers): streams with other voices, lengths and start times give the same audio bits batched together
    as each alone, in fp32 and in the flow precision `auto` picks here. (Served, a call's thread count follows
    the chunk kinds in it, which moves HiFT's sums by ~1e-7; here every call runs on the same count.)"""
    flow = copy.deepcopy(flow)
    flow.decoder.set_precision(resolve_flow_precision(precision))
    rng = np.random.RandomState(5)
    tokens = golden["flow_token"][0].tolist()
    hops = ChunkPolicy(first_hop=8, hop_scale=1.0, align_to_chunk=False)  # a chunk every 8 tokens
    voices = [Voice("a", golden_prompt(golden, 0, 20, 1.0), tokens[:24], hops, seed=11),
              Voice("b", random_prompt(golden, rng, 12), rng.randint(0, 6561, 16).tolist(), hops, seed=13)]
    chunks = {voice.stream_id: chunked(voice) for voice in voices}
    workers = RowWorkers(CoreShare(ThreadPlan(cores=2, llm=1, token2wav=1)))

    def scheduler() -> Token2WavScheduler:
        return Token2WavScheduler(flow, hift, flow_cache=FlowCacheSettings(), map_rows=workers.map)

    try:
        alone = {}
        for stream_id, stream_chunks in chunks.items():
            single = scheduler()
            alone[stream_id] = np.concatenate([single.run([chunk])[0] for chunk in stream_chunks])
        together, batched = scheduler(), {stream_id: [] for stream_id in chunks}
        waiting = {stream_id: list(stream_chunks) for stream_id, stream_chunks in chunks.items()}
        starts = {"a": 0, "b": 1}  # b's first chunk beside a's second, then equal-length middle chunks
        for call in range(100):
            batch = [waiting[s].pop(0) for s in waiting if waiting[s] and call >= starts[s]]
            if not batch:
                break
            for chunk, audio in zip(batch, together.run(batch)):
                batched[chunk.stream_id].append(audio)
        assert together.stats.max_flow_batch == 2
    finally:
        workers.close()
    for stream_id, audio in alone.items():
        assert np.array_equal(np.concatenate(batched[stream_id]), audio), stream_id
