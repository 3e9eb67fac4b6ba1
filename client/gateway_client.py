"""The SDK's blocking client of the HTTP gateway, `GatewayTTS` (standard library + websockets; `AsyncGatewayTTS`
in gateway_aio.py): synthesize, stream (HTTP chunked or the WebSocket), convert, voices (docs/api/sdk.md). Audio
comes as float32 numpy arrays at 24 kHz; leaving a stream early closes the connection, and the gateway cancels
the synthesis. Errors raise `TTSError` with the gateway's error (`param` as field, code, status, Retry-After).
"""
from __future__ import annotations

import base64
import http.client
import json
import os
import time
import uuid
from collections.abc import Iterable
from urllib.parse import quote, urlsplit

import numpy as np

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.wire.checks import check_one_voice

from .common import PromptAudio, TTSError, source_recording, VoiceInfo, prompt_bytes, wav_bytes, with_marks
from .gateway_streams import HttpAudioStream, HttpEventStream, WsAudioStream, error_from_body

DEFAULT_URL = "http://localhost:8080"


def _prompt_file(audio: PromptAudio, sample_rate: int | None) -> bytes:
    """A prompt as the bytes of an audio file (samples become a float WAV)."""
    if isinstance(audio, np.ndarray):
        if not sample_rate:
            raise InvalidInput("prompt_sample_rate", "is required with prompt samples")
        return wav_bytes(audio, sample_rate, float32=True)
    return prompt_bytes(audio)


def tts_body(text: str | None, *, voice_id: str | None = None, prompt_audio: PromptAudio | None = None,
             prompt_sample_rate: int | None = None, prompt_text: str | None = None, mode: str | None = None,
             instruct: str | None = None, seed: int | None = None, text_frontend: bool | None = None,
             chunk_first_hop: int | None = None,
             chunk_hop_scale: float | None = None, chunk_max_hop: int | None = None,
             chunk_policy: str | None = None, speed: float | None = None, text_type: str | None = None,
             marks: bool | None = None, model: str | None = None) -> dict:
    """The JSON of a /v1/tts request (or, without `format`/`stream`, of a WebSocket start message).
    Options left None are not sent: the gateway's (or the server's) default applies. `text_type`: "text" or
    "ssml" (docs/api/ssml.md; default: ssml when the text starts with <speak). `marks`: speech marks
    (docs/api/speech-marks.md). `model`: the model family, "cosyvoice2" or "cosyvoice3" (default: the
    gateway's, docs/cosyvoice3.md#picking-the-family)."""
    body: dict = {} if text is None else {"text": text}
    check_one_voice(voice_id, prompt_audio, "voice_id", "prompt_audio", required=False)
    if voice_id is not None:
        body["voice_id"] = voice_id
    if prompt_audio is not None:
        body["prompt_audio"] = base64.b64encode(_prompt_file(prompt_audio, prompt_sample_rate)).decode("ascii")
    for name, value in (("prompt_text", prompt_text), ("mode", mode), ("instruct", instruct), ("seed", seed), ("text_frontend", text_frontend),
                        ("chunk_first_hop", chunk_first_hop), ("chunk_hop_scale", chunk_hop_scale),
                        ("chunk_max_hop", chunk_max_hop), ("chunk_policy", chunk_policy), ("speed", speed),
                        ("text_type", text_type), ("marks", marks), ("model", model)):
        if value is not None:
            body[name] = value
    return body


def marked_audio(data: bytes) -> np.ndarray:
    """A /v1/tts answer with marks (JSON: the pcm_f32 file in base64 and the complete marks) as marked audio."""
    answer = json.loads(data)
    return with_marks(np.frombuffer(base64.b64decode(answer["audio"]), "<f4"), answer["marks"])


def voice_from_json(data: dict) -> VoiceInfo:
    known = {"id", "name", "text", "audio_sha256", "prompt_tokens", "modes"}
    return VoiceInfo(voice_id=data["id"], audio_sha256=data.get("audio_sha256"),
                     prompt_tokens=data.get("prompt_tokens"), prompt_text=data.get("text"), name=data.get("name"),
                     modes=tuple(data["modes"]) if "modes" in data else None,
                     extra={k: v for k, v in data.items() if k not in known})


def _multipart(fields: dict[str, str], files: dict[str, tuple[str, bytes]]) -> tuple[bytes, str]:
    boundary = f"cosyvoice-{uuid.uuid4().hex}"
    parts = []
    for name, value in fields.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
                     + value.encode("utf-8") + b"\r\n")
    for name, (filename, data) in files.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                     f"Content-Type: application/octet-stream\r\n\r\n".encode() + data + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def _voice_form(audio: PromptAudio, prompt_text: str, voice_id: str | None, name: str | None,
                sample_rate: int | None) -> tuple[dict[str, str], bytes, str]:
    data = _prompt_file(audio, sample_rate)
    filename = os.path.basename(os.fspath(audio)) if isinstance(audio, (str, os.PathLike)) else "prompt.wav"
    fields = {"text": prompt_text}
    if voice_id is not None:
        fields["id"] = voice_id
    if name is not None:
        fields["name"] = name
    return fields, data, filename


def vc_form(source_audio: PromptAudio | None = None, *, audio: PromptAudio | None = None, voice_id: str | None = None,
            prompt_audio: PromptAudio | None = None, seed: int | None = None, sample_rate: int | None = None,
            prompt_sample_rate: int | None = None, format: str = "pcm_f32", stream: bool = False,
            speed: float | None = None,
            model: str | None = None) -> tuple[dict[str, str], dict[str, tuple[str, bytes]]]:
    """The multipart fields and files of a POST /v1/vc request: `source_audio` the recording to speak again (a file
    path, the file's bytes, or samples at `sample_rate`; `audio`: the same), the voice as `voice_id` or a target
    recording `prompt_audio`, the model family as `model` (None: the gateway's default)."""
    source = source_recording(source_audio, audio)
    check_one_voice(voice_id, prompt_audio, "voice_id", "prompt_audio", required=False)
    fields = {"format": format, "stream": "true" if stream else "false"}
    if voice_id is not None:
        fields["voice_id"] = voice_id
    if seed is not None:
        fields["seed"] = str(seed)
    if speed is not None:
        fields["speed"] = str(speed)
    if model is not None:
        fields["model"] = model
    files = {"source_audio": ("source.wav", _prompt_file(source, sample_rate))}
    if prompt_audio is not None:
        files["prompt_audio"] = ("prompt.wav", _prompt_file(prompt_audio, prompt_sample_rate))
    return fields, files


# ---- blocking client ---------------------------------------------------------------------------------

class GatewayTTS:
    """Blocking client of the gateway at `url` (default http://localhost:8080)."""

    def __init__(self, url: str = DEFAULT_URL, *, api_key: str | None = None, timeout_s: float = 600.0):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https"):
            raise InvalidInput("url", f"must be http:// or https://, got {url!r}")
        self.url = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
        self._parts = parts
        self._prefix = parts.path.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s

    # ---- plumbing ----------------------------------------------------------------------------------------
    def _connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._parts.scheme == "https" else http.client.HTTPConnection
        return cls(self._parts.hostname, self._parts.port, timeout=self.timeout_s)

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "*/*"}
        if content_type:
            headers["Content-Type"] = content_type
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _open(self, method: str, path: str, body: bytes | None = None,
              content_type: str | None = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        connection = self._connection()
        try:
            connection.request(method, self._prefix + path, body=body, headers=self._headers(content_type))
            response = connection.getresponse()
        except OSError as exc:
            connection.close()
            raise TTSError(f"cannot reach the gateway at {self.url}: {exc}", status="UNREACHABLE") from None
        if response.status >= 400:
            data = response.read()
            connection.close()
            raise error_from_body(data, response.status, response.getheader("Retry-After"))
        return connection, response

    def _request(self, method: str, path: str, body: bytes | None = None, content_type: str | None = None) -> bytes:
        connection, response = self._open(method, path, body, content_type)
        try:
            return response.read()
        finally:
            connection.close()

    def _json(self, method: str, path: str, payload: dict | None = None) -> dict:
        body = json.dumps(payload).encode() if payload is not None else None
        return json.loads(self._request(method, path, body, "application/json" if body is not None else None))

    # ---- synthesis ---------------------------------------------------------------------------------------
    def synthesize(self, text: str, **options) -> np.ndarray:
        """The whole waveform (float32, 24 kHz). Options: voice_id | prompt_audio (+ prompt_sample_rate for
        samples) + prompt_text, mode, instruct, seed, chunk_first_hop, chunk_hop_scale, chunk_max_hop, speed,
        text_type ("ssml": `text` is an SSML document, docs/api/ssml.md), marks (True: the complete speech marks
        in the result's `marks`, docs/api/speech-marks.md), model ("cosyvoice2" or "cosyvoice3": the family)."""
        body = {**tts_body(text, **options), "format": "pcm_f32"}
        data = self._request("POST", "/v1/tts", json.dumps(body).encode(), "application/json")
        return marked_audio(data) if options.get("marks") else np.frombuffer(data, "<f4").astype(np.float32)

    def synthesize_wav(self, text: str, **options) -> bytes:
        """The whole answer as a WAV file (16-bit, 24 kHz)."""
        return self.synthesize_file(text, "wav", **options)

    def synthesize_file(self, text: str, format: str = "wav", **options) -> bytes:
        """The whole answer as a file of `format` (wav, mp3, opus, aac, flac, pcm or pcm_f32), encoded by the
        gateway, with the exact lengths in its header."""
        body = {**tts_body(text, **options), "format": format}
        return self._request("POST", "/v1/tts", json.dumps(body).encode(), "application/json")

    def stream(self, text: str, **options) -> HttpAudioStream:
        """POST /v1/tts with stream=true: chunks as the gateway writes them (marks=True: server-sent events, each
        chunk's speech marks in `chunk.marks`, all of them in the stream's `marks`)."""
        body = {**tts_body(text, **options), "format": "pcm_f32", "stream": True}
        started = time.monotonic()
        connection, response = self._open("POST", "/v1/tts", json.dumps(body).encode(), "application/json")
        return (HttpEventStream if options.get("marks") else HttpAudioStream)(connection, response, started)

    def stream_ws(self, text: str | Iterable[str] | None = None, *, text_mode: str | None = None,
                  **options) -> WsAudioStream:
        """A WebSocket session. `text`: a string (sent with the start message, then "end"), an iterable of
        pieces (sent from a thread as they come, then "end"), or None (call send_text/flush/end).
        `text_mode="bistream"`: the text goes to one synthesis as it is written (audio before a sentence ends)."""
        from websockets.sync.client import connect

        start = {"type": "start", **tts_body(None, **options), "format": "pcm_f32"}
        if text_mode is not None:
            start["text_mode"] = text_mode
        if isinstance(text, str):
            start["text"] = text
        scheme = "wss" if self._parts.scheme == "https" else "ws"
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        try:
            # entered as a context manager (websockets >= 17.1 warns otherwise); WsAudioStream closes it
            ws = connect(f"{scheme}://{self._parts.netloc}{self._prefix}/v1/tts/ws",
                         additional_headers=headers, max_size=None, open_timeout=self.timeout_s).__enter__()
        except OSError as exc:
            raise TTSError(f"cannot reach the gateway at {self.url}: {exc}", status="UNREACHABLE") from None
        except Exception as exc:  # websockets.InvalidStatus: refused before the upgrade (401, 429)
            response = getattr(exc, "response", None)
            if response is None:
                raise
            try:
                body = json.loads(response.body)
            except (TypeError, ValueError):
                body = str(exc)
            raise TTSError.from_body(body, response.status_code, response.headers.get("Retry-After")) from None
        from websockets.exceptions import ConnectionClosed

        started = time.monotonic()
        try:
            ws.send(json.dumps(start))
            if isinstance(text, str):
                ws.send(json.dumps({"type": "end"}))
        except ConnectionClosed:
            pass  # refused at once (the start was enough): its error message waits to be read below
        try:
            stream = WsAudioStream(ws, started, None if isinstance(text, str) else text)
            stream.stats.speech_marks.wanted = bool(options.get("marks"))
            return stream
        except BaseException:
            ws.close()
            raise

    def convert(self, source_audio: PromptAudio | None = None, **options) -> np.ndarray:
        """Voice conversion (POST /v1/vc): the recording `source_audio` (`audio`: the same) spoken again in a voice,
        the whole waveform (float32, 24 kHz). Options: voice_id | prompt_audio (a target recording;
        + prompt_sample_rate for samples), seed, speed, sample_rate (of `source_audio` when it is samples)."""
        return np.frombuffer(self.convert_file(source_audio, "pcm_f32", **options), "<f4").astype(np.float32)

    def convert_file(self, source_audio: PromptAudio | None = None, format: str = "wav", **options) -> bytes:
        """Voice conversion as a file of `format`, encoded by the gateway."""
        body, content_type = _multipart(*vc_form(source_audio, format=format, **options))
        return self._request("POST", "/v1/vc", body, content_type)

    def convert_stream(self, source_audio: PromptAudio | None = None, **options) -> HttpAudioStream:
        """Voice conversion streamed (POST /v1/vc with stream true): chunks as the gateway writes them."""
        body, content_type = _multipart(*vc_form(source_audio, stream=True, **options))
        started = time.monotonic()
        connection, response = self._open("POST", "/v1/vc", body, content_type)
        return HttpAudioStream(connection, response, started)

    def speech(self, input: str, *, voice: str = "default", model: str = "tts-1",
               response_format: str = "wav", instructions: str | None = None, seed: int | None = None) -> bytes:
        """POST /v1/audio/speech (the OpenAI API): the file's bytes in `response_format` (mp3, opus, aac,
        flac, wav) or 16-bit PCM (pcm). `model`: "cosyvoice2" or "cosyvoice3", or OpenAI's names (the gateway's
        default family)."""
        body = {"model": model, "input": input, "voice": voice, "response_format": response_format}
        if instructions is not None:
            body["instructions"] = instructions
        if seed is not None:
            body["seed"] = seed
        return self._request("POST", "/v1/audio/speech", json.dumps(body).encode(), "application/json")

    # ---- voices ------------------------------------------------------------------------------------------
    def add_voice(self, audio: PromptAudio, prompt_text: str = "", *, voice_id: str | None = None,
                  name: str | None = None, sample_rate: int | None = None) -> VoiceInfo:
        """Register a voice (multipart upload). `extra["created"]` is False when it was there already."""
        fields, data, filename = _voice_form(audio, prompt_text, voice_id, name, sample_rate)
        body, content_type = _multipart(fields, {"audio": (filename, data)})
        return voice_from_json(json.loads(self._request("POST", "/v1/voices", body, content_type)))

    def list_voices(self) -> list[VoiceInfo]:
        return [voice_from_json(v) for v in self._json("GET", "/v1/voices")["voices"]]

    def get_voice(self, voice_id: str) -> VoiceInfo:
        return voice_from_json(self._json("GET", f"/v1/voices/{quote(voice_id, safe='')}"))

    def delete_voice(self, voice_id: str) -> None:
        self._json("DELETE", f"/v1/voices/{quote(voice_id, safe='')}")

    # ---- health ------------------------------------------------------------------------------------------
    def healthy(self) -> bool:
        try:
            return self._json("GET", "/healthz").get("status") == "ok"
        except TTSError:
            return False

    def ready(self) -> dict:
        """The /readyz answer ({"ready": ..., "servers": ..., "default_voice": ...}), ready or not."""
        try:
            return self._json("GET", "/readyz")
        except TTSError as exc:
            return {"ready": False, "error": exc.message}

    def close(self) -> None:
        """Nothing is kept open between calls; here for symmetry with the other clients."""

    def __enter__(self) -> GatewayTTS:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
