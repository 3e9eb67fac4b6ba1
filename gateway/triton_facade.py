"""Triton's own gRPC protocol on a port of the gateway, so that the official Triton client (client_grpc.py) works
unchanged: each request goes to the model `official_model_for` names (wire/official.py), passed on as it came but
for its model name, and Triton's answers come back as they are. Routing, admission, keys and limits are the
gateway's; a request to a model that takes an `owner` always goes with the caller's key's owner tag, never the
client's (`forwarded_as`). A request or a metadata call that names a family's model goes to a server of that
family (every family the servers serve: `Router.served_family`); the listings (all models' statistics, the
repository index) join one server of each family's. What is served and why: docs/api/official.md#why-a-facade.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import nullcontext

import grpc
from aiohttp import web
from tritonclient.grpc import service_pb2, service_pb2_grpc

from cosyvoice_triton.errors import CosyVoiceError, NotFound, RemoteError
from cosyvoice_triton.pipeline.audible import AudibleDetector
from cosyvoice_triton.server_pool import Server
from cosyvoice_triton.wire.names import (OWNER, REFERENCE_WAV, REFERENCE_WAV_LEN, SYNTHESIS_MODELS, TARGET_TEXT,
                                         TEXT_APPEND, TEXT_STREAM_ID, WAVEFORM)
from cosyvoice_triton.wire.official import official_model_for, owner_input
from cosyvoice_triton.wire.call_reader import status_error
from cosyvoice_triton.wire.grpc_messages import (MAX_MESSAGE_BYTES, STREAM_END_WAIT_S, infer_request, is_final,
                                                 response_outputs)

from .auth import ApiKeys, Tenant, header_key
from .errors import answer_of, http_status
from .grpc_server import MESSAGE_OVERHEAD_BYTES, grpc_status, metadata_headers, running_server
from .state import CONFIG, DRAIN, LIMITER, METRICS, ROUTER
from .synthesis import refused_by_server, routed, synthesis_cost
from .triton_channel import rpc_error

log = logging.getLogger(__name__)

OFFICIAL_TRITON_PORT = web.AppKey("official_triton_port", int)  # the port it listens on, once started
ROUTE = "triton_grpc"  # the route label of its audio metrics
MODEL_NAME = "model_name"  # the field an error about the request's model names (as the KServe route's)
Write = Callable[[service_pb2.ModelStreamInferResponse], Awaitable[None]]


class TritonFacade(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, app: web.Application):
        self.app = app
        config = app[CONFIG]
        self.keys = ApiKeys(keys=config.api_keys, admin=config.admin_keys)

    # ---- asked of a healthy server (of the family of the model named) ------------------------------------------
    async def ServerLive(self, request, context):  # noqa: N802 - Triton's method names
        return await self._ask("ServerLive", request, context, public=True)

    async def ServerReady(self, request, context):  # noqa: N802
        return await self._ask("ServerReady", request, context, public=True)

    async def ModelReady(self, request, context):  # noqa: N802
        try:
            self.app[ROUTER].served_family(request.name)
        except NotFound:  # a family no server serves: not ready, as Triton answers for a model it does not have
            return service_pb2.ModelReadyResponse(ready=False)
        return await self._ask("ModelReady", request, context, model=request.name)

    async def ServerMetadata(self, request, context):  # noqa: N802
        return await self._ask("ServerMetadata", request, context)

    async def ModelMetadata(self, request, context):  # noqa: N802
        return await self._ask("ModelMetadata", request, context, model=request.name)

    async def ModelConfig(self, request, context):  # noqa: N802
        return await self._ask("ModelConfig", request, context, model=request.name)

    async def ModelStatistics(self, request, context):  # noqa: N802
        if not request.name:  # every model's: each family's from a server of that family
            return await self._ask_each_family("ModelStatistics", request, context, "model_stats")
        return await self._ask("ModelStatistics", request, context, model=request.name)

    async def RepositoryIndex(self, request, context):  # noqa: N802
        return await self._ask_each_family("RepositoryIndex", request, context, "models")

    async def _ask(self, method: str, request, context: grpc.aio.ServicerContext, public: bool = False,
                   model: str = ""):
        """`method` asked of a server of the family whose model the request names (any server when it names none
        or a model of no family; NOT_FOUND naming model_name for a family no server serves)."""
        try:
            if not public:
                self._tenant(context)
            router = self.app[ROUTER]
            return await self._call(router.pick(family=router.served_family(model, MODEL_NAME)), method, request)
        except grpc.aio.AioRpcError as error:
            await context.abort(error.code(), error.details() or "")
        except CosyVoiceError as exc:
            await context.abort(*aborted(exc))

    async def _ask_each_family(self, method: str, request, context: grpc.aio.ServicerContext, entries: str):
        """`method`'s listing (its repeated field `entries`, each entry a model by `name`) asked of one server of
        each family served, joined: each family's synthesis models as a server of that family lists them, every
        other model (llm, token2wav, ...) as the server of the default family (`family_for(None)`) lists it."""
        try:
            self._tenant(context)
            router = self.app[ROUTER]
            families = [f for f in dict.fromkeys([router.family_for(None), *router.families]) if f in router.families]
            answers = [(family, await self._call(router.pick(family=family), method, request))
                       for family in families or [None]]
        except grpc.aio.AioRpcError as error:
            await context.abort(error.code(), error.details() or "")
        except CosyVoiceError as exc:
            await context.abort(*aborted(exc))
        if len(answers) == 1:
            return answers[0][1]
        default, joined = answers[0][0], type(answers[0][1])()
        for family, answer in answers:
            getattr(joined, entries).extend(entry for entry in getattr(answer, entries)
                                            if (router.model_family(entry.name) or default) == family)
        return joined

    async def _call(self, server: Server, method: str, request):
        return await getattr(server.client.stub, method)(request, timeout=self.app[CONFIG].routing.health_timeout_s)

    # ---- inference ------------------------------------------------------------------------------------------
    async def ModelInfer(self, request: service_pb2.ModelInferRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> service_pb2.ModelInferResponse:
        app = self.app
        model = official_model_for(request.model_name, shapes(request), streaming=False)
        deadline = context.time_remaining()
        timeout_s = app[CONFIG].routing.offline_timeout_s if deadline is None else deadline

        async def send(server: Server) -> service_pb2.ModelInferResponse:
            try:
                return await server.client.stub.ModelInfer(forwarded, timeout=timeout_s)
            except grpc.aio.AioRpcError as error:
                raise rpc_error(error) from None

        accepted = time.monotonic()
        try:
            tenant = self._tenant(context)
            forwarded = forwarded_as(request, model, tenant.owner)
            app[DRAIN].refuse_new()
            with self._stream_slot(model, tenant, request):
                response = await self._routed(model, request_cost(app, request), send)
        except RemoteError as exc:
            await context.abort(exc.status.code(), exc.status.details() or "")
        except CosyVoiceError as exc:
            await context.abort(*aborted(exc))
        timing = AudioTiming(app, accepted)  # the whole waveform comes at once
        timing.feed(response)
        timing.finish()
        app[METRICS].audio_seconds.labels(ROUTE).inc(waveform_samples(response) / app[CONFIG].sample_rate)
        response.model_name = request.model_name
        return response

    async def ModelStreamInfer(self, requests, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        """Each request of the client's stream on its own upstream call, their responses written back as they come
        (one writer at a time); the call ends when the client closed its side and every request ended."""
        try:
            tenant = self._tenant(context)
        except CosyVoiceError as exc:
            await context.abort(*aborted(exc))
        lock = asyncio.Lock()
        bistreams: dict[str, Server] = {}  # text_stream_id -> the server of its opening request

        async def write(response: service_pb2.ModelStreamInferResponse) -> None:
            async with lock:
                await context.write(response)

        tasks: set[asyncio.Task] = set()
        try:
            async for request in requests:
                tasks = {task for task in tasks if not task.done()}
                tasks.add(asyncio.create_task(self._stream_one(request, tenant, write, bistreams)))
            await asyncio.gather(*tasks)
        finally:  # the client went away (or this failed): cancel what runs, and with it each upstream call
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _stream_one(self, request: service_pb2.ModelInferRequest, tenant: Tenant, write: Write,
                          bistreams: dict[str, Server]) -> None:
        """One streamed request, relayed; its failure is written as Triton writes one (an error response)."""
        app = self.app
        model = official_model_for(request.model_name, shapes(request), streaming=True)
        forwarded = forwarded_as(request, model, tenant.owner)
        stream_id = bytes_value(request, TEXT_STREAM_ID)
        appended = TEXT_APPEND in shapes(request)

        async def relay(server: Server) -> None:
            if stream_id is not None and not appended:
                bistreams[stream_id] = server  # its text_append requests go there too
            try:
                await self._relay(server, forwarded, request.model_name, write)
            finally:
                if stream_id is not None and not appended and bistreams.get(stream_id) is server:
                    del bistreams[stream_id]

        try:
            app[DRAIN].refuse_new()
            with self._stream_slot(model, tenant, request):
                await self._routed(model, request_cost(app, request), relay,
                                   server=bistreams.get(stream_id) if appended else None)
        except RemoteError as exc:
            await write(error_response(request, exc.status.details() or exc.error.to_wire()))
        except CosyVoiceError as exc:
            await write(error_response(request, exc.to_wire()))
        except Exception:  # noqa: BLE001 - the client gets an error response, as for any other failure
            log.exception("relaying request %r of model %s failed", request.id, request.model_name)
            await write(error_response(request, CosyVoiceError("internal error").to_wire()))

    async def _relay(self, server: Server, request: service_pb2.ModelInferRequest, asked: str, write: Write) -> None:
        """`request` as its own ModelStreamInfer call on `server` (sent, then our side closed), each response
        written as it comes (model_name: `asked`) until Triton ends the call; at most STREAM_END_WAIT_S after
        the final response (as call_reader.py waits). Cancelled: the call is cancelled. RemoteError (its `status`:
        the gRPC error) when the call fails before any response (another server may take it); after one, an error
        response."""
        metrics, rate = self.app[METRICS], self.app[CONFIG].sample_rate

        async def one_request():
            yield request

        call = server.client.stub.ModelStreamInfer(one_request())
        relayed = final = False
        samples = 0
        timing = AudioTiming(self.app, time.monotonic())
        metrics.active_streams.labels(ROUTE).inc()
        try:
            while True:
                read = call.read()
                response = await (asyncio.wait_for(read, STREAM_END_WAIT_S) if final else read)
                if response is grpc.aio.EOF:
                    return
                if response.HasField("infer_response"):
                    response.infer_response.model_name = asked
                samples += waveform_samples(response.infer_response)
                timing.feed(response.infer_response)
                await write(response)
                relayed = True
                final = final or bool(response.error_message) or is_final(response.infer_response)
        except asyncio.TimeoutError:
            return  # the final response came and the call did not end: cancelled below
        except grpc.aio.AioRpcError as error:
            if not relayed:
                raise rpc_error(error) from None
            await write(error_response(request, error.details() or status_error(error).to_wire()))
        finally:
            call.cancel()  # nothing once the call ended; else Triton cancels the request
            timing.finish()
            metrics.active_streams.labels(ROUTE).dec()
            metrics.audio_seconds.labels(ROUTE).inc(samples / rate)

    # ---- routing, keys and limits -------------------------------------------------------------------------
    async def _routed(self, model: str, cost: float, send: Callable[[Server], Awaitable], server: Server | None = None):
        """synthesis.routed (admission first for a synthesis model), a server's refusal counted as the gateway's
        own routes count it."""
        try:
            return await routed(self.app, cost, send, admit=model in SYNTHESIS_MODELS, server=server,
                                family=self.app[ROUTER].served_family(model, MODEL_NAME))
        except RemoteError as exc:
            refused_by_server(self.app, exc)
            raise

    def _tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        """The caller's tenant from its metadata (Unauthorized when keys are on and none valid is given)."""
        key = header_key(metadata_headers(context.invocation_metadata())) if self.keys.enabled else None
        return self.keys.tenant(key)

    def _stream_slot(self, model: str, tenant: Tenant, request: service_pb2.ModelInferRequest):
        """A synthesis (not a text piece for one) counts against its tenant's stream limit while it runs."""
        if model in SYNTHESIS_MODELS and TEXT_APPEND not in shapes(request):
            return self.app[LIMITER].slot(tenant.bucket)
        return nullcontext()


# ---- messages -------------------------------------------------------------------------------------------

def shapes(request: service_pb2.ModelInferRequest) -> dict[str, list[int]]:
    return {tensor.name: list(tensor.shape) for tensor in request.inputs}


def forwarded_as(request: service_pb2.ModelInferRequest, model: str,
                 owner: str | None) -> service_pb2.ModelInferRequest:
    """`request` for `model`, with the caller's `owner` input (official.owner_input) in place of any the client
    sent: the gateway says whose voices a request names and who registers, so a key reaches its own voices and
    the shared ones only, on every model that takes an owner."""
    owner_tensor = owner_input(model, owner)
    sent = [index for index, tensor in enumerate(request.inputs) if tensor.name == OWNER]
    if model == request.model_name and not sent and owner_tensor is None:
        return request
    forwarded = service_pb2.ModelInferRequest()
    forwarded.CopyFrom(request)
    forwarded.model_name = model
    contents = len(forwarded.inputs) > 0 and not forwarded.raw_input_contents  # values in `contents`, not raw
    for index in reversed(sent):
        del forwarded.inputs[index]
        if not contents and index < len(forwarded.raw_input_contents):
            del forwarded.raw_input_contents[index]
    if owner_tensor is not None:
        built = infer_request(model, {OWNER: owner_tensor})
        forwarded.inputs.append(built.inputs[0])
        if contents:
            forwarded.inputs[-1].contents.bytes_contents.append(owner.encode())
        else:
            forwarded.raw_input_contents.append(built.raw_input_contents[0])
    return forwarded


def raw_inputs(request: service_pb2.ModelInferRequest) -> dict[str, tuple[list[int], bytes]]:
    """Input name -> (shape, raw bytes) of the inputs sent in `raw_input_contents` (as tritonclient sends all)."""
    return {tensor.name: (list(tensor.shape), raw) for tensor, raw in zip(request.inputs, request.raw_input_contents)}


def bytes_value(request: service_pb2.ModelInferRequest, name: str) -> str | None:
    """The first element of BYTES input `name` as text, or None when not sent raw."""
    _, raw = raw_inputs(request).get(name, ([], b""))
    if len(raw) < 4:
        return None
    return raw[4:4 + int.from_bytes(raw[:4], "little")].decode("utf-8", "replace")


def request_cost(app: web.Application, request: service_pb2.ModelInferRequest) -> float:
    """The request's cost for the router, from its target_text and its prompt's length (reference_wav_len, at most
    reference_wav's, at the official 16 kHz); inputs not sent raw count as absent."""
    inputs = raw_inputs(request)
    shape = inputs.get(REFERENCE_WAV, ([], b""))[0]
    sent = shape[-1] if shape else 0
    length = inputs.get(REFERENCE_WAV_LEN, ([], b""))[1]
    samples = min(sent, int.from_bytes(length[:4], "little", signed=True)) if len(length) >= 4 else sent
    return synthesis_cost(app, bytes_value(request, TARGET_TEXT) or "", samples)


class AudioTiming:
    """A relayed request's first chunk and first audible audio (pipeline/audible.py), from `accepted`, in the
    gateway's metrics under this facade's route."""

    def __init__(self, app: web.Application, accepted: float):
        self.metrics, self.accepted = app[METRICS], accepted
        self.audible = AudibleDetector(app[CONFIG].sample_rate, app[CONFIG].audible_threshold_dbfs)
        self.first = True

    def feed(self, response: service_pb2.ModelInferResponse) -> None:
        if not waveform_samples(response):
            return
        now = time.monotonic()
        if self.first:
            self.first = False
            self.metrics.first_chunk.labels(ROUTE).observe(now - self.accepted)
        if self.audible.feed(response_outputs(response)[WAVEFORM].reshape(-1), now):
            self.metrics.first_audible.labels(ROUTE).observe(self.audible.at - self.accepted)

    def finish(self) -> None:
        if self.audible.finish():
            self.metrics.first_audible.labels(ROUTE).observe(self.audible.at - self.accepted)


def waveform_samples(response: service_pb2.ModelInferResponse) -> int:
    return sum(len(raw) // 4 for tensor, raw in zip(response.outputs, response.raw_output_contents)
               if tensor.name == WAVEFORM)


def error_response(request: service_pb2.ModelInferRequest, message: str) -> service_pb2.ModelStreamInferResponse:
    """A failed streamed request's answer, as Triton gives one."""
    return service_pb2.ModelStreamInferResponse(
        error_message=message, infer_response=service_pb2.ModelInferResponse(model_name=request.model_name,
                                                                             id=request.id))


def aborted(exc: CosyVoiceError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """(status, details, trailing metadata) of an error the gateway answers itself: its status as the gateway's
    HTTP routes say it, its JSON (errors.py `to_wire`, with `retry_after_s`) and a `retry-after` entry."""
    status = grpc_status(http_status(answer_of(exc)))
    retry = (("retry-after", str(exc.retry_after_s)),) if exc.retry_after_s is not None else ()
    return status, exc.to_wire(), retry


async def serve_official_triton(app: web.Application):
    """cleanup_ctx: the facade on `config.official_triton_port` (0: a free one), from startup to cleanup."""
    config = app[CONFIG]
    facade = TritonFacade(app)
    options = [("grpc.max_receive_message_length", config.limits.max_upload_bytes + MESSAGE_OVERHEAD_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    async with running_server(app, config.official_triton_port,
                              lambda server: service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(facade, server),
                              options, "official Triton gRPC",
                              "inference.GRPCInferenceService; the official clients' cosyvoice2 / cosyvoice3") as port:
        app[OFFICIAL_TRITON_PORT] = port
        yield
