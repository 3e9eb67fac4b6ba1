"""First audible audio (cosyvoice_triton/pipeline/audible.py): in the first 10 ms window above -50 dBFS (a
window tried at every sample), the first sample above -50 dBFS; the same whole or in chunks; the time is the
arrival of the chunk that holds that sample. Then where it is reported without a server: the Triton model's
histogram (send_chunks with fake pb_utils), the model parameter and the gateway's flag, and the bench's
report and results.json. The served paths are in test_gateway.py (metric, WebSocket end message),
test_openai_api.py (access line) and test_web_page.py (the timeline's mark)."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

import pb_fake
from cosyvoice_triton.pipeline.audible import AudibleDetector, first_audible

RATE = 24000
WINDOW = 240  # 10 ms at 24 kHz
ONSET = 1000  # the silence before the sound


def silent_start(amplitude: float = 0.015, length: int = 3000) -> np.ndarray:
    """ONSET samples of silence, then a constant `amplitude` (its RMS: 20 log10(amplitude) dBFS)."""
    audio = np.zeros(length, np.float32)
    audio[ONSET:] = amplitude
    return audio


def needed(amplitude: float, threshold_dbfs: float = -50.0) -> int:
    """Samples of the sound a window needs to be above the threshold (more than WINDOW * level / amplitude²)."""
    return int(np.floor(WINDOW * 10 ** (threshold_dbfs / 10) / amplitude ** 2)) + 1


def test_a_stream_that_starts_with_silence():
    """The first window above -50 dBFS starts needed(a) - WINDOW samples before the onset; its first sample
    above -50 dBFS is the onset itself."""
    assert needed(0.015) == 11  # 0.015 (-36.5 dBFS): 10.67 samples of it lift a 240-sample window over -50 dBFS
    assert first_audible(silent_start(0.015), RATE) == ONSET
    assert first_audible(silent_start(0.004), RATE) == ONSET  # -48 dBFS: the window needs 150 samples of it
    assert first_audible(silent_start(0.002), RATE) is None  # -54 dBFS
    assert first_audible(silent_start(0.002), RATE, threshold_dbfs=-60.0) == ONSET
    # a click too short to lift a window is not heard; the sound after it is
    audio = silent_start(0.015)
    audio[300:305] = 0.02  # 5 samples: a window holds 5 * 4e-4 = 2e-3 < 240 * 1e-5
    assert first_audible(audio, RATE) == ONSET
    audio[300:310] = 0.05  # 10 samples: 2.5e-2, above
    assert first_audible(audio, RATE) == 300
    # the sound begins quietly (-70 dBFS, below the level) inside the first window above it
    audio = silent_start(0.015)
    audio[ONSET - 100:ONSET] = 10 ** (-70 / 20)
    assert first_audible(audio, RATE) == ONSET


@pytest.mark.parametrize("sizes", [[3000], [1], [7] * 500, [ONSET - 100, 95, 10, 2000], [ONSET, 5, 5000],
                                   [ONSET + 1, 5000], [ONSET + needed(0.015), 5000]])
def test_the_same_offset_across_chunk_boundaries_and_the_time_of_its_chunk(sizes):
    audio = silent_start()
    chunks = [c for c in np.split(audio, np.cumsum(sizes)[:-1]) if c.size]
    holder = int(np.searchsorted(np.cumsum([len(c) for c in chunks]), ONSET, side="right"))
    detector = AudibleDetector(RATE)
    found = [detector.feed(chunk, at=float(k)) for k, chunk in enumerate(chunks)]
    assert detector.offset == ONSET and found.count(True) == 1
    assert detector.at == float(holder)  # the arrival of the chunk that holds the sample, not the one that told
    assert not detector.finish()


def test_a_window_completed_by_a_later_chunk_is_timed_at_the_chunk_that_holds_the_sound():
    audio = silent_start()
    detector = AudibleDetector(RATE)
    assert not detector.feed(audio[:ONSET + 5], at=1.0)  # the onset, but no window above the threshold yet
    assert detector.feed(audio[ONSET + 5:], at=2.0)
    assert (detector.offset, detector.at) == (ONSET, 1.0)
    # a silent chunk whose last window reaches into the next chunk's sound is not the one heard
    detector = AudibleDetector(RATE)
    assert not detector.feed(audio[:ONSET], at=1.0)
    assert detector.feed(audio[ONSET:], at=2.0) and (detector.offset, detector.at) == (ONSET, 2.0)


def test_silence_after_the_end_and_silent_streams():
    short = np.zeros(100, np.float32)  # shorter than a window: only windows that run past the end exist
    short[-20:] = 0.5
    detector = AudibleDetector(RATE)
    assert not detector.feed(short[:80], 0.0) and not detector.feed(short[80:], 1.0)
    assert detector.finish() and (detector.offset, detector.at) == (80, 1.0)
    assert first_audible(np.zeros(RATE, np.float32), RATE) is None
    assert first_audible(np.full(RATE, 10 ** (-60 / 20), np.float32), RATE) is None  # -60 dBFS throughout
    assert first_audible(np.zeros(0, np.float32), RATE) is None
    with pytest.raises(ValueError):
        AudibleDetector(RATE, window_ms=0)


def test_the_triton_model_observes_first_audible_after_first_chunk():
    """send_chunks (the cosyvoice2 model): the first chunk is silent, the second holds the sound: the
    histogram gets one observation, the second chunk's send time; a silent stream gets none."""
    from cosyvoice_triton.triton.metrics import SYNTHESIS, ModelMetrics
    from cosyvoice_triton.triton.decoupled import send_chunks

    def stream(chunks):
        with pb_fake.installed() as pb:
            metrics = ModelMetrics(pb, SYNTHESIS, {"model": "cosyvoice2", "instance": "i"})
            request = pb.InferenceRequest()
            assert send_chunks(pb, request.sender, lambda: (c for c in chunks), model="cosyvoice2", received_at=0.0,
                               metrics=metrics) == "ok"
            return {key: list(metrics[key]._metric.observations) for key in ("first_chunk", "first_audible")}

    observed = stream([np.zeros(2400, np.float32), np.full(2400, 0.1, np.float32)])
    assert len(observed["first_chunk"]) == 1 and len(observed["first_audible"]) == 1
    assert observed["first_audible"][0] > observed["first_chunk"][0]  # sent with the second chunk, not the first
    assert stream([np.zeros(2400, np.float32)] * 2)["first_audible"] == []


def test_the_model_parameter_and_the_gateway_flag():
    from cosyvoice_triton.gateway.config import add_gateway_arguments, config_from_args
    from cosyvoice_triton.server.launcher import DEFAULT_REPOSITORY
    from cosyvoice_triton.triton.params import CosyVoice2Params

    assert CosyVoice2Params.audible_threshold_dbfs == -50.0
    assert 'key: "audible_threshold_dbfs"' in (DEFAULT_REPOSITORY / "cosyvoice2" / "config.pbtxt").read_text()
    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)  # `up` and `python -m cosyvoice_triton.gateway` both add these
    assert config_from_args(parser.parse_args([])).audible_threshold_dbfs == -50.0
    assert config_from_args(parser.parse_args(["--audible-threshold-dbfs", "-40"])).audible_threshold_dbfs == -40.0


def test_the_bench_measures_and_reports_first_audible(tmp_path):
    """loadgen's request on a stream whose first chunk is silent: first audible at the second chunk's
    arrival; the report's table and results.json carry it."""
    import asyncio

    from cosyvoice_triton.perf import loadgen, report

    class Stream:
        stats = argparse.Namespace(sample_rate=RATE)

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

        async def __aiter__(self):
            for chunk in (np.zeros(2400, np.float32), np.full(2400, 0.1, np.float32)):
                await asyncio.sleep(0.01)
                yield chunk

    class Target:
        async def stream(self, case, voice_id, seed, options):
            return Stream()

    result = asyncio.run(loadgen.one_request(Target(), None, None, 0))
    assert result.error is None and result.first_audible_s == result.arrivals[1] > result.first_chunk_s
    summary = loadgen.LevelResult(1, 1.0, [result]).summary()
    assert summary["first_audible_p50_s"] == result.first_audible_s
    paths = report.write_texts(tmp_path, report.markdown([summary], {"scenario": "s"}), {"levels": [summary]})
    text = paths["markdown"].read_text()
    assert "first audible p50 / p90 / p99" in text and f"| {1000 * result.first_audible_s:.0f} / " in text
    assert json.loads(paths["json"].read_text())["levels"][0]["first_audible_p99_s"] == result.first_audible_s


def test_the_official_driver_times_first_audible_with_our_module():
    """bench_official's official side runs in the official virtualenv: it loads pipeline/audible.py by the
    path bench_official passes, and times the official chunks by the same rule."""
    import time
    from pathlib import Path

    import torch

    from cosyvoice_triton.perf import bench_official, official_driver
    from cosyvoice_triton.pipeline import audible

    class OfficialModel:
        def tts(self, **inputs):
            yield {"tts_speech": torch.zeros(1, 2400)}
            time.sleep(0.002)  # the second chunk arrives later
            yield {"tts_speech": torch.full((1, 2400), 0.1)}

    def our_chunks():
        yield np.zeros(2400, np.float32)
        time.sleep(0.002)
        yield np.full(2400, 0.1, np.float32)

    command = bench_official.official_command(Path("python"), argparse.Namespace(
        official_src="src", model_dir="m", speech_tokens=4, threads=1, device="cpu"), Path("inputs.npz"))
    module = official_driver.load_audible(Path(command[command.index("--audible-module") + 1]))
    assert module is not audible and module.DEFAULT_THRESHOLD_DBFS == audible.DEFAULT_THRESHOLD_DBFS
    result: dict = {}
    inputs = dict.fromkeys(("text", "embedding", "prompt_text", "prompt_speech", "mel"))
    official_driver.one_stream(OfficialModel(), inputs, RATE, result, module)
    assert result["first_audible_s"] > result["first_s"] and result["chunks"] == 2
    timed = bench_official.timed_stream(our_chunks(), RATE)
    assert timed["first_audible_s"] > timed["first_s"]
    summary = bench_official.summary([{"streams": [result, timed], "wall_s": 1.0}])
    assert summary["first_audible_s"] > summary["first_audio_s"]
    assert np.isnan(bench_official.summary([{"streams": [{**timed, "first_audible_s": None}], "wall_s": 1.0}])[
        "first_audible_s"])  # silent throughout (or an older round without it)
