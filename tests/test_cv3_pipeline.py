"""The in-process pipeline on a tiny random CosyVoice3 folder (`cosyvoice-triton export --family cosyvoice3`):
the folder decides the family; every mode's LLM prompt in CosyVoice3's text forms (a plain transcript or
instruction gets the system prompt and `<|endofprompt|>`, the official API's forms are taken as they are);
pronunciation hints pass normalization; every mode offline and streamed, voice conversion, speed, the same
seed's audio; the serving stages (LLM scheduler + token2wav scheduler) give each of several concurrent
requests its solo audio and free everything, a cancelled one included; saved speakers (spk2info) import."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.errors import Cancelled, ModelFolderError
from cosyvoice_triton.family import COSYVOICE3, END_OF_PROMPT
from cosyvoice_triton.llm.scheduler import LLMScheduler
from cosyvoice_triton.messages import ConversionRequest, SynthesisRequest
from cosyvoice_triton.pipeline.cosyvoice2 import CosyVoice, CosyVoice2, CosyVoice3
from cosyvoice_triton.pipeline.local_stages import BatchingToken2WavStage, LocalLLMStage
from cosyvoice_triton.pipeline.pipeline import Pipeline
from cosyvoice_triton.pipeline.threads import CoreShare, RowWorkers, ThreadPlan
from cosyvoice_triton.pipeline.voice_conversion import local_converter
from cosyvoice_triton.random_folder.sample_prompt import speech_like
from cosyvoice_triton.random_folder.write import write_random_model
from cosyvoice_triton.token2wav.scheduler import Token2WavScheduler

TRANSCRIPT = "今天天气真不错"
INSTRUCTION = "请用广东话表达。"
SAMPLES_PER_FRAME = 480

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cv3_dir(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("cv3") / "model", size="tiny", seed=0, family="cosyvoice3")


@pytest.fixture(scope="module")
def tts(cv3_dir: Path) -> CosyVoice:
    return CosyVoice.from_model_dir(cv3_dir)


@pytest.fixture(scope="module")
def voice(tts: CosyVoice):
    return tts.encode_voice(speech_like(3.0, 16000, seed=0), 16000, TRANSCRIPT)


def synth(tts, voice, text="你好。", stream=False, **options) -> list[np.ndarray]:
    request = SynthesisRequest(text=text, voice=voice, seed=options.pop("seed", 7), **options)
    return list(tts.synthesize(request, stream=stream))


def test_the_folder_decides_the_family(tts: CosyVoice, cv3_dir: Path, tiny_model_dir: Path) -> None:
    assert tts.family is COSYVOICE3 and tts.sample_rate == 24000
    assert tts.token2wav.flow_cache.max_frames == COSYVOICE3.flow_cache_frames  # the DiT cache, its default size
    with pytest.raises(ModelFolderError, match="cosyvoice3.yaml"):
        CosyVoice2.from_model_dir(cv3_dir)
    with pytest.raises(ModelFolderError, match="cosyvoice2.yaml"):
        CosyVoice3.from_model_dir(tiny_model_dir)


def test_each_mode_lays_out_the_cosyvoice3_text_forms(tts: CosyVoice, voice) -> None:
    encode = tts.preprocessor.tokenizer.encode
    prefix = COSYVOICE3.prompt_prefix  # "You are a helpful assistant.<|endofprompt|>"

    def first(**options):
        request = SynthesisRequest(text="你好。", voice=voice, seed=1, **options)
        return tts.pipeline.llm_requests(request, "r", 1)[0]

    zero_shot = first()
    assert zero_shot.prompt_text_tokens == encode(prefix + TRANSCRIPT)  # a plain transcript gets the prefix
    assert zero_shot.prompt_speech_tokens == [int(t) for t in voice.speech_tokens]
    cross = first(mode="cross_lingual")
    assert cross.prompt_text_tokens == [] == cross.prompt_speech_tokens
    assert cross.text_tokens == encode(prefix) + zero_shot.text_tokens  # the prefix before the text
    instruct = first(mode="instruct2", instruct_text=INSTRUCTION)
    assert instruct.prompt_text_tokens == encode(f"You are a helpful assistant. {INSTRUCTION}{END_OF_PROMPT}")
    assert instruct.prompt_speech_tokens == []

    # The official API's forms are taken as they are.
    official = "You are a helpful assistant.<|endofprompt|>希望你以后能够做的比我还好呦。"
    official_voice = type(voice)(**{**vars(voice), "text": official})
    request = SynthesisRequest(text="你好。", voice=official_voice, seed=1)
    assert tts.pipeline.llm_requests(request, "r", 1)[0].prompt_text_tokens == encode(official)
    own = "You are a helpful assistant. 请用尽可能快地语速说一句话。<|endofprompt|>"
    assert first(mode="instruct2", instruct_text=own).prompt_text_tokens == encode(own)
    text = prefix + "[breath]因为他们那一辈人[breath]在乡里面住的要习惯一点。"
    (as_given,) = tts.pipeline.llm_requests(SynthesisRequest(text=text, voice=voice, mode="cross_lingual"), "r", 1)
    assert as_given.text_tokens == encode(text)  # one piece, no second prefix


def test_pronunciation_hints_pass_normalization_and_become_their_tokens(tts: CosyVoice) -> None:
    pieces = tts.preprocessor.split("高管也通过电话等方式对报道[j][ǐ]予好评，第[AA1]名在2024年。")
    assert len(pieces) == 1 and "[j][ǐ]" in pieces[0] and "[AA1]" in pieces[0] and "2024" not in pieces[0]
    (english,) = tts.preprocessor.split("I read [R][EH1][D] it 3 times.")  # wetext alone fails on [EH1]
    assert english == "I read [R][EH1][D] it three times."
    tokenizer = tts.preprocessor.tokenizer
    hint_ids = [tokenizer.token_to_id(t) for t in ("[R]", "[EH1]", "[D]")]
    ids = tokenizer.encode(english)
    assert any(ids[i:i + 3] == hint_ids for i in range(len(ids)))


# Seeds whose random LLM speaks long enough for two chunks (a random head often samples one of its 200 stop ids).
@pytest.mark.parametrize("mode,extra,seed", [("zero_shot", {}, 4), ("cross_lingual", {}, 3),
                                             ("instruct2", {"instruct_text": INSTRUCTION}, 5)])
def test_every_mode_offline_and_streamed(tts: CosyVoice, voice, mode: str, extra: dict, seed: int) -> None:
    (offline,) = synth(tts, voice, mode=mode, seed=seed, **extra)
    streamed = synth(tts, voice, stream=True, mode=mode, seed=seed, **extra)
    assert offline.dtype == np.float32 and np.isfinite(offline).all() and offline.size % SAMPLES_PER_FRAME == 0
    assert 0 < np.abs(offline).max() <= 0.99 + 1e-6
    # The same seed: the same tokens, so the same length; streamed, the flow attends by chunks (as the official),
    # so the samples differ from the offline pass.
    assert sum(c.size for c in streamed) == offline.size and len(streamed) >= 2
    again = synth(tts, voice, stream=True, mode=mode, seed=seed, **extra)
    assert np.array_equal(np.concatenate(again), np.concatenate(streamed))


@pytest.mark.parametrize("mode,extra,seed", [("zero_shot", {}, 3), ("cross_lingual", {}, 2),
                                             ("instruct2", {"instruct_text": INSTRUCTION}, 1)])
def test_bistream_text_speaks_the_same_however_it_is_cut(tts: CosyVoice, voice, mode: str, extra: dict,
                                                         seed: int) -> None:
    """Text fed as it is written (the official CosyVoice3 LM's bistream input): the same seed gives the same audio
    for any cut of the same text, streamed in chunks."""
    def run(first: str, rest: list[str]) -> list[np.ndarray]:
        request = SynthesisRequest(text=first, voice=voice, seed=seed, mode=mode, **extra)
        return list(tts.pipeline.run_bistream(request, iter(rest), stream=True))

    a = run("Hello there, ", ["how are you ", "today?"])
    b = run("Hello ", ["there, how ", "are you", " today?"])
    assert len(a) >= 2 and np.array_equal(np.concatenate(a), np.concatenate(b))


def test_same_seed_same_audio_other_seed_other_audio(tts: CosyVoice, voice) -> None:
    a, b, c = (np.concatenate(synth(tts, voice, "你好，世界。", seed=s)) for s in (3, 3, 4))
    assert np.array_equal(a, b)
    assert a.shape != c.shape or not np.allclose(a, c)


def test_speed_and_voice_conversion(tts: CosyVoice, voice) -> None:
    (normal,) = synth(tts, voice)
    (fast,) = synth(tts, voice, speed=2.0)
    assert fast.size == normal.size // SAMPLES_PER_FRAME // 2 * SAMPLES_PER_FRAME
    converter = local_converter(tts)
    request = ConversionRequest(source=speech_like(2.0, 16000, seed=4), sample_rate=16000, voice=voice, seed=2)
    (offline,) = list(converter.run(request, stream=False))
    streamed = list(converter.run(request, stream=True))
    assert offline.size == 2 * 50 * SAMPLES_PER_FRAME and sum(c.size for c in streamed) == offline.size  # 50 tokens
    assert len(streamed) >= 2 and np.isfinite(offline).all()


def test_concurrent_requests_through_the_serving_stages_equal_their_solo_runs(tts: CosyVoice, voice) -> None:
    """The LLM scheduler (in-flight batching) and the token2wav scheduler (one flow call for the chunks that
    wait) as a served pipeline runs them: each request alone, then all at once with one cancelled."""
    llm = LLMScheduler(tts.llm, max_batch=4, max_seq_len=1024)
    workers = RowWorkers(CoreShare(ThreadPlan(cores=2, llm=1, token2wav=1)))
    token2wav = Token2WavScheduler(tts.token2wav.flow, tts.token2wav.hift, map_rows=workers.map)
    stage = BatchingToken2WavStage(token2wav, max_batch=4, queue_delay_s=0.05)
    pipeline = Pipeline(tts.preprocessor, LocalLLMStage(llm), stage)
    requests = [SynthesisRequest(text="你好。", voice=voice, seed=11),
                SynthesisRequest(text="欢迎。", voice=voice, seed=12, mode="cross_lingual"),
                SynthesisRequest(text="好的。", voice=voice, seed=13, mode="instruct2", instruct_text=INSTRUCTION)]
    llm.start()
    try:
        alone = [np.concatenate(list(pipeline.run(r, stream=True))) for r in requests]
        results: dict[int, np.ndarray] = {}
        leaving = threading.Event()

        def run(i: int) -> None:
            results[i] = np.concatenate(list(pipeline.run(requests[i], stream=True)))

        def leave() -> None:  # a client that leaves after its first chunk
            chunks = pipeline.run(requests[0], stream=True, is_cancelled=leaving.is_set)
            next(chunks)
            leaving.set()
            try:
                list(chunks)
            except Cancelled:
                results[-1] = np.zeros(0)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)] + [threading.Thread(target=leave)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert -1 in results  # the client that left saw its request cancelled
        assert llm.stats.peak_batch_size >= 2 and token2wav.stats.max_flow_batch >= 2
        assert llm.stats.active_streams == 0 and token2wav.stats.active_streams == 0
    finally:
        llm.stop()
        stage.close()
        workers.close()
    for i, audio in enumerate(alone):
        assert results[i].size == audio.size  # the same tokens
        np.testing.assert_allclose(results[i], audio, rtol=0, atol=1e-6)  # a call's thread count: ~1e-7


def test_saved_speakers_import_with_their_prompt_text_as_saved(tts: CosyVoice, cv3_dir: Path, tmp_path: Path) -> None:
    """spk2info.pt as the official CosyVoice3 `add_zero_shot_spk` saves it (the prompt text in its official form):
    the voice speaks with exactly the saved prompt tokens."""
    from cosyvoice_triton.cli import main
    from cosyvoice_triton.voices.stores import open_voice_store

    encode = tts.preprocessor.tokenizer.encode
    saved = encode(COSYVOICE3.prompt_prefix + "[breath]" + TRANSCRIPT)
    speech = torch.randint(0, 6561, (1, 30), generator=torch.Generator().manual_seed(0), dtype=torch.int32)

    def length(x):
        return torch.tensor([x.shape[1]], dtype=torch.int32)

    feat, embedding = torch.randn(1, 60, 80) - 4.0, torch.randn(1, 192)
    entry = {"prompt_text": torch.tensor([saved], dtype=torch.int32), "llm_prompt_speech_token": speech,
             "flow_prompt_speech_token": speech, "prompt_speech_feat": feat, "llm_embedding": embedding,
             "flow_embedding": embedding}
    entry.update({f"{k}_len": length(entry[k]) for k in ("prompt_text", "llm_prompt_speech_token",
                                                         "flow_prompt_speech_token", "prompt_speech_feat")})
    torch.save({"spk": entry}, tmp_path / "spk2info.pt")
    store_path = tmp_path / "voices.sqlite"
    assert main(["voices", "import", str(tmp_path / "spk2info.pt"), "--model-dir", str(cv3_dir),
                 "--voice-store", str(store_path)]) == 0
    store = open_voice_store(str(store_path))
    try:
        stored = store.get("spk", family="cosyvoice3")
    finally:
        store.close()
    request = SynthesisRequest(text="你好。", voice=stored, seed=1)
    assert tts.pipeline.llm_requests(request, "r", 1)[0].prompt_text_tokens == saved
    (audio,) = tts.synthesize(request)
    assert audio.size % SAMPLES_PER_FRAME == 0 and np.isfinite(audio).all()
