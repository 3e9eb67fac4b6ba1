"""POST /v2/models/{name}/infer: KServe v2 JSON inference for the synthesis models of every family the servers
serve (`cosyvoice2` and `cosyvoice2_offline`, `cosyvoice3` and `cosyvoice3_offline`: `Router.synthesis_models`), so
that the official Triton client client_http.py works against the gateway unchanged. A non-streamed synthesis like
/v1/tts's (keys, limits, admission, routing, retries) on a server of the family the name names; a request in the
official form goes to the family's official offline model (`cosyvoice2_official_offline`,
`cosyvoice3_official_offline`: wire/official.py). Errors answer as Triton's HTTP port does, with the gateway's
statuses. The body, the answer and why: docs/api/official.md#the-official-triton-clients.
"""
from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from aiohttp import web

from cosyvoice_triton.errors import CosyVoiceError, InvalidInput, NotFound, RemoteError
from cosyvoice_triton.wire.names import OWNER, REFERENCE_WAV, REFERENCE_WAV_LEN, SEED, TARGET_TEXT, WAVEFORM
from cosyvoice_triton.wire.official import official_model_for, owner_input
from cosyvoice_triton.wire.grpc_messages import DATATYPES

from .audio_response import observe_whole_answer
from .auth import current_tenant, limit_key
from .errors import answer_headers, bounded, http_status, upstream
from .fields import Fields
from .route_requests import json_body
from .request_keys import ERROR_CODE
from .state import CONFIG, LIMITER, ROUTER
from .synthesis import call_model, refused_by_server, synthesis_cost

ROUTE = "kserve"  # the route label of its audio metrics
DTYPES = {"FP32": np.float32, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64, "BOOL": np.bool_,
          "BYTES": object}


@dataclass(frozen=True)
class KServeRequest:
    inputs: dict[str, np.ndarray]  # name -> array in its shape (BYTES: an object array of bytes)
    outputs: tuple[str, ...] | None  # the outputs asked for; None: all
    id: str

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: array.shape for name, array in self.inputs.items()}

    def prompt_samples(self) -> int:
        """The prompt recording's samples, for its cost: reference_wav_len, at most reference_wav's length (0: none).
        Values of the wrong type count as absent (the model refuses them)."""
        wav, length = self.inputs.get(REFERENCE_WAV), self.inputs.get(REFERENCE_WAV_LEN)
        sent = wav.shape[-1] if wav is not None and wav.ndim else 0
        if length is not None and length.size and length.dtype.kind in "iu":
            return min(sent, int(length.reshape(-1)[0]))
        return sent

    def text(self) -> str:
        text = self.inputs.get(TARGET_TEXT)
        first = text.reshape(-1)[0] if text is not None and text.size else None
        return first.decode("utf-8", "replace") if isinstance(first, bytes) else ""


def parse_kserve(body: Mapping) -> KServeRequest:
    items = body.get("inputs")
    if not isinstance(items, list) or not items:
        raise InvalidInput("inputs", "is required: a list of {name, shape, datatype, data}")
    inputs: dict[str, np.ndarray] = {}
    for index, item in enumerate(items):
        name, array = parse_input(item, index)
        if name in inputs:
            raise InvalidInput(name, "is given twice")
        inputs[name] = array
    outputs = body.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                    for o in outputs):
            raise InvalidInput("outputs", "must be a list of {name}")
        outputs = tuple(o["name"] for o in outputs)
    request_id = body.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidInput("id", "must be a string")
    return KServeRequest(inputs, outputs, request_id)


def parse_input(item: object, index: int) -> tuple[str, np.ndarray]:
    """One input tensor; errors name it (`inputs[i]` until its name is known)."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise InvalidInput(f"inputs[{index}]", "must be an object with name, shape, datatype and data")
    name, datatype, shape, data = item["name"], item.get("datatype"), item.get("shape"), item.get("data")
    if datatype not in DTYPES:
        raise InvalidInput(name, f"datatype must be one of {', '.join(DTYPES)}, got {bounded(repr(datatype), 40)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise InvalidInput(name, "shape must be a list of sizes")
    if not isinstance(data, list):
        raise InvalidInput(name, "data must be a list of values (flat or nested)")
    try:
        flat = np.asarray(data, dtype=DTYPES[datatype]).reshape(-1)
    except (TypeError, ValueError, OverflowError):
        raise InvalidInput(name, f"data must be {datatype} values") from None
    if flat.size != math.prod(shape):
        raise InvalidInput(name, f"shape {shape} holds {math.prod(shape)} values, data has {flat.size}")
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise InvalidInput(name, "data must be strings")
        flat = np.array([v.encode("utf-8") for v in flat], dtype=object)
    if name == SEED and datatype == "INT64":
        if (flat < 0).any():
            raise InvalidInput(name, "must not be negative")
        flat = flat.astype(np.uint64)
    return name, flat.reshape(shape)


async def infer(request: web.Request) -> web.Response:
    app, name = request.app, request.match_info["name"]
    accepted = time.monotonic()
    models = app[ROUTER].synthesis_models()  # every served family's: the names it answers for
    try:
        if name not in models:
            raise NotFound("model_name", f"this gateway answers KServe inference for {', '.join(models)} only, "
                                         f"not {bounded(repr(name), 60)}")
        kserve = parse_kserve(await json_body(request))
        model = official_model_for(name, kserve.shapes, streaming=False)
        cost = synthesis_cost(app, kserve.text(), kserve.prompt_samples())
        with app[LIMITER].slot(limit_key(request)):
            outputs = await call_model(app, model, with_owner(kserve.inputs, model, current_tenant().owner), cost,
                                       app[CONFIG].routing.offline_timeout_s, kserve.id or uuid.uuid4().hex,
                                       admit=True)
    except RemoteError as exc:
        refused_by_server(app, exc)
        # The status as the other routes answer it; the text as Triton sent it (naming the input at fault).
        return kserve_error(request, upstream(exc, Fields()), exc.error.to_wire())
    except CosyVoiceError as exc:
        return kserve_error(request, exc)
    asked = kserve.outputs if kserve.outputs is not None else tuple(outputs)
    unknown = [o for o in asked if o not in outputs]
    if unknown:
        return kserve_error(request, InvalidInput("outputs", f"{model} has no output {bounded(repr(unknown[0]), 60)}"))
    await observe_whole_answer(request, ROUTE, outputs.get(WAVEFORM, np.zeros(0, np.float32)), accepted)
    return web.json_response({"model_name": name, "id": kserve.id,
                              "outputs": [output_json(o, outputs[o]) for o in asked]})


def with_owner(inputs: dict[str, np.ndarray], model: str, owner: str | None) -> dict[str, np.ndarray]:
    """`inputs` with the caller's owner tag (official.owner_input) in place of any `owner` the client sent: a key's
    reference_audio_id names its own voice or a shared one, never another key's."""
    tensor = owner_input(model, owner)
    sent = {name: array for name, array in inputs.items() if name != OWNER}
    return sent if tensor is None else {**sent, OWNER: tensor}


def output_json(name: str, array: np.ndarray) -> dict:
    if array.dtype == object:
        return {"name": name, "datatype": "BYTES", "shape": list(array.shape),
                "data": [v.decode("utf-8", "replace") for v in array.reshape(-1)]}
    return {"name": name, "datatype": DATATYPES[array.dtype], "shape": list(array.shape),
            "data": array.reshape(-1).tolist()}


def kserve_error(request: web.Request, error: CosyVoiceError, wire: str | None = None) -> web.Response:
    """{"error": wire (default: the error's own JSON)} with the error's status and headers (Retry-After);
    counted by the metrics middleware."""
    request[ERROR_CODE] = error.code
    return web.json_response({"error": wire or error.to_wire()}, status=http_status(error),
                             headers=answer_headers(error))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v2/models/{name}/infer", infer)
