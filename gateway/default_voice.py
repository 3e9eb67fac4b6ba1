"""Voice `default`: there out of the box, so `voice: "default"` works on a fresh install.

At start the gateway looks for it in the voice store; when it is missing, it registers the prompt
recording that ships with the project (`gateway/assets/default_voice.wav`: TRANSCRIPT spoken by
espeak-ng, made locally, 16 kHz mono, 4.1 s) through Triton's `register_voice` (so the server computes its
features once) under the id `default`. It waits for a healthy server and retries transient failures;
`/readyz` reports the state.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from cosyvoice_triton.errors import CosyVoiceError, RemoteError
from cosyvoice_triton.wire.names import DEFAULT_VOICE_ID

from .errors import http_status

log = logging.getLogger(__name__)

VOICE_ID = DEFAULT_VOICE_ID
TRANSCRIPT = "Hello, this is the default voice of the CosyVoice two service."
RECORDING = Path(__file__).parent / "assets" / "default_voice.wav"
RETRY_S = 1.0


def prompt_wav() -> bytes:
    """The default voice's prompt recording: TRANSCRIPT, spoken."""
    return RECORDING.read_bytes()


class DefaultVoice:
    """State of the default voice: pending (being registered), ready, failed or disabled."""

    def __init__(self, enabled: bool):
        self.state = "pending" if enabled else "disabled"
        self.error: str | None = None

    @property
    def pending(self) -> bool:
        return self.state == "pending"

    @property
    def settled(self) -> bool:
        """Nothing left to wait for (readiness does not hang on a voice that cannot be made)."""
        return self.state != "pending"

    async def ensure(self, exists, register, healthy) -> None:
        """Loop until the voice exists. `exists()` and `register(audio, text, voice_id)` are coroutines;
        `healthy()` says whether any server can take the registration."""
        audio: bytes | None = None
        while True:
            try:
                if await exists():
                    self.state = "ready"
                    return
                if healthy():
                    if audio is None:
                        audio = await asyncio.to_thread(prompt_wav)
                    await register(audio, TRANSCRIPT, VOICE_ID)
                    log.info("registered voice %r", VOICE_ID)
                    self.state = "ready"
                    return
            except RemoteError as exc:
                if not exc.retryable:
                    self._fail(exc.message)
                    return
                log.info("default voice: %s; retrying", exc.message)
            except Exception as exc:  # noqa: BLE001 - e.g. the store is unreachable for now
                if isinstance(exc, CosyVoiceError) and http_status(exc) < 500:
                    self._fail(exc.message)
                    return
                log.warning("default voice: %s: %s; retrying", type(exc).__name__, exc)
            await asyncio.sleep(RETRY_S)

    def _fail(self, message: str) -> None:
        self.state, self.error = "failed", message
        log.error("could not register voice %r: %s", VOICE_ID, message)
