"""The web page (gateway/static) in headless Chromium, served by the real gateway in front of a real
tritonserver (tests/web/stack.py), driven over the DevTools protocol (tests/web/cdp_browser.py).

A person's path through the page: pick the default voice, type, press Speak: the page streams over the
WebSocket and plays the chunks through Web Audio, showing the first-chunk latency, the audio seconds
received, the chunk timeline and the live waveform of what has played; register a voice from an uploaded
file and from the (fake) microphone; see each error beside the control that caused it; read the notice that
the served model is random; convert a recording in the convert tab (POST /v1/vc).
Screenshots go to the test's tmp dir (their paths are printed; run with -s to see them).
"""
from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cosyvoice_triton.client import GatewayTTS, write_wav
from cosyvoice_triton.random_folder.marker import NOTE as RANDOM_NOTE
from cosyvoice_triton.random_folder.sample_prompt import speech_like
from web.cdp_browser import Chromium, Page, find_chromium
from web.stack import serve_stack

pytest.importorskip("cosyvoice_triton.gateway.app", reason="the gateway (cosyvoice_triton.gateway.app) is missing")


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    if find_chromium() is None:
        pytest.skip("no chromium to run the page in (Debian: apt-get install chromium; or set CHROMIUM)")
    with serve_stack(tmp_path_factory.mktemp("web_page"), tiny_model_dir) as stack:
        yield stack


@pytest.fixture(scope="module")
def browser(stack, tmp_path_factory):
    with Chromium.launch(tmp_path_factory.mktemp("chromium") / "profile") as browser:
        yield browser


@pytest.fixture
def page(browser, stack):
    page = browser.new_page()
    page.goto(stack.gateway_url + "/")
    page.wait_for("document.querySelector('#server').dataset.ready === 'yes'", 60)
    page.wait_for("!!document.querySelector('#voice option[value=\"default\"]')", 30)
    yield page
    assert page.errors == [], page.errors  # no uncaught exception in the page
    page.call("Page.close")


@contextmanager
def page_at(gateway_url: str, profile: Path) -> Iterator[Page]:
    """A page of a Chromium of its own at the gateway's `/`, once it says its server is ready (skips without
    Chromium), for a module that checks the page on its own deployment; no uncaught exception at the end."""
    if find_chromium() is None:
        pytest.skip("no chromium to run the page in (Debian: apt-get install chromium; or set CHROMIUM)")
    with Chromium.launch(profile) as browser:
        page = browser.new_page()
        page.goto(gateway_url + "/")
        page.wait_for("document.querySelector('#server').dataset.ready === 'yes'", 60)
        yield page
        assert page.errors == [], page.errors


def speak(page, text: str, timeout_s: float = 120.0) -> str:
    page.fill("#text", text)
    page.click("#speak")
    return page.wait_for("['done', 'error'].includes(document.querySelector('#status').dataset.state) "
                         "&& document.querySelector('#status').dataset.state", timeout_s)


def shown_errors(page, scope: str = "main") -> dict[str, str]:
    """The error messages shown now under `scope`: {id of the control beside it: message}."""
    return page.evaluate(f"""Object.fromEntries([...document.querySelectorAll({json.dumps(scope)} + ' .error')]
        .filter(box => !box.hidden).map(box => [box.id.replace(/-error$/, ''), box.textContent]))""")


ADD_VOICE = "[aria-labelledby=add-title]"


def registered(page, timeout_s: float = 60.0) -> None:
    """Wait for the registration's outcome; fail with the page's error messages if it failed."""
    page.wait_for("document.querySelector('#register-status').textContent.startsWith('Registered') "
                  f"|| !!document.querySelector('{ADD_VOICE} .error:not([hidden])')", timeout_s)
    assert page.text("#register-status").startswith("Registered"), shown_errors(page, ADD_VOICE)


def set_file(page, selector: str, path) -> None:
    document = page.call("DOM.getDocument")["root"]["nodeId"]
    node = page.call("DOM.querySelector", {"nodeId": document, "selector": selector})["nodeId"]
    page.call("DOM.setFileInputFiles", {"files": [str(path)], "nodeId": node})


def waveform(page, selector: str) -> dict:
    """The waveform canvas's state: seconds received and played, columns drawn and played, and how many
    pixels are in the played colour."""
    return page.evaluate(f"""(() => {{
        const canvas = document.querySelector({json.dumps(selector)});
        const played = getComputedStyle(canvas).getPropertyValue('--played').trim();
        const probe = document.createElement('canvas').getContext('2d');
        probe.fillStyle = played; probe.fillRect(0, 0, 1, 1);
        const want = probe.getImageData(0, 0, 1, 1).data;
        const pixels = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
        let playedPixels = 0;
        for (let i = 0; i < pixels.length; i += 4) {{
            if (pixels[i] === want[0] && pixels[i + 1] === want[1] && pixels[i + 2] === want[2] && pixels[i + 3] > 0)
                playedPixels += 1;
        }}
        return {{hidden: canvas.parentElement.hidden, received: +canvas.dataset.receivedSeconds,
                 played: +canvas.dataset.playedSeconds, columns: +canvas.dataset.columns,
                 playedColumns: +canvas.dataset.playedColumns, playedPixels}};
    }})()""")


def shot(page, tmp_path, name: str):
    path = page.screenshot(tmp_path / f"{name}.png")
    print(f"screenshot: {path}")
    return path


def test_speak_streams_audio_into_web_audio_and_shows_the_latency(page, tmp_path):
    assert page.evaluate("document.querySelector('#voice').value") == "default"
    page.select("#voice", "default")
    assert "default voice" in page.text("#voice-info")
    page.fill("#seed", "9007199254740993")  # 2^53 + 1: more than a JavaScript number holds exactly
    state = speak(page, "Hello from the web page. It plays the audio while it streams in.")
    assert state == "done", page.text("#error")
    first_ms = float(page.text("#first-chunk"))
    seconds = float(page.text("#audio-seconds"))
    assert first_ms > 0 and seconds > 0
    assert int(page.text("#chunks")) >= 1 and page.text("#used-seed") == "9007199254740993"
    assert shown_errors(page) == {}
    assert not page.evaluate("document.querySelector('#download').hidden")  # a WAV of what was received
    # "done" comes after the last scheduled AudioBufferSourceNode ended: the audio went through Web Audio.
    assert page.evaluate("document.querySelector('#stop').disabled && !document.querySelector('#speak').disabled")
    # the chunk timeline: one mark per chunk received, the stall count beside it
    assert not page.evaluate("document.querySelector('#timeline-figure').hidden")
    assert page.evaluate("document.querySelectorAll('#timeline .chunk-mark').length") == int(page.text("#chunks"))
    assert page.evaluate("document.querySelectorAll('#timeline .stall-mark').length") == int(page.text("#stalls"))
    # the random model speaks noise: its first audible audio is marked, at a chunk's arrival, not before the first
    audible_ms = float(page.text("#first-audible"))
    assert page.evaluate("document.querySelectorAll('#timeline .audible-mark').length") == 1
    assert audible_ms >= first_ms
    # the waveform: all that was received, and (at "done") all of it played, in the played colour
    drawn = waveform(page, "#waveform")
    assert not drawn["hidden"] and drawn["received"] == pytest.approx(seconds, abs=0.01)
    assert drawn["played"] == pytest.approx(drawn["received"], abs=1e-3)
    assert drawn["columns"] > 0 and drawn["playedColumns"] == drawn["columns"] and drawn["playedPixels"] > 0
    shot(page, tmp_path, "spoken")


def test_the_waveform_draws_each_columns_lowest_and_highest_sample(page):
    peaks = page.evaluate("waveformPeaks(new Float32Array([0, 1, -1, 0.5, 0.25, -0.5]), 3)")
    assert peaks == [[0, 1], [-1, 0.5], [-0.5, 0.25]]
    assert page.evaluate("waveformPeaks(new Float32Array([0.5, -0.25]), 600)") == [[0.5, 0.5], [-0.25, -0.25]]


def test_the_page_says_the_model_is_random(page):
    """The stack serves a random folder (RANDOM_WEIGHTS): the page says it speaks noise and how to serve
    the released folder, with the server's own words from /readyz."""
    assert page.evaluate("!document.querySelector('#model-notice').hidden")
    notice = page.text("#model-notice")
    assert "speaks noise" in notice and "--model-dir" in notice and "COSYVOICE_MODEL_DIR" in notice
    assert page.text("#model-note") == RANDOM_NOTE


def test_the_timeline_counts_stalls_as_the_benchmarks_do(page):
    """The page's listener on hand-made arrivals (those of tests/test_playback.py): a chunk 0.25 s late is
    one stall of 0.25 s, and playback resumes from that chunk."""
    chunks = json.loads(page.evaluate("JSON.stringify(listen([0, 1.25, 1.5], [1, 0.5, 0.5]))"))
    assert [round(c["stall"], 6) for c in chunks] == [0, 0.25, 0]
    assert [round(c["playFrom"], 6) for c in chunks] == [0, 1.25, 1.75]
    assert [c["end"] for c in chunks] == [1, 1.5, 2]


def test_the_timeline_marks_first_audible_audio_at_the_chunk_that_holds_it(page):
    """The page's detector on a stream whose first chunk is silent and whose second starts with 5 ms of
    silence: the same first audible sample as cosyvoice_triton/pipeline/audible.py, in chunk 1, and the
    timeline's mark at that chunk's arrival (its dot's x)."""
    import numpy as np

    from cosyvoice_triton.pipeline.audible import first_audible

    chunks = [np.zeros(2400, np.float32), np.concatenate([np.zeros(120), np.full(2280, 0.1)]).astype(np.float32)]
    want = first_audible(np.concatenate(chunks), 24000)
    got = page.evaluate(f"""(() => {{
        const detector = new AudibleDetector(24000);
        const chunks = {json.dumps([c.tolist() for c in chunks])}.map((c) => new Float32Array(c));
        const found = chunks.map((c) => detector.feed(c));
        const svg = document.querySelector('#timeline');
        drawTimeline(svg, [0.5, 0.75], [0.1, 0.1], detector.chunk);
        const mark = svg.querySelector('.audible-mark');
        const dots = [...svg.querySelectorAll('.chunk-mark')].map((dot) => +dot.getAttribute('cx'));
        return {{offset: detector.offset, chunk: detector.chunk, found, x: mark && +mark.getAttribute('x1'),
                 markChunk: mark && +mark.dataset.chunk, dots}};
    }})()""")
    assert want == 2400 + 120 and got["offset"] == want and got["chunk"] == 1 and got["found"] == [False, True]
    assert got["markChunk"] == 1 and got["x"] == pytest.approx(got["dots"][1])
    silent = page.evaluate("(() => { const d = new AudibleDetector(24000); d.feed(new Float32Array(4800)); "
                           "return [d.finish(), d.chunk]; })()")
    assert silent == [False, None]


def test_register_an_uploaded_voice_and_speak_with_it(page, tmp_path):
    prompt = write_wav(tmp_path / "upload.wav", speech_like(1.6, 16000, seed=31), 16000)
    set_file(page, "#voice-file", prompt)
    page.fill("#voice-text", "a short voice prompt")
    page.fill("#voice-name", "Uploaded")
    page.fill("#voice-id", "page_upload")
    page.click("#register")
    registered(page)
    assert page.evaluate("document.querySelector('#voice').value") == "page_upload"
    assert "Uploaded (page_upload)" in page.evaluate(
        "document.querySelector('#voice').selectedOptions[0].textContent")
    assert speak(page, "A cloned voice speaks.") == "done", page.text("#error")
    assert float(page.text("#audio-seconds")) > 0
    shot(page, tmp_path, "uploaded")


def test_record_a_voice_with_the_microphone(page, stack, tmp_path):
    page.click("#record")
    page.wait_for("document.querySelector('#record').getAttribute('aria-pressed') === 'true'", 10)
    page.evaluate("new Promise(resolve => setTimeout(resolve, 1500))")  # ~1.5 s of the fake microphone
    page.click("#record")
    page.wait_for("document.querySelector('#register-status').textContent.startsWith('Recording ready')", 20)
    page.fill("#voice-text", "a beep from the fake microphone")
    page.click("#register")
    registered(page)
    voice_id = page.evaluate("document.querySelector('#voice').value")
    with GatewayTTS(stack.gateway_url) as tts:
        info = tts.get_voice(voice_id)
    assert info.prompt_text == "a beep from the fake microphone" and info.prompt_seconds >= 1.0
    shot(page, tmp_path, "recorded")


def test_stop_cancels_the_stream_on_the_server(page, stack, tmp_path):
    from triton_harness import metric_value, scrape, wait_for_metric

    metrics_url = stack.triton.metrics_url
    before = metric_value(scrape(metrics_url), "cosyvoice_requests_total", model="cosyvoice2", outcome="cancelled") or 0
    endless = " ".join(["This sentence keeps the stream going on and on."] * 25)  # one long sentence could end early
    page.fill("#text", endless)
    page.click("#speak")
    page.wait_for("document.querySelector('#status').dataset.state === 'streaming'", 120)
    page.click("#stop")
    assert page.text("#status") == "Stopped" and float(page.text("#audio-seconds")) > 0
    assert page.evaluate("!document.querySelector('#speak').disabled") and shown_errors(page) == {}
    drawn = waveform(page, "#waveform")  # kept as it was when stopped: no more than what was received
    assert not drawn["hidden"] and 0 <= drawn["played"] <= drawn["received"]
    wait_for_metric(metrics_url, "cosyvoice_requests_total", lambda v: v is not None and v >= before + 1,
                    model="cosyvoice2", outcome="cancelled")
    wait_for_metric(metrics_url, "cosyvoice_active_streams", lambda v: v == 0, model="cosyvoice2")
    wait_for_metric(metrics_url, "cosyvoice_llm_active_streams", lambda v: v == 0, model="llm")  # slots freed
    shot(page, tmp_path, "stopped")


def test_a_server_error_is_shown_beside_the_voice(page, stack, tmp_path):
    with GatewayTTS(stack.gateway_url) as tts:
        tts.add_voice(write_wav(tmp_path / "gone.wav", speech_like(1.2, 16000, seed=41), 16000),
                      "a short voice prompt", voice_id="page_gone")
    page.click("#refresh-voices")
    page.wait_for("!!document.querySelector('#voice option[value=\"page_gone\"]')", 20)
    page.select("#voice", "page_gone")
    request = urllib.request.Request(f"{stack.gateway_url}/v1/voices/page_gone", method="DELETE")
    with urllib.request.urlopen(request, timeout=30) as response:  # deleted behind the page's back
        assert json.loads(response.read())["deleted"] is True
    assert speak(page, "This voice is gone.") == "error"
    errors = shown_errors(page)
    assert list(errors) == ["voice"], errors  # under the voice picker, nowhere else
    assert "voice_id" in errors["voice"] and "page_gone" in errors["voice"]
    assert page.evaluate("document.querySelector('#voice').getAttribute('aria-invalid')") == "true"
    shot(page, tmp_path, "error")


def test_speak_errors_are_shown_beside_their_fields(page):
    page.fill("#text", "   ")
    page.click("#speak")
    assert shown_errors(page) == {"text": "Type some text first."}
    page.fill("#seed", str(2**64))  # one past the largest seed: the gateway refuses it, naming the field
    assert speak(page, "A seed too large.") == "error"
    errors = shown_errors(page)
    assert list(errors) == ["seed"] and "seed" in errors["seed"], errors
    page.fill("#seed", "")
    assert speak(page, "Hello.") == "done"
    assert shown_errors(page) == {}  # each new attempt clears the old messages


def test_a_bad_upload_is_shown_beside_the_upload_control(page, tmp_path):
    bad = tmp_path / "not_audio.wav"
    bad.write_bytes(b"this is not a recording" * 100)
    set_file(page, "#voice-file", bad)
    page.fill("#voice-text", "a short voice prompt")
    page.click("#register")
    page.wait_for(f"!!document.querySelector('{ADD_VOICE} .error:not([hidden])')", 60)
    errors = shown_errors(page)
    assert list(errors) == ["voice-file"], errors
    assert "audio" in errors["voice-file"]
    assert page.text("#register-status") == ""


def converted(page, timeout_s: float = 180.0) -> str:
    return page.wait_for("['done', 'error'].includes(document.querySelector('#vc-status').dataset.state) "
                         "&& document.querySelector('#vc-status').dataset.state", timeout_s)


def test_convert_a_recording_in_the_convert_tab(page, tmp_path):
    """The convert tab (POST /v1/vc, streamed): the source is spoken again in the chosen voice, with its
    timing (about the source's length), played through Web Audio with its waveform; errors beside the
    source and the target controls."""
    page.click("#tab-convert")
    assert page.evaluate("!document.querySelector('#panel-convert').hidden "
                         "&& document.querySelector('#panel-speak').hidden")
    page.click("#convert")  # no source yet
    assert shown_errors(page, "#panel-convert") == {"vc-file": "Choose a source recording or record one first."}
    page.click("#vc-record")  # a source from the (fake) microphone: previewed, and the error above is gone
    page.wait_for("document.querySelector('#vc-record').getAttribute('aria-pressed') === 'true'", 10)
    page.evaluate("new Promise(resolve => setTimeout(resolve, 1000))")  # ~1 s of the fake microphone
    page.click("#vc-record")
    page.wait_for("!document.querySelector('#vc-preview').hidden", 20)
    assert shown_errors(page, "#panel-convert") == {}
    set_file(page, "#vc-file", write_wav(tmp_path / "source.wav", speech_like(1.5, 16000, seed=51), 16000))
    page.select("#vc-voice", "default")
    page.fill("#vc-seed", "7")
    page.click("#convert")
    assert converted(page) == "done", shown_errors(page, "#panel-convert")
    seconds = float(page.text("#vc-audio-seconds"))
    assert seconds == pytest.approx(1.5, abs=0.25) and page.text("#vc-used-seed") == "7"
    assert float(page.text("#vc-first-audio")) > 0
    drawn = waveform(page, "#vc-waveform")
    assert not drawn["hidden"] and drawn["received"] == pytest.approx(seconds, abs=0.01)
    assert drawn["played"] == pytest.approx(drawn["received"], abs=1e-3) and drawn["playedPixels"] > 0
    assert not page.evaluate("document.querySelector('#vc-download').hidden")
    shot(page, tmp_path, "converted")

    # a target recording far too short to be a voice: the gateway refuses it, shown beside its control
    set_file(page, "#vc-target-file", write_wav(tmp_path / "short.wav", speech_like(0.1, 16000, seed=52), 16000))
    page.click("#convert")
    assert converted(page) == "error"
    errors = shown_errors(page, "#panel-convert")
    assert list(errors) == ["vc-target-file"] and "prompt_audio" in errors["vc-target-file"], errors
    shot(page, tmp_path, "convert_error")


def test_the_sentence_being_spoken_is_highlighted_from_the_speech_marks(page, tmp_path):
    text = "Hello from the page. It highlights each sentence as it plays."
    page.fill("#text", text)
    page.click("#speak")
    # the first sentence is highlighted while its audio plays, then the second (speech marks over the WebSocket)
    page.wait_for("document.querySelector('#spoken').dataset.current === '1'", 120)
    assert page.evaluate("document.querySelector('#spoken .speaking').textContent") == "It highlights each sentence as it plays."
    shot(page, tmp_path, "highlighted")
    page.wait_for("document.querySelector('#status').dataset.state === 'done'", 120)
    assert page.evaluate("document.querySelector('#spoken').dataset.history") == "0,1"
    assert page.evaluate("[...document.querySelectorAll('#spoken .sentence')].map(s => s.textContent)") == [
        "Hello from the page.", "It highlights each sentence as it plays."]
    assert page.evaluate("document.querySelector('#spoken').textContent") == text
    assert page.evaluate("document.querySelectorAll('#spoken .speaking').length") == 0  # done: none is spoken
