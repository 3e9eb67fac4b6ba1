"""The client SDK and CLI against the real service: a tritonserver on a tiny random model (started through
the launcher, free ports) and the gateway in front of it (tests/web/stack.py).

Direct Triton: streaming gives several chunks, the same seed gives the same chunks (the offline twin does
not: a streamed request's flow and vocoder run chunk by chunk, so its audio differs from the offline
one's), the blocking and asyncio clients agree, closing a stream cancels it on the server (its LLM
stream and vocoder state are freed), and errors name the field. Gateway: every API gives the audio that
Triton gives for the same voice and seed (and chunk-policy options); voices can be added, listed, shown
and deleted; errors carry the gateway's field and status. The CLI writes wav files through either.
"""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from cosyvoice_triton.client import (AsyncGatewayTTS, AsyncTritonTTS, GatewayTTS, TritonTTS, TTSError, read_wav,
                                     write_wav)
from cosyvoice_triton.client.cli import main as cli_main
from cosyvoice_triton.random_folder.sample_prompt import speech_like
from triton_harness import metric_value, scrape, wait_for_metric
from web.stack import gateway, triton_server

RATE = 16000
PROMPT_TEXT = "a short voice prompt"
TEXT = ("The client asks for a sentence that is long enough to come back in more than one piece of audio. "
        "Then a second sentence follows it.")
# Many sentences: the random LLM may draw a stop token early in any one, and the stream still runs on.
ENDLESS = " ".join(["This sentence keeps the stream going on and on."] * 25)
LLM_SLOTS = 8  # the llm model's KV-cache slots (ServeOptions.llm_max_batch)
ATOL = 2e-4  # equal up to float rounding
PCM16 = 1.0 / 32767 + 1e-6
VOICE = object()  # the module's registered voice, in parametrized cases


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("client_sdk")
    with triton_server(root, tiny_model_dir) as (server, model_dir, voice_store):
        yield server, root, model_dir, voice_store


@pytest.fixture(scope="module")
def triton(stack):
    return stack[0]


@pytest.fixture(scope="module")
def gateway_url(stack):
    pytest.importorskip("cosyvoice_triton.gateway.app", reason="the gateway (cosyvoice_triton.gateway.app) is missing")
    server, root, model_dir, voice_store = stack
    with gateway(server, root / "gateway", model_dir, voice_store) as url:
        yield url


@pytest.fixture(scope="module")
def voice(triton) -> str:
    with TritonTTS(triton.grpc_url) as tts:
        return tts.register_voice(speech_like(2.0, RATE, seed=3), sample_rate=RATE, prompt_text=PROMPT_TEXT).voice_id


def assert_same(got: np.ndarray, want: np.ndarray, atol: float = ATOL) -> None:
    assert got.dtype == np.float32 and got.size == want.size and got.size > 0
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)


def metric(server, name: str, **labels) -> float:
    return metric_value(scrape(server.metrics_url), name, **labels) or 0.0


class Cancellations:
    """The server's cancelled synthesis requests around a block, and nothing left held after it.

    Counted at cosyvoice2 (the request ended as cancelled), not at the LLM: the random LLM may have
    finished the sentence it was on before the cancel came, and then has nothing to cancel."""

    def __init__(self, server):
        self.server = server
        self.before = metric(server, "cosyvoice_requests_total", model="cosyvoice2", outcome="cancelled")

    def wait(self, count: int) -> None:
        url = self.server.metrics_url
        wait_for_metric(url, "cosyvoice_requests_total", lambda v: v is not None and v >= self.before + count,
                        model="cosyvoice2", outcome="cancelled")
        for name, model in (("cosyvoice_active_streams", "cosyvoice2"), ("cosyvoice_llm_active_streams", "llm"),
                            ("cosyvoice_token2wav_active_streams", "token2wav")):
            wait_for_metric(url, name, lambda v: v == 0, model=model)
        assert metric(self.server, "cosyvoice_llm_free_slots", model="llm") == LLM_SLOTS


# ---- Triton, directly -------------------------------------------------------------------------------

def test_triton_stream_gives_chunks_and_the_same_seed_gives_the_same_audio(triton, voice):
    with TritonTTS(triton.grpc_url) as tts:
        with tts.stream(TEXT, voice_id=voice, seed=21) as stream:
            first = list(stream)
        assert stream.stats.chunks == len(first) >= 3
        assert stream.stats.samples == sum(c.size for c in first)
        assert stream.stats.first_chunk_s is not None and stream.stats.first_chunk_s <= stream.stats.total_s
        assert all(c.dtype == np.float32 and c.ndim == 1 and c.size for c in first)

        again = list(tts.stream(TEXT, voice_id=voice, seed=21))
        assert [c.size for c in again] == [c.size for c in first]
        assert_same(np.concatenate(again), np.concatenate(first))
        assert_same(tts.synthesize(TEXT, voice_id=voice, seed=21), np.concatenate(first))

        other = tts.synthesize(TEXT, voice_id=voice, seed=22)
        assert other.size != np.concatenate(first).size or not np.allclose(other, np.concatenate(first))

        # The offline twin speaks the same text with the same voice (its own, whole-utterance audio).
        offline = tts.synthesize(TEXT, voice_id=voice, seed=21, offline=True)
        assert offline.dtype == np.float32 and offline.size == np.concatenate(first).size


def test_async_triton_client_gives_the_same_audio(triton, voice):
    with TritonTTS(triton.grpc_url) as tts:
        want = list(tts.stream(TEXT, voice_id=voice, seed=5))

    async def run():
        async with AsyncTritonTTS(triton.grpc_url) as tts:
            assert await tts.ready()
            async with tts.stream(TEXT, voice_id=voice, seed=5) as stream:
                chunks = [chunk async for chunk in stream]
            whole = await tts.synthesize(TEXT, voice_id=voice, seed=5)
            return chunks, whole

    chunks, whole = asyncio.run(run())
    assert [c.size for c in chunks] == [c.size for c in want]
    assert_same(np.concatenate(chunks), np.concatenate(want))
    assert_same(whole, np.concatenate(want))


def test_closing_a_stream_cancels_it_on_the_server(triton, voice):
    cancellations = Cancellations(triton)
    with TritonTTS(triton.grpc_url) as tts:
        stream = tts.stream(ENDLESS, voice_id=voice, seed=1, chunk_first_hop=4)
        with stream:
            assert next(stream).size > 0
        assert stream.cancelled

    async def run():
        async with AsyncTritonTTS(triton.grpc_url) as tts:
            stream = tts.stream(ENDLESS, voice_id=voice, seed=2, chunk_first_hop=4)
            async for chunk in stream:
                assert chunk.size > 0
                break
            await stream.aclose()

    asyncio.run(run())
    cancellations.wait(2)
    with TritonTTS(triton.grpc_url) as tts:  # and the server carries on
        assert tts.synthesize("Still serving.", voice_id=voice, seed=3).size > 0


def test_register_voice_is_idempotent_across_samples_and_files(triton, tmp_path):
    samples = speech_like(1.5, RATE, seed=11)
    path = write_wav(tmp_path / "prompt.wav", samples, RATE, float32=True)
    with TritonTTS(triton.grpc_url) as tts:
        by_samples = tts.register_voice(samples, sample_rate=RATE, prompt_text=PROMPT_TEXT)
        by_path = tts.register_voice(path, prompt_text=PROMPT_TEXT)
        by_bytes = tts.register_voice(path.read_bytes(), prompt_text=PROMPT_TEXT)
        named = tts.register_voice(speech_like(1.5, RATE, seed=12), sample_rate=RATE, prompt_text=PROMPT_TEXT,
                                   voice_id="sdk_voice")
    assert by_samples.voice_id == by_path.voice_id == by_bytes.voice_id
    assert by_samples.prompt_tokens in (37, 38) and by_samples.audio_sha256 == by_path.audio_sha256
    assert named.voice_id == "sdk_voice"


@pytest.mark.parametrize("case, kwargs, field", [
    ("empty text", dict(text="   ", voice_id=VOICE), "target_text"),
    ("unknown voice", dict(text="Hello.", voice_id="no_such_voice"), "reference_audio_id"),
    ("silent prompt", dict(text="Hello.", prompt_audio=np.zeros(RATE, np.float32), prompt_sample_rate=RATE,
                           prompt_text="silence"), "reference_wav"),
    ("instruct2 without instruction", dict(text="Hello.", voice_id=VOICE, mode="instruct2"), "instruct_text"),
])
def test_triton_errors_name_the_field(triton, voice, case, kwargs, field):
    kwargs = {k: (voice if v is VOICE else v) for k, v in kwargs.items()}
    with TritonTTS(triton.grpc_url) as tts:
        with pytest.raises(TTSError) as caught:
            list(tts.stream(**kwargs))
    assert caught.value.field == field, f"{case}: {caught.value}"
    assert field in str(caught.value)


def test_triton_errors_for_registration_and_an_unreachable_server(triton):
    with TritonTTS(triton.grpc_url) as tts:
        with pytest.raises(TTSError) as caught:
            tts.register_voice(np.zeros(RATE, np.float32), sample_rate=RATE)
    assert caught.value.field == "reference_wav" and caught.value.status == "INVALID_ARGUMENT"
    assert "silent" in caught.value.message

    from cosyvoice_triton.server.process import free_port

    with TritonTTS(f"127.0.0.1:{free_port()}", timeout_s=10) as tts:
        assert not tts.ready()
        with pytest.raises(TTSError) as caught:
            tts.synthesize("Hello.", voice_id="default")
    assert caught.value.status == "UNAVAILABLE"


def test_cli_writes_a_wav_through_triton(triton, voice, tmp_path, capsys):
    url = f"grpc://{triton.grpc_url}"
    out = tmp_path / "direct.wav"
    assert cli_main(["synth", "--triton", url, "--voice", voice, "--text", TEXT, "--seed", "21", "--stream",
                     "--out", str(out)]) == 0
    samples, rate = read_wav(out)
    assert rate == 24000
    with TritonTTS(triton.grpc_url) as tts:
        assert_same(samples, tts.synthesize(TEXT, voice_id=voice, seed=21), atol=PCM16)
    assert "first chunk after" in capsys.readouterr().err

    prompt = write_wav(tmp_path / "prompt.wav", speech_like(1.2, RATE, seed=4), RATE)
    assert cli_main(["voices", "add", str(prompt), "--prompt-text", PROMPT_TEXT, "--id", "cli_voice",
                     "--triton", url]) == 0
    assert capsys.readouterr().out.strip() == "cli_voice"
    assert cli_main(["synth", "--triton", url, "--voice", "missing_voice", "--text", "Hi.",
                     "--out", str(tmp_path / "x.wav")]) == 1
    assert "reference_audio_id" in capsys.readouterr().err and not (tmp_path / "x.wav").exists()


# ---- the gateway -----------------------------------------------------------------------------------------

def test_gateway_apis_give_the_audio_that_triton_gives(triton, gateway_url, voice):
    with TritonTTS(triton.grpc_url) as direct:
        want = direct.synthesize(TEXT, voice_id=voice, seed=8)
        whole_want = direct.synthesize(TEXT, voice_id=voice, seed=8, offline=True)  # what non-streamed calls get
    with GatewayTTS(gateway_url) as tts:
        assert tts.healthy() and tts.ready()["ready"]
        assert_same(tts.synthesize(TEXT, voice_id=voice, seed=8), whole_want)
        with tts.stream(TEXT, voice_id=voice, seed=8) as stream:
            streamed = list(stream)
        assert stream.stats.seed == 8 and stream.stats.first_chunk_s is not None
        assert_same(np.concatenate(streamed), want)
        samples, rate = read_wav(tts.synthesize_wav(TEXT, voice_id=voice, seed=8))
        assert rate == 24000
        assert_same(samples, whole_want, atol=PCM16)
        speech, rate = read_wav(tts.speech(TEXT, voice=voice, seed=8))
        assert rate == 24000
        assert_same(speech, want, atol=PCM16)

    async def run():
        async with AsyncGatewayTTS(gateway_url) as tts:
            whole = await tts.synthesize(TEXT, voice_id=voice, seed=8)
            async with await tts.stream(TEXT, voice_id=voice, seed=8) as stream:
                chunks = [chunk async for chunk in stream]
            return whole, np.concatenate(chunks)

    whole, streamed = asyncio.run(run())
    assert_same(whole, whole_want)
    assert_same(streamed, want)


def test_gateway_websocket_streams_text_in_and_audio_out(gateway_url, voice):
    pieces = ["The words of this text ", "arrive in pieces, as from a chat model. ", "A second sentence ",
              "ends it."]
    with GatewayTTS(gateway_url) as tts:
        with tts.stream_ws(iter(pieces), voice_id=voice, seed=30) as stream:
            chunks = list(stream)
    end = stream.stats.end
    assert end is not None and end["segments"] == len(stream.stats.segments) == 2
    audio = np.concatenate(chunks)
    assert end["audio_seconds"] == pytest.approx(audio.size / 24000)
    assert end["first_chunk_ms"] > 0 and stream.stats.seed == 30
    assert [s["text"] for s in stream.stats.segments] == ["The words of this text arrive in pieces, as from a chat "
                                                          "model. ", "A second sentence ends it."]

    async def run():
        async def text():
            for piece in pieces:
                yield piece

        async with AsyncGatewayTTS(gateway_url) as tts:
            async with await tts.stream_ws(text(), voice_id=voice, seed=30) as stream:
                return np.concatenate([chunk async for chunk in stream]), stream.stats.end

    got, async_end = asyncio.run(run())
    assert_same(got, audio)
    assert async_end["segments"] == 2


def test_gateway_streams_cancel_when_the_client_closes_them(triton, gateway_url, voice):
    cancellations = Cancellations(triton)
    with GatewayTTS(gateway_url) as tts:
        with tts.stream(ENDLESS, voice_id=voice, seed=1) as stream:
            assert next(stream).size > 0
        with tts.stream_ws(ENDLESS, voice_id=voice, seed=2) as stream:
            assert next(stream).size > 0
    cancellations.wait(2)


def test_gateway_voices_add_list_show_delete(gateway_url, tmp_path):
    prompt = write_wav(tmp_path / "mine.wav", speech_like(1.5, RATE, seed=21), RATE)
    with GatewayTTS(gateway_url) as tts:
        added = tts.add_voice(prompt, PROMPT_TEXT, voice_id="gw_voice", name="Mine")
        assert (added.voice_id, added.name, added.prompt_text) == ("gw_voice", "Mine", PROMPT_TEXT)
        assert added.extra["created"] is True and added.prompt_seconds == pytest.approx(1.48)
        assert tts.add_voice(prompt, PROMPT_TEXT, voice_id="gw_voice", name="Mine").extra["created"] is False
        assert {"default", "gw_voice"} <= {v.voice_id for v in tts.list_voices()}
        assert tts.get_voice("gw_voice").audio_sha256 == added.audio_sha256
        assert tts.synthesize("Hello.", voice_id="gw_voice", seed=1).size > 0
        tts.delete_voice("gw_voice")
        with pytest.raises(TTSError) as caught:
            tts.get_voice("gw_voice")
        assert (caught.value.status, caught.value.field, caught.value.code) == (404, "id", "not_found")
        assert "gw_voice" not in {v.voice_id for v in tts.list_voices()}

    async def run():
        async with AsyncGatewayTTS(gateway_url) as tts:
            info = await tts.add_voice(speech_like(1.5, RATE, seed=22), PROMPT_TEXT, sample_rate=RATE)
            listed = {v.voice_id for v in await tts.list_voices()}
            shown = await tts.get_voice(info.voice_id)
            await tts.delete_voice(info.voice_id)
            return info, listed, shown, {v.voice_id for v in await tts.list_voices()}

    info, listed, shown, after = asyncio.run(run())
    assert info.voice_id in listed and shown.voice_id == info.voice_id and info.voice_id not in after


def test_gateway_errors_carry_field_and_status(gateway_url):
    with GatewayTTS(gateway_url) as tts:
        cases = [(lambda: tts.synthesize("  "), 400, "text"),
                 (lambda: tts.synthesize("Hello.", voice_id="no_such_voice"), 404, "voice_id"),
                 (lambda: tts.synthesize("Hello.", mode="sing"), 400, "mode"),
                 (lambda: list(tts.stream_ws("Hello.", voice_id="no_such_voice")), 404, "voice_id"),
                 (lambda: tts.add_voice(np.zeros(RATE, np.float32), "silence", sample_rate=RATE), 400, "audio")]
        for call, status, field in cases:
            with pytest.raises(TTSError) as caught:
                call()
            assert (caught.value.status, caught.value.field) == (status, field), str(caught.value)
            assert caught.value.message.startswith(f"{field}:")


def test_gateway_takes_the_chunk_policy_options(triton, gateway_url, voice, tmp_path, capsys):
    """The options reach the model: the gateway gives Triton's chunks for the same options (more than the
    default's), and bad values come back as errors naming the field, from the SDKs and the CLI."""
    text = TEXT.split(". ")[0] + "."  # one sentence: one WebSocket segment
    policy = {"chunk_first_hop": 4, "chunk_hop_scale": 1.5, "chunk_max_hop": 30}
    with TritonTTS(triton.grpc_url) as direct:
        want = list(direct.stream(text, voice_id=voice, seed=8, **policy))
        default = list(direct.stream(text, voice_id=voice, seed=8))
    with GatewayTTS(gateway_url) as tts:
        # Streamed over HTTP (a non-streamed request is one offline pass: no chunks, so no chunk policy).
        with tts.stream(text, voice_id=voice, seed=8, **policy) as stream:
            assert_same(np.concatenate(list(stream)), np.concatenate(want))
        with tts.stream_ws(text, voice_id=voice, seed=8, **policy) as stream:
            chunks = list(stream)  # one WebSocket frame per Triton chunk
        assert len(chunks) == len(want) > len(default)
        assert_same(np.concatenate(chunks), np.concatenate(want))
        with pytest.raises(TTSError) as caught:
            tts.synthesize(text, voice_id=voice, chunk_first_hop=10, chunk_max_hop=5)
        assert (caught.value.status, caught.value.field) == (400, "chunk_max_hop")

    async def refused():
        async with AsyncGatewayTTS(gateway_url) as tts:
            with pytest.raises(TTSError) as caught:
                await tts.stream(text, voice_id=voice, chunk_hop_scale=0.5)
            return caught.value

    error = asyncio.run(refused())
    assert (error.status, error.field) == (400, "chunk_hop_scale")
    assert cli_main(["synth", "--url", gateway_url, "--voice", voice, "--text", text, "--chunk-first-hop", "0",
                     "--out", str(tmp_path / "x.wav")]) == 1
    assert "chunk_first_hop" in capsys.readouterr().err and not (tmp_path / "x.wav").exists()


def test_cli_through_the_gateway(triton, gateway_url, voice, tmp_path, capsys):
    # A whole file is the offline pass (cosyvoice2_offline); --stream joins the streamed chunks.
    with TritonTTS(triton.grpc_url) as direct:
        want = {(): direct.synthesize(TEXT, voice_id=voice, seed=9, offline=True),
                ("--stream",): direct.synthesize(TEXT, voice_id=voice, seed=9)}
    for extra in ([], ["--stream"]):
        out = tmp_path / f"gateway{len(extra)}.wav"
        assert cli_main(["synth", "--url", gateway_url, "--voice", voice, "--text", TEXT, "--seed", "9",
                         "--out", str(out), *extra]) == 0
        samples, rate = read_wav(out)
        assert rate == 24000
        assert_same(samples, want[tuple(extra)], atol=PCM16)
    out = tmp_path / "ws.wav"
    assert cli_main(["synth", "--url", gateway_url, "--text", "Hello there.", "--ws", "--float",
                     "--out", str(out)]) == 0
    samples, _ = read_wav(out)
    assert samples.size > 0
    capsys.readouterr()

    prompt = write_wav(tmp_path / "prompt.wav", speech_like(1.2, RATE, seed=5), RATE)
    assert cli_main(["voices", "add", str(prompt), "--prompt-text", PROMPT_TEXT, "--id", "cli_gw",
                     "--url", gateway_url]) == 0
    assert cli_main(["voices", "list", "--url", gateway_url]) == 0
    listed = capsys.readouterr().out
    assert "cli_gw" in listed and "default" in listed
    assert cli_main(["voices", "delete", "cli_gw", "--url", gateway_url]) == 0
    assert cli_main(["voices", "show", "cli_gw", "--url", gateway_url]) == 1
    assert "no voice 'cli_gw'" in capsys.readouterr().err


def test_cli_stream_prints_the_chunks_the_service_sends(triton, gateway_url, voice, tmp_path, capsys):
    """`synth --stream` prints one line per audio chunk as the service sent it, not per network read (and the
    SDK's streams yield those chunks): over HTTP the chunks Triton made (the gateway writes each as one HTTP chunk; 50-token chunks are 2 s, 192 kB
    of float32, past one 64 kB read), over the WebSocket its frames (a request per sentence)."""
    import re

    hops = {"chunk_first_hop": 50, "chunk_max_hop": 50}
    with TritonTTS(triton.grpc_url) as direct:
        http_chunks = [chunk.size / 24000 for chunk in direct.stream(TEXT, voice_id=voice, seed=17, **hops)]
    with GatewayTTS(gateway_url) as tts, tts.stream_ws(TEXT, voice_id=voice, seed=17, **hops) as frames:
        ws_chunks = [chunk.size / 24000 for chunk in frames]
    assert max(http_chunks) * 24000 * 4 > 64 * 1024

    async def async_http_chunks():  # the asyncio SDK's HTTP stream: the same chunks
        async with AsyncGatewayTTS(gateway_url) as tts:
            async with await tts.stream(TEXT, voice_id=voice, seed=17, **hops) as stream:
                return [chunk.size / 24000 async for chunk in stream]

    assert asyncio.run(async_http_chunks()) == http_chunks
    for route, want in (([], http_chunks), (["--ws"], ws_chunks)):
        assert cli_main(["synth", "--url", gateway_url, "--voice", voice, "--text", TEXT, "--seed", "17",
                         "--chunk-first-hop", "50", "--chunk-max-hop", "50", "--stream", *route,
                         "--out", str(tmp_path / "chunks.wav")]) == 0
        lines = re.findall(r"^chunk (\d+): at (\d+) ms, ([\d.]+) s of audio \(total ([\d.]+) s\)$",
                           capsys.readouterr().err, re.MULTILINE)
        assert [int(index) for index, *_ in lines] == list(range(len(want))), route
        assert [float(seconds) for _, _, seconds, _ in lines] == pytest.approx(want, abs=1e-3), route
        arrivals = [int(ms) for _, ms, _, _ in lines]
        assert arrivals == sorted(arrivals)


@pytest.fixture
def refusing_ws_server():
    """A WebSocket endpoint that answers a session with an error message and closes at once, before the
    client has sent all it meant to (the gateway does so for an unknown voice as soon as it reads the start)."""
    from aiohttp import web

    async def session(request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_json({"type": "error", "status": 404, "code": "not_found", "param": "voice_id",
                            "message": "voice_id: no voice 'gone'"})
        await ws.close(code=1008)
        return ws

    app = web.Application()
    app.router.add_get("/v1/tts/ws", session)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_a_websocket_refused_at_once_raises_the_gateways_error(refusing_ws_server):
    """However early the gateway closes, both SDKs raise its error (status and field), never a closed-socket
    error from sending the rest of the start."""
    for _ in range(10):
        with GatewayTTS(refusing_ws_server) as tts, pytest.raises(TTSError) as caught:
            list(tts.stream_ws("Hello.", voice_id="gone"))
        assert (caught.value.status, caught.value.field) == (404, "voice_id")

    async def refused():
        async with AsyncGatewayTTS(refusing_ws_server) as tts:
            with pytest.raises(TTSError) as caught:
                await tts.stream_ws("Hello.", voice_id="gone")
            return caught.value

    for _ in range(10):
        error = asyncio.run(refused())
        assert (error.status, error.field) == (404, "voice_id")
