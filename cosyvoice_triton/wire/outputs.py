"""What the public models answer, built by the model and read by its caller: audio (`waveform`), speech marks
(`marks`) and a registration (`RegisterOutputs`). Never imports torch: the client SDK reads answers here.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from cosyvoice_triton.wire.names import AUDIO_SHA256, MARKS, PROMPT_TOKENS, VOICE_ID, WAVEFORM
from cosyvoice_triton.wire.tensors import string_array


def waveform_outputs(audio: np.ndarray, batched: bool = False) -> dict[str, np.ndarray]:
    """An answer with audio: a cosyvoice2 chunk or the twin's whole waveform (N,), or, `batched` (1, N), a
    token2wav chunk or a cosyvoice2_official* answer."""
    waveform = np.ascontiguousarray(audio, dtype=np.float32)
    return {WAVEFORM: waveform.reshape(1, -1) if batched else waveform.reshape(-1)}


def waveform_of(outputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """The `waveform` of a cosyvoice2, cosyvoice2_offline or token2wav answer: (N,) float32 at 24 kHz."""
    return np.asarray(outputs[WAVEFORM], dtype=np.float32).reshape(-1)


def chunk_of(outputs: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """A streamed cosyvoice2 response's audio as `waveform_of`; None when it carries none."""
    return waveform_of(outputs) if outputs.get(WAVEFORM) is not None and outputs[WAVEFORM].size else None


def marks_outputs(events: list[dict], batched: bool = False) -> dict[str, np.ndarray]:
    """A cosyvoice2 answer's speech mark events (pipeline/speech_marks.py) as its `marks` ([1, 1] `batched`)."""
    marks = string_array(json.dumps(events, ensure_ascii=False))
    return {MARKS: marks.reshape(1, 1) if batched else marks}


def marks_of(outputs: Mapping[str, np.ndarray]) -> list[dict]:
    """The speech mark events of a cosyvoice2 answer, in order ([] when it carries none)."""
    marks = outputs.get(MARKS)
    return json.loads(first_string(marks)) if marks is not None and marks.size else []


@dataclass(frozen=True)
class RegisterOutputs:
    """register_voice's answer: built by the model (`tensors()`), read by a caller (`parse_register_outputs`)."""

    voice_id: str
    audio_sha256: str
    prompt_tokens: int  # prompt speech tokens stored (25 per second)

    def tensors(self) -> dict[str, np.ndarray]:
        return {VOICE_ID: string_array(self.voice_id), AUDIO_SHA256: string_array(self.audio_sha256),
                PROMPT_TOKENS: np.array([self.prompt_tokens], dtype=np.int32)}


def parse_register_outputs(outputs: Mapping[str, np.ndarray]) -> RegisterOutputs:
    return RegisterOutputs(voice_id=first_string(outputs[VOICE_ID]), audio_sha256=first_string(outputs[AUDIO_SHA256]),
                           prompt_tokens=int(outputs[PROMPT_TOKENS].reshape(-1)[0]))


def first_string(array: np.ndarray) -> str:
    """The first value of a STRING tensor, decoded."""
    return array.reshape(-1)[0].decode("utf-8")
