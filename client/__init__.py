"""Client SDK of the CosyVoice2 service (`cosyvoice_triton.client`).

* `TritonTTS` / `AsyncTritonTTS`: gRPC straight to the Triton models (`cosyvoice2` streaming,
  `cosyvoice2_offline`, `register_voice`); needs `tritonclient[grpc]`.
* `GatewayTTS` / `AsyncGatewayTTS`: the HTTP gateway (/v1/tts, WebSocket /v1/tts/ws, /v1/audio/speech,
  /v1/voices); the blocking one needs only the standard library and `websockets`, the asyncio one `aiohttp`.

Audio is float32 numpy at 24 kHz. Streams are iterators (`for` / `async for`) whose `close()` /
`aclose()` cancels the request on the server. Server errors raise `TTSError` (`.field`, `.message`,
`.status`, `.code`, and `.retry_after_s` for a refusal under overload or a limit). Names are imported on first use, so `import cosyvoice_triton.client` stays light.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .common import SAMPLE_RATE, TTSError, VoiceInfo, read_wav, write_wav

if TYPE_CHECKING:
    from .gateway_aio import AsyncGatewayTTS
    from .gateway_client import GatewayTTS
    from .triton_client import (AsyncAudioStream, AsyncTextAudioStream, AsyncTritonTTS, AudioStream,
                                TextAudioStream, TritonTTS)

_LAZY = {"TritonTTS": "triton_client", "AsyncTritonTTS": "triton_client", "AudioStream": "triton_client",
         "AsyncAudioStream": "triton_client", "TextAudioStream": "triton_client",
         "AsyncTextAudioStream": "triton_client", "GatewayTTS": "gateway_client", "AsyncGatewayTTS": "gateway_aio"}

__all__ = ["SAMPLE_RATE", "TTSError", "VoiceInfo", "read_wav", "write_wav", "TritonTTS", "AsyncTritonTTS",
           "AudioStream", "AsyncAudioStream", "TextAudioStream", "AsyncTextAudioStream", "GatewayTTS",
           "AsyncGatewayTTS"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
