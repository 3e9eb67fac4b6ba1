"""POST /v1/audio/speech: the OpenAI text-to-speech API, so OpenAI SDKs and tools work unchanged.

  model            required string; any value is accepted (tts-1, gpt-4o-mini-tts, cosyvoice2 ...)
  input            the text
  voice            a registered voice id (or {"id": ...}); OpenAI's stock names (alloy, echo, ...) that
                   are not registered here speak with the "default" voice
  response_format  mp3 (the default, as OpenAI's) | opus (Ogg, 48 kHz) | aac (ADTS) | flac | wav | pcm
                   (16-bit little-endian, 24 kHz, no header); encoded by cosyvoice_triton/audio_out.py
  speed            0.25 .. 4.0 as OpenAI's (default 1.0): the mel is interpolated along time by 1 / speed
                   before the vocoder, as the official CosyVoice2 does, streamed or not (token2wav/speed.py);
                   outside the range: 400 naming `speed`
  instructions     switches to instruct2 mode with this instruction
  stream_format    audio (default): the audio bytes, streamed as they are encoded | sse: server-sent events
                   speech.audio.delta {audio: base64 of the next bytes of the file} ... then speech.audio.done
  seed             (extension) as in /v1/tts
  marks            (extension) true, with stream_format sse: speech marks (docs/api/speech-marks.md) as events
                   speech.mark (before the audio it describes) and speech.mark_end among the deltas, and the
                   complete marks in speech.audio.done
  stream           (extension) true (default): chunked transfer, so `with_streaming_response` reads audio as
                   it is made (a wav then says "unknown length" in its header, as FFmpeg writes it on a
                   pipe; soundfile, FFmpeg and browsers read it to its end); false: the whole file, whose
                   header carries the exact lengths
"""
from __future__ import annotations

from aiohttp import web

from cosyvoice_triton import __version__

from .audio_response import AUDIO_BYTES, AudioEvents, send_audio
from .auth import limit_key
from .fields import OPENAI_FIELDS
from .route_requests import json_body, parse_speech
from .state import CONFIG, COSTS, LIMITER
from .synthesis import prepare, routing_cost


async def speech(request: web.Request) -> web.StreamResponse:
    app = request.app
    speech = parse_speech(await json_body(request), app[CONFIG].limits)
    inputs, prompt_tokens = await prepare(app, speech.inputs, OPENAI_FIELDS, speech.stock_voice, speech.ssml_voices)
    body = AudioEvents(app[COSTS].text_tokens(inputs.text), inputs.marks) if speech.events else AUDIO_BYTES
    with app[LIMITER].slot(limit_key(request)):
        return await send_audio(request, inputs, routing_cost(app, inputs, prompt_tokens), OPENAI_FIELDS,
                                speech.format, speech.stream or speech.events, route="openai", body=body)


async def models(request: web.Request) -> web.Response:
    """GET /v1/models: OpenAI's model list. `model` may name anything; listed is the model the gateway
    synthesizes with, and the version of this service (`version`, also on /readyz)."""
    model = {"id": request.app[CONFIG].synthesis_model, "object": "model", "created": 0,
             "owned_by": "cosyvoice-triton", "version": __version__}
    return web.json_response({"object": "list", "data": [model], "version": __version__})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/audio/speech", speech)
    app.router.add_get("/v1/models", models)
