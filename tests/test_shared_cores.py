"""The core share across processes (pipeline/shared_cores.py): units of the LLM and token2wav in different
processes take their threads and wait for each other as in one process; a dead process holds nothing;
and a served stream with the share on is the in-process pipeline's audio."""
from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_triton.messages import ChunkPolicy, ChunkRequest, SynthesisRequest
from cosyvoice_triton.pipeline.shared_cores import SLOT, SLOTS, SharedCoreShare, process_start
from cosyvoice_triton.pipeline.threads import ThreadPlan, chunk_unit

PLAN = ThreadPlan(cores=6, llm=2, token2wav=4)
FORK = multiprocessing.get_context("fork")


def _hold(path: str, module: str, threads: int | None, alone: bool, entered, release, exit_inside: bool) -> None:
    """A child process: run one unit of `module` until `release` is set (or die inside it)."""
    share = SharedCoreShare(path, PLAN)
    with share.running(module, threads, alone=alone):
        entered.set()
        if exit_inside:
            os._exit(0)  # dies holding the unit: no _leave
        release.wait(60)
    share.close()


def _child(path: Path, module: str, threads: int | None = None, alone: bool = False, exit_inside: bool = False):
    entered, release = FORK.Event(), FORK.Event()
    process = FORK.Process(target=_hold, args=(str(path), module, threads, alone, entered, release, exit_inside))
    process.start()
    assert entered.wait(60)
    return process, release


def test_an_llm_unit_gets_every_core_alone_and_its_share_beside_token2wav_in_another_process(tmp_path) -> None:
    share = SharedCoreShare(tmp_path / "cores", PLAN)
    with share.running("llm") as threads:
        assert threads == 6
    assert share.idle("token2wav")
    child, release = _child(tmp_path / "cores", "token2wav", 4)
    assert not share.idle("token2wav") and share.idle("llm")  # what the flow's RowWorkers look at
    with share.running("llm") as threads:
        assert threads == 2  # token2wav is busy in the other process
    release.set()
    child.join(60)
    assert share.idle("token2wav")
    with share.running("llm") as threads:
        assert threads == 6
    share.close()


def test_a_first_chunk_in_another_process_waits_for_the_decode_round_and_holds_off_the_next(tmp_path) -> None:
    path = tmp_path / "cores"
    share = SharedCoreShare(path, PLAN)
    entered, release = FORK.Event(), FORK.Event()
    chunk = FORK.Process(target=_hold, args=(str(path), "token2wav", 6, True, entered, release, False))
    with share.running("llm"):
        chunk.start()
        assert not entered.wait(0.5)  # the alone unit waits for the decode round in progress
    assert entered.wait(60)  # the round ended: the first chunk runs
    order: list[str] = []

    def next_round() -> None:
        with share.running("llm") as threads:
            order.append(f"llm round on {threads}")

    round_thread = threading.Thread(target=next_round)
    round_thread.start()
    round_thread.join(0.5)  # it waits for the first chunk's end
    order.append("first chunk ends")
    release.set()
    round_thread.join(60)
    chunk.join(60)
    assert order == ["first chunk ends", "llm round on 6"]
    share.close()


def test_a_dead_process_never_holds_the_cores(tmp_path) -> None:
    path = tmp_path / "cores"
    child, _ = _child(path, "token2wav", 6, alone=True, exit_inside=True)
    child.join(60)
    share = SharedCoreShare(path, PLAN)
    with share.running("llm") as threads:  # the dead process's alone unit counts for nothing
        assert threads == 6
    slots = [SLOT.unpack_from(path.read_bytes(), i * SLOT.size) for i in range(SLOTS)]
    assert [slot[0] for slot in slots if slot[0]] == [os.getpid()]  # its slot was cleared
    share.close()


def test_slots_name_a_process_by_pid_and_start_time(tmp_path) -> None:
    assert process_start(os.getpid()) is not None
    child = FORK.Process(target=time.sleep, args=(0,))
    child.start()
    child.join()
    assert process_start(child.pid) is None
    one, two = SharedCoreShare(tmp_path / "cores", PLAN), SharedCoreShare(tmp_path / "cores", PLAN)
    data = (tmp_path / "cores").read_bytes()
    assert [SLOT.unpack_from(data, i * SLOT.size)[0] for i in range(3)] == [os.getpid(), os.getpid(), 0]
    one.close()
    two.close()


def _chunk(first: bool = False, finalize: bool = False) -> ChunkRequest:
    prompt = object() if first else None
    return ChunkRequest(stream_id="s", tokens=[1, 2, 3], finalize=finalize, prompt=prompt,  # type: ignore[arg-type]
                        seed=0)


def test_a_token2wav_call_takes_every_core_alone_for_a_first_chunk_and_beside_the_llm_for_a_last() -> None:
    assert chunk_unit(PLAN, [_chunk()]) == (4, False)
    assert chunk_unit(PLAN, [_chunk(), _chunk(first=True)]) == (6, True)
    assert chunk_unit(PLAN, [_chunk(), _chunk(finalize=True)]) == (6, False)
    assert chunk_unit(PLAN, [_chunk(first=True)], first_chunk_alone=False) == (4, False)


# ---- served: llm and token2wav of one tritonserver share the cores --------------------------------

RATIO = 3.0
RATE = 16000
PROMPT_TEXT = "a short voice prompt"
TEXT = "The train was late again. Nobody on the platform seemed surprised, and some of them laughed."
ATOL = 2e-4  # batched flow and vocoder calls: float rounding only (as tests/test_triton_serving.py)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    from cosyvoice_triton.random_folder.write import write_random_model
    from cosyvoice_triton.server.launcher import ServeOptions, prepare
    from triton_harness import tritonserver_or_skip

    binary = tritonserver_or_skip()
    model_dir = write_random_model(tmp_path_factory.mktemp("tiny") / "model", size="tiny", seed=0)
    run_dir = tmp_path_factory.mktemp("serve")
    options = ServeOptions(model_dir=model_dir, run_dir=run_dir, address="127.0.0.1", http_port=None, grpc_port=None,
                           metrics_port=None, voice_store=str(run_dir / "voices.sqlite"), max_token_text_ratio=RATIO,
                           workers=4)  # torch_threads 0: the core share
    server = prepare(options, binary=binary, die_with_parent=True)
    server.start()
    yield server, model_dir, run_dir
    server.stop()


def _served(url: str, wav: np.ndarray, seed: int) -> list[np.ndarray]:
    from cosyvoice_triton.client.triton_client import synthesis_request
    from triton_harness import GrpcStream

    with GrpcStream(url, timeout_s=180) as stream:
        responses = stream.infer("cosyvoice2", synthesis_request(TEXT, prompt_audio=wav, prompt_sample_rate=RATE,
                                                                prompt_text=PROMPT_TEXT, seed=seed).tensors())
    assert all(r.error is None for r in responses), [r.error for r in responses]
    return [r.outputs["waveform"].reshape(-1) for r in responses if r.outputs and r.outputs["waveform"].size]


def test_served_streams_with_the_core_share_are_the_in_process_pipelines_audio(shared_server) -> None:
    """Both processes map the run folder's share; each served stream (two at once, so their chunks meet
    in flow batches and first chunks run alone beside the other's decoding) equals the in-process
    pipeline with its own core share, and no unit is left counted afterwards."""
    from cosyvoice_triton.pipeline.cosyvoice2 import CosyVoice2
    from cosyvoice_triton.random_folder.sample_prompt import speech_like

    server, model_dir, run_dir = shared_server
    wavs = [speech_like(1.5 + 0.25 * i, RATE, seed=i, pitch_hz=95.0 + 12 * i) for i in range(2)]
    got: dict[int, list[np.ndarray]] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _served(server.grpc_url, wavs[i], 7 + i)))
               for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    tts = CosyVoice2.from_model_dir(model_dir)
    tts.llm.config.max_token_text_ratio = RATIO
    for i, wav in enumerate(wavs):
        request = SynthesisRequest(text=TEXT, voice=tts.encode_voice(wav, RATE, PROMPT_TEXT), mode="zero_shot",
                                   instruct_text="", seed=7 + i, sampling=tts.llm.config.sampling,
                                   chunk_policy=ChunkPolicy())
        want = [c for c in tts.synthesize(request, stream=True) if c.size]
        assert [c.size for c in got[i]] == [c.size for c in want]
        np.testing.assert_allclose(np.concatenate(got[i]), np.concatenate(want), rtol=0, atol=ATOL)
    data = (run_dir / "core_share").read_bytes()
    slots = [SLOT.unpack_from(data, i * SLOT.size) for i in range(SLOTS)]
    live = [slot for slot in slots if slot[0] and process_start(slot[0]) == slot[1]]
    assert len(live) == 2 and all(not any(slot[2:]) for slot in live)  # llm and token2wav; nothing counted now
    assert "cores shared with token2wav" in server.log_path.read_text()
