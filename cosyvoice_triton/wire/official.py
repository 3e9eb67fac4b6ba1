"""The official runtime's tensor form (models cosyvoice2_official and cosyvoice2_official_offline, and
cosyvoice3_official and cosyvoice3_official_offline on a CosyVoice3 folder: every tensor [1, ...]) turned into ours,
and which model takes a request that names cosyvoice2 or cosyvoice3 in either form.

Triton checks ranks against a model's config before the model runs, so one model name cannot take both forms;
docs/api/official.md says what the official clients send and what it means here.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.wire.names import (DEFAULT_VOICE_ID, FAMILY_MODELS, OFFICIAL_MODELS, OWNER_MODELS,
                                         REFERENCE_AUDIO_ID, REFERENCE_SAMPLE_RATE, REFERENCE_WAV, TEXT_APPEND,
                                         VOICE_INPUTS)
from cosyvoice_triton.wire.tensors import string_array

TENSOR_FORMS = ("native", "official")  # cosyvoice2's config parameter tensor_form (params.TensorForm)
NATIVE_FORM, OFFICIAL_FORM = TENSOR_FORMS
OFFICIAL_SAMPLE_RATE = 16000  # the official cosyvoice2 takes reference_wav at this rate, with no rate input


def from_official_form(arrays: Mapping[str, np.ndarray], has_voice: Callable[[str], bool]) -> dict[str, np.ndarray]:
    """An official-form request's inputs (each [1, ...]) as the native form's, for `parse_cosyvoice2_request`.

    The batch dimension goes (InvalidInput naming the input when it is not 1); reference_wav without
    reference_sample_rate is at 16 kHz; a request without a voice (the official "spk2info cache" request:
    target_text alone) speaks in voice `default`, which `has_voice(voice_id)` says is stored (else
    InvalidInput naming reference_wav: a client error, as a missing voice is in the native form).
    reference_wav_len stays: the native form honours it too (`read_prompt_audio`)."""
    values = {name: _unbatched(name, array) for name, array in arrays.items()}
    if REFERENCE_WAV in values and REFERENCE_SAMPLE_RATE not in values:
        values[REFERENCE_SAMPLE_RATE] = np.array([OFFICIAL_SAMPLE_RATE], np.int32)
    if not any(name in values for name in VOICE_INPUTS) and TEXT_APPEND not in values:  # a text piece has none
        if not has_voice(DEFAULT_VOICE_ID):
            raise InvalidInput(REFERENCE_WAV, f"a voice is required: reference_wav (+ reference_wav_len, "
                                              f"reference_text) or reference_audio_id; without one the voice "
                                              f"{DEFAULT_VOICE_ID!r} is used, and none is registered under that id "
                                              f"(`cosyvoice-triton up` registers it at start)")
        values[REFERENCE_AUDIO_ID] = string_array(DEFAULT_VOICE_ID)
    return values


def _unbatched(name: str, array: np.ndarray) -> np.ndarray:
    """One request's tensor without its batch dimension: [1, ...] -> [...]."""
    if array.ndim == 0 or array.shape[0] != 1:
        raise InvalidInput(name, f"expected a batch of one request ([1, ...]), got shape {list(array.shape)}")
    return array[0]


def owner_input(model: str, owner: str | None) -> np.ndarray | None:
    """The `owner` tensor of a request to `model` on behalf of `owner` (a gateway's caller): [1], or [1, 1] for the
    official models (their tensors have a batch dimension); None when `model` takes none or `owner` is None."""
    if owner is None or model not in OWNER_MODELS:
        return None
    value = string_array(owner)
    return value.reshape(1, 1) if model in OFFICIAL_MODELS else value


def official_model_for(model: str, shapes: Mapping[str, Sequence[int]], streaming: bool) -> str:
    """The model to call for a request that names `model` with inputs of these shapes (name -> shape).

    The official clients can only name a family's own model (cosyvoice2, cosyvoice3), so a gateway in front of
    Triton (gateway/triton_facade.py, routes_kserve.py) sends their requests on: a family's streaming or offline
    model in the official form (any input of rank 2: a native request has only rank-1 tensors,
    reference_wav_len [1] included) to that family's official streaming model when streamed to its streaming
    model (cosyvoice2 -> cosyvoice2_official, cosyvoice3 -> cosyvoice3_official), else to its official offline
    model. Any other request keeps its model."""
    family = next((models for models in FAMILY_MODELS.values() if model in models[:2]), None)
    if family is None or not any(len(shape) >= 2 for shape in shapes.values()):
        return model
    streamed, whole = family[2:]
    return streamed if streaming and model == family[0] else whole
