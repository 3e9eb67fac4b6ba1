"""POST /v1/tts: text -> 24 kHz audio, whole or streamed.

Body (JSON):
  text          required, at most --max-text-chars characters
  voice_id      a registered voice (default: "default"); or
  prompt_audio  base64 of a WAV/FLAC/OGG file, with prompt_text (its transcript; zero_shot needs it)
  mode          zero_shot (default) | cross_lingual | instruct2
  instruct      the instruction (instruct2)
  text_frontend false: the text as given: no normalization, no sentence splitting (official text_frontend=False; default true)
  speed         0.25 .. 4.0 (default 1.0): the mel interpolated along time by 1 / speed before the vocoder, as the
                official CosyVoice2, streamed or not (token2wav/speed.py); outside the range: 400 naming `speed`
  seed          0 .. 2^64-1: the same seed and inputs give the same audio (default: random, echoed in X-Seed)
  chunk_first_hop, chunk_hop_scale, chunk_max_hop
                the streaming chunk policy (pipeline/chunk_policy.py; default: the server's): speech tokens in
                the first chunk (int >= 4; smaller: earlier first audio), the growth of each later chunk
                (number in [1, 16]) and its cap (int >= the first hop). The chunking changes where the flow
                model's chunks fall, so the audio may differ slightly from the default's
  chunk_policy  fixed (the official schedule) | adaptive (hops follow the listener's lead; default: the server's)
  marks         true: speech marks (docs/api/speech-marks.md): not streamed, a JSON answer {"audio": base64 of
                the file, "format", "sample_rate", "seed", "marks": [...]}; streamed, server-sent events as the
                OpenAI route's (speech.audio.delta, speech.mark before the audio it describes, speech.mark_end,
                speech.audio.done with the complete marks). Default false: the answer as below, unchanged
  format        wav (default, 16-bit) | mp3 | opus | aac | flac | pcm (16-bit little-endian) | pcm_f32 (the
                model's float32 samples); pcm_s16le is an older name of pcm. cosyvoice_triton/audio_out.py
                lists codecs, rates and media types (opus is 48 kHz; X-Sample-Rate says the rate)
  stream        false (default): the whole file with Content-Length and exact lengths in its header, made by
                the offline model (cosyvoice2_offline: each sentence in one full-attention flow pass, as the
                official non-streamed inference; the chunk_* fields then change nothing);
                true: chunked transfer, each audio chunk encoded as Triton makes it and written as soon as
                the encoder gives bytes (a streamed wav's header says "unknown length", as FFmpeg writes
                it on a pipe)

Errors before the first audio byte are JSON with a status (400 naming the field, 404 unknown voice,
429, 503 no server or "overloaded" with Retry-After (admission: gateway/admission.py), 504 timeout); a
failure after it cuts the connection (an incomplete chunked body, never a clean end).

The body is parsed once into a `TtsRequest` (route_requests.py) and answered by audio_response.py.
"""
from __future__ import annotations

from aiohttp import web

from .audio_response import AUDIO_BYTES, AudioEvents, send_audio
from .auth import limit_key
from .fields import TTS_FIELDS
from .route_requests import json_body, parse_tts
from .state import CONFIG, COSTS, LIMITER
from .synthesis import prepare, routing_cost


async def tts(request: web.Request) -> web.StreamResponse:
    app = request.app
    tts = parse_tts(await json_body(request), app[CONFIG].limits)
    inputs, prompt_tokens = await prepare(app, tts.inputs, TTS_FIELDS, ssml_voices=tts.ssml_voices)
    marked = tts.stream and inputs.marks  # speech marks streamed: server-sent events among the audio
    body = AudioEvents(app[COSTS].text_tokens(inputs.text), marks=True) if marked else AUDIO_BYTES
    with app[LIMITER].slot(limit_key(request)):
        return await send_audio(request, inputs, routing_cost(app, inputs, prompt_tokens), TTS_FIELDS, tts.format,
                                tts.stream, route="tts", body=body)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/tts", tts)
