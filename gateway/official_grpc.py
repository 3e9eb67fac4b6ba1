"""The official CosyVoice gRPC service, `cosyvoice.CosyVoice/Inference` (gateway/cosyvoice.proto; its generated
modules are checked in), on a port of its own, so that the official gRPC client works unchanged. A call goes
through the application's own middlewares (access log, metrics, errors, keys, draining) through `GrpcCall`, and
their HTTP answer becomes its gRPC status (`grpc_error`). The service, its statuses and how to regenerate the
modules: docs/api/official.md#the-official-grpc-service-cosyvoicecosyvoiceinference.
"""
from __future__ import annotations

import functools
import json
import time
import uuid
from contextlib import aclosing
from types import MappingProxyType, SimpleNamespace

import grpc
from aiohttp import web

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.audio_out import AudioEncoder
from cosyvoice_triton.pipeline.audible import AudibleDetector

from . import access_log, cosyvoice_pb2, cosyvoice_pb2_grpc
from .audio_response import observe_first_audible
from .auth import limit_key
from .grpc_server import MESSAGE_OVERHEAD_BYTES, grpc_status, metadata_headers, running_server
from .official_api import GRPC_FIELDS, KINDS, PCM, Kind, official_request, pcm16_wav, prepare_official
from .state import CONFIG, LIMITER, METRICS
from .synthesis import routing_cost, stream_audio

INFERENCE = "/cosyvoice.CosyVoice/Inference"  # the method's path: the route of its metrics and access log
ROUTE = "official_grpc"  # the route label of its audio metrics
PAYLOADS = {"sft_request": "sft", "zero_shot_request": "zero_shot", "cross_lingual_request": "cross_lingual",
            "instruct_request": "instruct"}  # Request's oneof RequestPayload -> official_api.KINDS
OFFICIAL_GRPC_PORT = web.AppKey("official_grpc_port", int)  # the port it listens on, once started


class GrpcCall(dict):
    """One gRPC call as the app's middlewares read a request: `request[KEY]` values, its metadata as headers,
    the method's path as path and route."""

    method = "GRPC"
    path = INFERENCE
    query = MappingProxyType({})  # no query string: keys come in metadata only
    transport = None
    match_info = SimpleNamespace(route=SimpleNamespace(resource=SimpleNamespace(canonical=INFERENCE)))

    def __init__(self, app: web.Application, metadata, client_max_size: int):
        super().__init__()
        self.app = app
        self.headers = metadata_headers(metadata)
        self.client_max_size = client_max_size


class OfficialService(cosyvoice_pb2_grpc.CosyVoiceServicer):
    def __init__(self, app: web.Application, max_message_bytes: int):
        self.app = app
        self.max_message_bytes = max_message_bytes

    async def Inference(self, request: cosyvoice_pb2.Request, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        call = GrpcCall(self.app, context.invocation_metadata(), self.max_message_bytes)
        handler = functools.partial(self._infer, request=request, context=context)
        for middleware in reversed(self.app.middlewares):  # as aiohttp chains them: the first is outermost
            handler = functools.partial(middleware, handler=handler)
        response = await handler(call)
        if response.status >= 400:
            await context.abort(*grpc_error(response))

    async def _infer(self, call: GrpcCall, request: cosyvoice_pb2.Request,
                     context: grpc.aio.ServicerContext) -> web.Response:
        app = self.app
        kind, values = payload_fields(request)
        if "seed" in call.headers:
            values["seed"] = call.headers["seed"]
        official = official_request(kind, values, GRPC_FIELDS, app[CONFIG].limits)
        inputs, prompt_tokens = await prepare_official(app, official, GRPC_FIELDS)
        with app[LIMITER].slot(limit_key(call)):
            await send_pcm(call, context, stream_audio(app, inputs, routing_cost(app, inputs, prompt_tokens),
                                                       GRPC_FIELDS, uuid.uuid4().hex))
        return web.Response()  # 200 for the metrics and the access log


def payload_fields(request: cosyvoice_pb2.Request) -> tuple[Kind, dict[str, object]]:
    """(official_api.Kind, its fields by the proto's names), prompt_audio as a WAV file's bytes."""
    payload = request.WhichOneof("RequestPayload")
    if payload is None:
        raise InvalidInput("RequestPayload", f"set one of {', '.join(PAYLOADS)}")
    message = getattr(request, payload)
    values = {field.name: getattr(message, field.name) for field in message.DESCRIPTOR.fields}
    if "prompt_audio" in values:
        values["prompt_audio"] = pcm16_wav(values["prompt_audio"], "prompt_audio")
    return KINDS[PAYLOADS[payload]], values


async def send_pcm(call: GrpcCall, context: grpc.aio.ServicerContext, chunks) -> None:
    """Each float32 chunk of `chunks` (synthesis.stream_audio) as a Response of 16-bit PCM, with /v1/tts's audio
    metrics and access-log figures; a cancelled call closes `chunks`, and with them the Triton stream."""
    app = call.app
    metrics, rate = app[METRICS], app[CONFIG].sample_rate
    accepted, samples, first = time.monotonic(), 0, True
    encoder = AudioEncoder(PCM, rate)
    audible = AudibleDetector(rate, app[CONFIG].audible_threshold_dbfs)
    metrics.active_streams.labels(ROUTE).inc()
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                if first:
                    first, waited = False, time.monotonic() - accepted
                    metrics.first_chunk.labels(ROUTE).observe(waited)
                    access_log.first_chunk(call, waited)
                if audible.feed(chunk, time.monotonic()):
                    observe_first_audible(call, ROUTE, audible.at - accepted)
                samples += chunk.size
                await write_pcm(context, encoder.feed(chunk))
        if audible.finish():
            observe_first_audible(call, ROUTE, audible.at - accepted)
        await write_pcm(context, encoder.finish())
    finally:
        encoder.close()
        metrics.active_streams.labels(ROUTE).dec()
        metrics.audio_seconds.labels(ROUTE).inc(samples / rate)
        access_log.audio_sent(call, samples / rate)


async def write_pcm(context: grpc.aio.ServicerContext, data: bytes) -> None:
    if data:
        await context.write(cosyvoice_pb2.Response(tts_audio=data))


def grpc_error(response: web.Response) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """(status, details, trailing metadata) of an error the middlewares answered (errors.py's JSON body)."""
    error = json.loads(response.body)["error"]
    metadata = [("error-code", error["code"])]
    if error.get("param"):
        metadata.append(("error-param", error["param"]))
    if "Retry-After" in response.headers:
        metadata.append(("retry-after", response.headers["Retry-After"]))
    return grpc_status(response.status), error["message"], tuple(metadata)


async def serve_official_grpc(app: web.Application):
    """cleanup_ctx: the service on `config.official_grpc_port` (0: a free one), from startup to cleanup."""
    config = app[CONFIG]
    max_message_bytes = config.limits.max_upload_bytes + MESSAGE_OVERHEAD_BYTES
    service = OfficialService(app, max_message_bytes)
    async with running_server(app, config.official_grpc_port,
                              lambda server: cosyvoice_pb2_grpc.add_CosyVoiceServicer_to_server(service, server),
                              [("grpc.max_receive_message_length", max_message_bytes)],
                              "official gRPC", "cosyvoice.CosyVoice/Inference") as port:
        app[OFFICIAL_GRPC_PORT] = port
        yield
