"""`llm`: speech tokens streamed from the in-flight batching `LLMScheduler` (tensors: wire/stage_tensors.py).

execute() only parses and hands each request to `LLMStreamForwarder` (triton/llm_streams.py), which
forwards every scheduler stream's tokens to its response sender and ends it with one final flag. This file
is the adaptor: tensors in, a pb_utils response sender as a `TokenSender`, metrics out.
"""
from __future__ import annotations

# First: what this model computes runs below the stub's health thread (cosyvoice_triton/triton/stub_priority.py).
from cosyvoice_triton.triton.stub_priority import yield_to_stub_health

yield_to_stub_health()

import json
from contextlib import nullcontext

import torch
import triton_python_backend_utils as pb_utils

from cosyvoice_triton.engines.cuda_graphs import use_cuda_graphs
from cosyvoice_triton.models.compiled import apply_compile
from cosyvoice_triton.models.llm_precision import describe_backbone
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.llm.scheduler import LLMScheduler
from cosyvoice_triton.pipeline.threads import thread_plan
from cosyvoice_triton.triton import instance_device, open_core_share
from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.wire.names import TEXT_APPEND
from cosyvoice_triton.wire.stage_tensors import StreamCancel, parse_llm_request, speech_tokens_outputs
from cosyvoice_triton.wire.requests import TextAppend
from cosyvoice_triton.triton.llm_streams import LLMStreamForwarder
from cosyvoice_triton.triton.metrics import LLM_METRICS, ModelMetrics, instance_labels
from cosyvoice_triton.triton.params import LLMParams, parse_parameters
from cosyvoice_triton.wire.tensors import TensorReader
from cosyvoice_triton.triton.pb_glue import error_response, output_tensors, request_arrays

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class _TritonTokenSender:
    """A decoupled request's response sender as the forwarder's `TokenSender`."""

    def __init__(self, sender, model: str):
        self.sender = sender
        self.model = model

    def send_tokens(self, tokens: list[int]) -> None:
        self.sender.send(_tokens_response(tokens))

    def send_final(self) -> None:
        self.sender.send(flags=FINAL)

    def send_error(self, error: Exception) -> None:
        self.sender.send(error_response(pb_utils, error, self.model), flags=FINAL)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = args["model_name"]
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ValueError(f"{self.name} must be decoupled (model_transaction_policy)")
        self.params = params = parse_parameters(LLMParams, config, self.name)
        device = instance_device(params.device, args)
        # Each decode round takes its threads from the server's core share (all cores while token2wav is
        # idle; it waits while token2wav runs a first chunk), or a fixed share beside token2wav's.
        self.cores = open_core_share(params.core_share, params.torch_threads, device)
        if self.cores is None:
            torch.set_num_threads(params.torch_threads or thread_plan().llm)
        threads = f"cores shared with token2wav ({self.cores.path})" if self.cores else \
            f"{torch.get_num_threads()} torch threads"
        llm = SpeechLM.from_model_dir(params.model_dir, device=device,
                                      max_batch=params.max_batch, max_seq_len=params.max_seq_len,
                                      precision=params.precision)
        compiled = apply_compile(params.compile, device, llm=llm)  # one warning line if it cannot
        if params.max_token_text_ratio is not None:
            llm.config.max_token_text_ratio = params.max_token_text_ratio
        self.default_sampling = llm.config.sampling
        self.scheduler = LLMScheduler(llm, max_batch=params.max_batch, max_seq_len=params.max_seq_len,
                                      max_queue=params.max_queue,
                                      step_unit=(lambda: self.cores.running("llm")) if self.cores else nullcontext,
                                      cuda_graphs=use_cuda_graphs(params.cuda_graphs, device))
        pb_utils.Logger.log_info(f"{self.name}: backbone {describe_backbone(llm)}; {threads}; "
                                 f"compiled: {', '.join(compiled) or 'none'} (compile {params.compile}); "
                                 f"CUDA graphs: {self._warm_graphs()}")
        self.metrics = ModelMetrics(pb_utils, LLM_METRICS, instance_labels(args))
        self.metrics.labelled("precision", llm.precision).set(1)
        self.streams = LLMStreamForwarder(self.scheduler, on_tokens=self._refresh, on_end=self._count_end)
        self.streams.start()
        self._refresh()

    def _warm_graphs(self) -> str:
        """The decode step's first buckets captured before the first request (llm/decode_graphs.py)."""
        graphs = self.scheduler.decode_graphs
        return "off" if graphs is None else graphs.warm_up_report()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                item = parse_llm_request(TensorReader(request_arrays(request)), self.default_sampling)
                if isinstance(item, StreamCancel):
                    self.streams.cancel(item.stream_id)
                    sender.send(flags=FINAL)
                elif isinstance(item, TextAppend):
                    self._append(item)
                    sender.send(flags=FINAL)
                else:
                    if item.bistream:  # a BLS caller's exec() returns at the first response: it must
                        sender.send(_opened_response())  # append the text before any token can come
                    self.streams.open(item, _TritonTokenSender(sender, self.name))
            except Exception as exc:  # noqa: BLE001 - answered to this request only
                sender.send(error_response(pb_utils, exc, self.name), flags=FINAL)
        self._refresh()
        return None

    def _append(self, item: TextAppend) -> None:
        """Bistream text for a live stream (dropped when the stream has ended already)."""
        try:
            self.streams.append_text(item.stream_id, item.text, item.end)
        except ValueError as exc:
            raise InvalidInput(TEXT_APPEND, str(exc)) from None

    def _count_end(self, reason: str) -> None:
        self.metrics.labelled("ended", reason).increment(1)
        self._refresh()

    def _refresh(self) -> None:
        def read():
            stats = self.scheduler.stats
            return {"active": stats.active_streams, "queued": stats.queued, "free_slots": stats.slots_free,
                    "batch": stats.last_batch_size, "tps": stats.tokens_per_s}

        self.metrics.set_gauges(read)

    def finalize(self):
        self.streams.stop()  # stops the scheduler, which fails every open stream; waits for their finals
        if self.cores is not None:
            self.cores.close()


def _tokens_response(tokens: list[int]):
    return pb_utils.InferenceResponse(output_tensors=output_tensors(pb_utils, speech_tokens_outputs(tokens)))


def _opened_response():
    """An empty speech_tokens response: a bistream stream is open (callers skip responses without tokens)."""
    return _tokens_response([])

