"""`cosyvoice2` (decoupled) and `cosyvoice2_offline` (its twin): text + voice -> 24 kHz audio.

Tensors in -> `SynthesisInputs` -> `SynthesisService` (voice from the store or prompt_encoder, then the
shared Orchestrator over BLS calls to llm and token2wav) -> `waveform` responses. The config's
transaction policy decides the mode: decoupled requests run in a bounded worker pool and stream their
chunks; the twin answers each request with its whole waveform from execute().
"""
from __future__ import annotations

import json
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from cosyvoice_triton.errors import Cancelled, Unavailable
from cosyvoice_triton.runtime.voice_store import open_voice_store
from cosyvoice_triton.triton.bls import BlsLLM, BlsPromptEncoder, BlsToken2Wav
from cosyvoice_triton.triton.contracts import parse_synthesis_inputs
from cosyvoice_triton.triton.metrics import SYNTHESIS, ModelMetrics, instance_labels
from cosyvoice_triton.triton.params import CosyVoice2Params, parse_parameters
from cosyvoice_triton.triton.service import SynthesisService, Voices, token_mel_ratio
from cosyvoice_triton.triton.streaming import RequestPool, send_chunks
from cosyvoice_triton.triton.tensors import TensorReader, error_response, request_arrays

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = args["model_name"]
        self.params = params = parse_parameters(CosyVoice2Params, config, self.name)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.store = open_voice_store(params.voice_store)
        voices = Voices(self.store, BlsPromptEncoder(pb_utils, params.prompt_encoder_model,
                                                     token_mel_ratio(params.model_dir)))
        self.service = SynthesisService(params.model_dir, voices, BlsLLM(pb_utils, params.llm_model),
                                        BlsToken2Wav(pb_utils, params.token2wav_model), params.max_text_chars)
        self.metrics = ModelMetrics(pb_utils, SYNTHESIS, instance_labels(args))
        self.pool = RequestPool(params.max_workers, params.max_pending, self.name) if self.decoupled else None

    def execute(self, requests):
        if self.decoupled:
            for request in requests:
                self._submit(request)
            return None
        return [self._whole(request) for request in requests]

    # ---- decoupled: stream chunks from a worker thread --------------------------------------------

    def _submit(self, request) -> None:
        received = time.monotonic()
        sender = request.get_response_sender()
        try:
            inputs = self._parse(request)
        except Exception as exc:  # noqa: BLE001 - answered to this request only
            self.metrics.labelled("requests", "error").increment(1)
            sender.send(error_response(pb_utils, exc, self.name), flags=FINAL)
            return
        request_id = _request_id(request)

        def job() -> None:
            send_chunks(pb_utils, sender, lambda: self.service.run(inputs, True, cancelled, request_id),
                        model=self.name, received_at=received, metrics=self.metrics, is_cancelled=cancelled)
            self._follow_store()

        def cancelled() -> bool:
            return sender.is_cancelled() or self.pool.stopping.is_set()

        if not self.pool.try_submit(job):
            busy = Unavailable(f"{self.name} is busy: {self.params.max_workers} requests running and "
                               f"{self.params.max_pending} waiting")
            self.metrics.labelled("requests", "error").increment(1)
            sender.send(error_response(pb_utils, busy, self.name), flags=FINAL)

    # ---- not decoupled: the whole waveform in one response ----------------------------------------

    def _whole(self, request):
        received = time.monotonic()
        outcome = "ok"
        self.metrics["active"].increment(1)
        try:
            inputs = self._parse(request)
            chunks = []
            for chunk in self.service.run(inputs, False, request.is_cancelled, _request_id(request)):
                if chunk.size and not chunks:
                    self.metrics["first_chunk"].observe(time.monotonic() - received)
                chunks.append(np.asarray(chunk, dtype=np.float32).reshape(-1))
            waveform = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
            return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("waveform", waveform)])
        except Exception as exc:  # noqa: BLE001 - answered to this request only
            outcome = "cancelled" if isinstance(exc, Cancelled) else "error"
            return error_response(pb_utils, exc, self.name)
        finally:
            self.metrics["active"].increment(-1)
            self.metrics.labelled("requests", outcome).increment(1)
            self._follow_store()

    # ---- shared ------------------------------------------------------------------------------------

    def _parse(self, request):
        reader = TensorReader(request_arrays(request))
        return parse_synthesis_inputs(reader, self.service.default_sampling, self.params.max_text_chars)

    def _follow_store(self) -> None:
        stats = self.store.stats
        self.metrics.follow_counter("voice_hits", stats.hits)
        self.metrics.follow_counter("voice_misses", stats.misses)
        self.metrics.follow_counter("voice_loads", stats.loads)

    def finalize(self):
        if self.pool is not None:
            self.pool.close()
        self.store.close()


def _request_id(request) -> str:
    """The client's request id when it gave one (made unique), for logs and stream ids."""
    given = request.request_id() or ""
    return f"{given[:40]}-{uuid.uuid4().hex[:12]}" if given else uuid.uuid4().hex
