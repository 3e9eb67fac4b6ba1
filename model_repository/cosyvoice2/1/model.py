"""`cosyvoice2` (decoupled) and `cosyvoice2_offline` (its twin): text + voice -> 24 kHz audio. Rendered twice
more as `cosyvoice2_official` and `cosyvoice2_official_offline`: parameter tensor_form "official" (the official
runtime's tensors, each [1, ...]), turned into ours by `from_official_form` before the same parse. On a CosyVoice3
folder the same four are named cosyvoice3, cosyvoice3_offline, cosyvoice3_official, cosyvoice3_official_offline.

Tensors in -> `SynthesisInputs` -> `ServedPipeline` (voice from the store or prompt_encoder, then the
shared Pipeline over BLS calls to llm and token2wav) -> `waveform` responses. execute() only parses:
each request runs in a bounded worker pool and answers through its response sender. The config's
transaction policy decides the mode: decoupled requests stream their chunks; the twin sends the whole
waveform in one final response (python_backend allows a response sender in non-decoupled models).
Mode "vc" (voice conversion: a source recording, no text) runs `ConversionService` instead (triton/vc_service.py).
"""
from __future__ import annotations

# First: what this model computes runs below the stub's health thread (cosyvoice_triton/triton/stub_priority.py).
from cosyvoice_triton.triton.stub_priority import yield_to_stub_health

yield_to_stub_health()

import json
import time
import uuid

import triton_python_backend_utils as pb_utils

from cosyvoice_triton.admission import AdmissionPolicy, refusal, request_cost, text_tokens_estimate
from cosyvoice_triton.errors import InvalidInput, NotFound, Unavailable
from cosyvoice_triton.family import family_of
from cosyvoice_triton.pipeline.capacity import Capacity
from cosyvoice_triton.pipeline.chunk_policy import CHUNK_PRESETS
from cosyvoice_triton.voices.stores import open_voice_store
from cosyvoice_triton.triton.bls import BlsPromptEncoder, BlsToken2Wav
from cosyvoice_triton.triton.grpc_llm import served_llm
from cosyvoice_triton.wire.official import OFFICIAL_FORM, from_official_form
from cosyvoice_triton.wire.names import TEXT_MODE
from cosyvoice_triton.wire.requests import ConversionInputs, SynthesisInputs, TextAppend, parse_cosyvoice2_request
from cosyvoice_triton.triton.vc_service import BlsAudioTokenizer, ConversionService
from cosyvoice_triton.triton.metrics import REMOTE_TOKEN2WAV, SYNTHESIS, ModelMetrics, instance_labels
from cosyvoice_triton.triton.params import CosyVoice2Params, check_family, parse_parameters
from cosyvoice_triton.triton.remote_token2wav import RemoteToken2Wav
from cosyvoice_triton.triton.service import ServedPipeline, Voices, prompt_budget, token_mel_ratio
from cosyvoice_triton.triton.decoupled import RequestPool, send_chunks, send_whole
from cosyvoice_triton.wire.tensors import TensorReader
from cosyvoice_triton.triton.pb_glue import error_response, request_arrays

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = args["model_name"]
        self.params = params = parse_parameters(CosyVoice2Params, config, self.name)
        check_family(params, self.name)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.official = params.tensor_form == OFFICIAL_FORM  # every tensor [1, ...], waveform [1, n]
        self.instances = sum(int(group.get("count", 1)) for group in config.get("instance_group", [])) or 1
        self.store = open_voice_store(params.voice_store)
        voices = Voices(self.store, BlsPromptEncoder(pb_utils, params.prompt_encoder_model,
                                                     token_mel_ratio(params.model_dir)),
                        prompt_budget(params.model_dir, params.max_seq_len), family=family_of(params.model_dir).name)
        # Split deployment: token2wav on the backend servers named in the config; else this server's own.
        self.token2wav = RemoteToken2Wav.from_specs(params.token2wav_backends, params.token2wav_model,
                                                    params.token2wav_timeout_s) \
            if params.token2wav_backends else BlsToken2Wav(pb_utils, params.token2wav_model)
        self.llm = served_llm(pb_utils, params.llm_model)  # gRPC to this server, not BLS: triton/grpc_llm.py
        self.service = ServedPipeline(params.model_dir, voices, self.llm,
                                      self.token2wav, params.max_text_chars, CHUNK_PRESETS[params.chunk_preset].policy(params.chunk_policy))
        self.conversion = ConversionService(voices, BlsAudioTokenizer(pb_utils), self.token2wav,
                                            CHUNK_PRESETS[params.chunk_preset].policy(params.chunk_policy))
        self.metrics = ModelMetrics(pb_utils, SYNTHESIS, instance_labels(args))
        self.remote_metrics = None
        if isinstance(self.token2wav, RemoteToken2Wav):  # a split frontend: its view of the backends
            self.remote_metrics = ModelMetrics(pb_utils, REMOTE_TOKEN2WAV, instance_labels(args))
            self.token2wav.on_change = self._follow_backends
            self._follow_backends()
        # Streams are admitted in real-time units (pipeline/capacity.py); the twin keeps cost-based admission.
        self.capacity = Capacity(params.realtime_margin, params.realtime_capacity or None) if self.decoupled else None
        self.pool = RequestPool(params.max_workers, params.max_pending, self.name,
                                AdmissionPolicy(params.max_queue_wait_s), self.capacity)
        self.metrics["slots"].set(params.max_workers)
        self._follow_pool()  # the capacity's cold default is there before the first request

    def execute(self, requests):
        for request in requests:
            self._submit(request)
        return None

    def _submit(self, request) -> None:
        """Parse here; synthesize in a worker thread, which answers through the response sender:
        chunk by chunk (decoupled) or with the whole waveform in one final response (the twin)."""
        received = time.monotonic()
        sender = request.get_response_sender()
        try:
            inputs = self._parse(request)
        except Exception as exc:  # noqa: BLE001 - answered to this request only
            self.metrics.labelled("requests", "error").increment(1)
            sender.send(error_response(pb_utils, exc, self.name), flags=FINAL)
            return
        if isinstance(inputs, TextAppend):  # bistream: a text piece for a synthesis of this instance
            self.service.append_text(inputs)
            sender.send(flags=FINAL)
            return
        stream_id = _request_id(request)

        def cancelled() -> bool:
            return sender.is_cancelled() or self.pool.stopping.is_set()

        def job() -> None:
            self.metrics["queue_wait"].observe(time.monotonic() - received)
            self._follow_pool()
            send = send_chunks if self.decoupled else send_whole
            send(pb_utils, sender, lambda: self._chunks(inputs, cancelled, stream_id),
                 model=self.name, received_at=received, metrics=self.metrics, is_cancelled=cancelled,
                 batched=self.official, audible_threshold_dbfs=self.params.audible_threshold_dbfs,
                 on_end=self.pool.finish)  # the slot is free before the client hears the end
            self._follow_pool()
            self._follow_backends()

        def expired(error: Unavailable) -> None:  # waited max_queue_wait_s without a worker: never started
            self._refuse(sender, error)

        cost = request_cost(text_tokens_estimate(inputs.text), 0, inputs.audio is not None)
        decision = self.pool.admit(job, cost, expired, cancelled)
        if not decision.admit:
            self._refuse(sender, refusal(self.name, decision, self.params.max_queue_wait_s))
        self._follow_pool()

    def _refuse(self, sender, error: Unavailable) -> None:
        """Admission said no (cosyvoice_triton/admission.py): UNAVAILABLE with its retry hint."""
        self.metrics.labelled("requests", "error").increment(1)
        sender.send(error_response(pb_utils, error, self.name), flags=FINAL)
        self._follow_pool()

    # ---- helpers -----------------------------------------------------------------------------------

    def _parse(self, request):
        """The request as typed, checked values (wire/requests.py): a synthesis, a conversion or a text piece."""
        arrays = request_arrays(request)
        if self.official:
            arrays = from_official_form(arrays, self._has_voice)
        inputs = parse_cosyvoice2_request(TensorReader(arrays), self.params.max_text_chars, self.service.chunk_policy)
        bistream = isinstance(inputs, SynthesisInputs) and inputs.bistream
        if bistream and (not self.decoupled or self.instances > 1):  # the appends must reach the instance that reads them
            raise InvalidInput(TEXT_MODE, f"bistream needs a streaming model of one instance ({self.name} is "
                                            f"{'decoupled' if self.decoupled else 'not decoupled'}, "
                                            f"{self.instances} instances)")
        return inputs

    def _has_voice(self, voice_id: str) -> bool:
        """Whether the store holds `voice_id` (the official form's request without a voice means `default`)."""
        try:
            self.store.info(voice_id)
        except NotFound:
            return False
        return True

    def _chunks(self, inputs, cancelled, stream_id: str):
        """The request's chunks: a stream's counted by the capacity meter and heard by its listener; the voice
        store's counters followed before the final response, so a client with its answer reads them counted."""
        try:
            chunks = self._service_of(inputs).run(inputs, self.decoupled, cancelled, stream_id)
            yield from (chunks if self.capacity is None else self.capacity.watch(chunks))
        finally:
            self._follow_store()

    def _follow_pool(self) -> None:
        pool, capacity = self.pool, self.capacity
        self.metrics.set_gauges(lambda: {"queued": pool.waiting, "seconds_per_cost": pool.speed.seconds_per_cost,
                                         **({} if capacity is None else {
                                             "capacity": capacity.estimate(), "measured": float(capacity.measured),
                                             "realtime_slots": capacity.slots(pool.max_workers)})})
        self.metrics.follow_counter("refused", pool.refused)
        if capacity is not None:
            self.metrics.follow_counter("starved", capacity.starved)
            self.metrics.follow_counter("stall_seconds", capacity.stall_s)

    def _service_of(self, inputs):
        return self.conversion if isinstance(inputs, ConversionInputs) else self.service

    def _follow_store(self) -> None:
        stats = self.store.stats
        self.metrics.follow_counter("voice_hits", stats.hits)
        self.metrics.follow_counter("voice_misses", stats.misses)
        self.metrics.follow_counter("voice_loads", stats.loads)

    def _follow_backends(self) -> None:
        if self.remote_metrics is None:
            return
        stats = self.token2wav.stats()
        self.remote_metrics.set_gauges(lambda: {"backends": stats.backends, "healthy": stats.healthy,
                                                "streams": stats.open_streams})
        self.remote_metrics.follow_counter("failures", stats.failures)

    def finalize(self):
        self.pool.close()
        self.llm.close()
        self.store.close()
        if isinstance(self.token2wav, RemoteToken2Wav):
            self.token2wav.close()


def _request_id(request) -> str:
    """The client's request id when it gave one (made unique), for logs and stream ids."""
    given = request.request_id() or ""
    return f"{given[:40]}-{uuid.uuid4().hex[:12]}" if given else uuid.uuid4().hex
