"""`llm`: speech tokens streamed from the in-flight batching `LLMEngine` (contract: triton/contracts.py).

execute() only parses and submits: the engine thread decodes every live stream together, and one
forwarding job per stream (a bounded pool; each blocks on its own stream's queue) sends the stream's
tokens as they are sampled and ends it with the final flag. A cancel request, or the client going away,
cancels the engine stream, which frees its slot at the next round.
"""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.runtime.llm_engine import LLMEngine, LLMStream
from cosyvoice_triton.triton import instance_device
from cosyvoice_triton.triton.contracts import StreamCancel, parse_llm_request
from cosyvoice_triton.triton.metrics import LLM_METRICS, ModelMetrics, instance_labels
from cosyvoice_triton.triton.params import LLMParams, parse_parameters
from cosyvoice_triton.triton.tensors import TensorReader, error_response, request_arrays

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_CHECK_S = 0.5  # a stream still waiting for a slot looks at its client this often


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = args["model_name"]
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ValueError(f"{self.name} must be decoupled (model_transaction_policy)")
        self.params = params = parse_parameters(LLMParams, config, self.name)
        if params.torch_threads > 0:
            torch.set_num_threads(params.torch_threads)
        llm = SpeechLM.from_model_dir(params.model_dir, device=instance_device(params.device, args),
                                      max_batch=params.max_batch, max_seq_len=params.max_seq_len)
        if params.max_token_text_ratio is not None:
            llm.config.max_token_text_ratio = params.max_token_text_ratio
        self.default_sampling = llm.config.sampling
        self.engine = LLMEngine(llm, max_batch=params.max_batch, max_seq_len=params.max_seq_len,
                                max_queue=params.max_queue)
        self.metrics = ModelMetrics(pb_utils, LLM_METRICS, instance_labels(args))
        self._streams: dict[str, LLMStream] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        # One forwarding job per stream that holds a slot or waits for one; the engine refuses the rest.
        self._forwarders = ThreadPoolExecutor(max_workers=params.max_batch + params.max_queue,
                                              thread_name_prefix="llm-forward")
        self.engine.start()
        self._refresh()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                item = parse_llm_request(TensorReader(request_arrays(request)), self.default_sampling)
                if isinstance(item, StreamCancel):
                    self._cancel(item.stream_id)
                    sender.send(flags=FINAL)
                    continue
                with self._lock:
                    if item.request_id in self._streams:
                        raise InvalidInput("stream_id", f"{item.request_id!r} is already streaming")
                    stream = self.engine.submit(item)
                    self._streams[item.request_id] = stream
                self._forwarders.submit(self._forward, stream, sender)
            except Exception as exc:  # noqa: BLE001 - answered to this request only
                sender.send(error_response(pb_utils, exc, self.name), flags=FINAL)
        self._refresh()
        return None

    def _cancel(self, stream_id: str) -> None:
        with self._lock:
            stream = self._streams.get(stream_id)
        if stream is not None:
            stream.cancel()

    def _forward(self, stream: LLMStream, sender) -> None:
        """Send the stream's tokens as they come; end with exactly one final flag."""
        error = None
        try:
            while True:
                try:
                    tokens = stream.get(timeout=CANCEL_CHECK_S)
                except TimeoutError:
                    tokens = []
                if tokens is None:
                    break
                if sender.is_cancelled() or self._stopping.is_set():
                    stream.cancel()  # the engine ends the stream at its next round; keep draining
                    continue
                if tokens:
                    sender.send(pb_utils.InferenceResponse(
                        output_tensors=[pb_utils.Tensor("speech_tokens", np.asarray(tokens, dtype=np.int32))]))
                    self._refresh()
        except Exception as exc:  # noqa: BLE001 - the stream's error (LLMStepError, EngineUnavailable)
            error = exc
        finally:
            with self._lock:
                self._streams.pop(stream.request.request_id, None)
            try:
                if error is None:
                    sender.send(flags=FINAL)
                else:
                    sender.send(error_response(pb_utils, error, self.name), flags=FINAL)
            except Exception as exc:  # noqa: BLE001 - e.g. the client has gone
                pb_utils.Logger.log_warn(f"{self.name}: final response of {stream.request.request_id} not sent: {exc}")
            self.metrics.labelled("ended", stream.reason or "error").increment(1)
            self._refresh()

    def _refresh(self) -> None:
        def read():
            stats = self.engine.stats
            return {"active": stats.active_streams, "queued": stats.queued, "free_slots": stats.slots_free,
                    "batch": stats.last_batch_size, "tps": stats.tokens_per_s}

        self.metrics.set_gauges(read)

    def finalize(self):
        self._stopping.set()
        self.engine.stop()  # fails every open stream, so each forwarding job ends
        self._forwarders.shutdown(wait=True)

