"""`token2wav`: the chunk requests of one dynamic batch run through `Token2WavScheduler.run` as one flow batch
(tensors: wire/stage_tensors.py). Per-stream state lives in the scheduler, keyed by `stream_id`, and is freed
on the final chunk, on a `cancel` request and after `idle_timeout_s` without chunks, counted on the
scheduler's quiet clock from the latest chunk's answer (its idle rule; checked on every batch, and by an
`IdleSweeper` timer while no chunks come).

Metrics are updated only inside `execute`, on the stub's main thread: metric IPC from a background
thread of this model was once suspected of a rare tritonserver crash (boost::interprocess::lock_exception in
the Python backend; its cause turned out to be the backend's stub health check, docs/operations/faults.md).
So when the idle sweeper frees streams it only changes the scheduler, then sends this
model a no-op request (a cancel of a stream id that no client uses, over BLS, the path that decoupled
models use from their worker threads all the time) so that an execute publishes the frees at once,
even on a server that gets no other traffic.

Flow and HiFT come from `build_token2wav` with the `engine`, `precision` and `onnx_dir` parameters
(ONNX graphs exported on first use; a fallback is one warning line in Triton's log).
"""
from __future__ import annotations

# First: what this model computes runs below the stub's health thread (cosyvoice_triton/triton/stub_priority.py).
from cosyvoice_triton.triton.stub_priority import yield_to_stub_health

yield_to_stub_health()

import json
import secrets
import threading

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from cosyvoice_triton.engines.select import build_token2wav
from cosyvoice_triton.engines.cuda_graphs import capture_estimator_steps, use_cuda_graphs
from cosyvoice_triton.models.compiled import apply_compile
from cosyvoice_triton.models.family import models_of_flow
from cosyvoice_triton.models.flow_cache import FlowCacheSettings
from cosyvoice_triton.token2wav.idle_sweeper import IdleSweeper
from cosyvoice_triton.pipeline.chunk_policy import CHUNK_PRESETS
from cosyvoice_triton.pipeline.threads import RowWorkers, chunk_unit, thread_plan
from cosyvoice_triton.token2wav.scheduler import Token2WavScheduler
from cosyvoice_triton.triton import instance_device, open_core_share
from cosyvoice_triton.triton.bls import bls_request
from cosyvoice_triton.triton.finite import check_chunk_finite
from cosyvoice_triton.wire.names import TOKEN2WAV_OUTPUTS
from cosyvoice_triton.wire.stage_tensors import StreamCancel, parse_chunk, token2wav_cancel_inputs
from cosyvoice_triton.wire.outputs import waveform_outputs
from cosyvoice_triton.triton.logs import library_logs_to_triton
from cosyvoice_triton.triton.metrics import TOKEN2WAV_METRICS, ModelMetrics, instance_labels
from cosyvoice_triton.triton.params import Token2WavParams, parse_parameters
from cosyvoice_triton.wire.tensors import TensorReader
from cosyvoice_triton.triton.pb_glue import error_response, output_tensors, request_arrays


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = args["model_name"]
        self.params = params = parse_parameters(Token2WavParams, config, self.name)
        if int(config.get("max_batch_size", 0)) != params.max_batch:
            raise ValueError(f"{self.name}: max_batch_size {config.get('max_batch_size')} != max_batch "
                             f"{params.max_batch}")
        device = instance_device(params.device, args)
        # Each call takes its threads from the server's core share (a first chunk runs alone on every
        # core), or a fixed share beside the LLM's. Set before the runners: ONNX Runtime takes as many.
        self.cores = open_core_share(params.core_share, params.torch_threads, device)
        torch.set_num_threads(params.torch_threads or thread_plan().token2wav)
        with library_logs_to_triton(pb_utils, self.name):
            # TensorRT profile: up to max_batch chunks (2 * max_batch estimator rows) per flow call.
            flow, hift = build_token2wav(params.model_dir, params.engine, device, precision=params.precision,
                                         onnx_dir=params.onnx_dir, max_streams=params.max_batch,
                                         ort_providers=params.ort_providers, flow_precision=params.flow_precision)
            compiled = apply_compile(params.compile, device, flow=flow, hift=hift)  # torch modules only
            # The torch estimator's step from CUDA graphs per (rows, frames) bucket, captured on first use.
            graphs = use_cuda_graphs(params.cuda_graphs, device) and capture_estimator_steps(flow, params.max_batch)
            pb_utils.Logger.log_info(f"{self.name}: compiled: {', '.join(compiled) or 'none'} "
                                     f"(compile {params.compile}); CUDA graphs: "
                                     f"{'the estimator step (no flow cache)' if graphs else 'off'}")
        preset = CHUNK_PRESETS[params.chunk_preset]
        self.scheduler = Token2WavScheduler(flow, hift, max_streams=params.max_streams, max_batch=params.max_batch,
                                      idle_timeout_s=params.idle_timeout_s,
                                      # flow_cache_frames None: the family's default (models/family.py)
                                      flow_cache=FlowCacheSettings(enabled=params.flow_cache_frames is None
                                                                   or params.flow_cache_frames > 0,
                                                                   max_frames=params.flow_cache_frames,
                                                                   prompt_cache_mb=params.prompt_cache_mb,
                                                                   cached_final=preset.cached_final),
                                      # The flow's rows over the cores the share leaves token2wav at each step.
                                      map_rows=RowWorkers(self.cores).map if self.cores is not None else None)
        self.metrics = ModelMetrics(pb_utils, TOKEN2WAV_METRICS, instance_labels(args))
        # The torch estimator's own precision; a graph engine's is its plan's (`precision`).
        flow_precision = flow.decoder.precision if models_of_flow(flow).supports_cache(flow) or graphs \
            else params.precision
        self.metrics.labelled("precision", flow_precision).set(1)
        self._lock = threading.Lock()  # the scheduler has one caller at a time: execute or the idle sweeper
        # The idle sweeper's no-op request: a cancel of this id (random, so no client stream can have it).
        self._tick_id = f"{self.name}-idle-sweep-{secrets.token_hex(8)}"
        self._sweeper = IdleSweeper(self.scheduler.sweep_idle, self._publish_frees,
                                    interval_s=max(1.0, params.idle_timeout_s / 4), lock=self._lock,
                                    name="token2wav-idle")
        self._sweeper.start()
        self._refresh()  # still in initialize: the main thread

    def execute(self, requests):
        responses = [None] * len(requests)
        chunks, chunk_index = [], []
        with self._lock:
            ticks = 0
            for i, request in enumerate(requests):
                try:
                    item = check_chunk_finite(parse_chunk(TensorReader(request_arrays(request), batched=True)))
                except Exception as exc:  # noqa: BLE001 - answered to this request only
                    responses[i] = error_response(pb_utils, exc, self.name)
                    continue
                if isinstance(item, StreamCancel):
                    if item.stream_id == self._tick_id:
                        ticks += 1
                    else:
                        self.scheduler.cancel(item.stream_id)
                    responses[i] = self._waveform(np.zeros(0, dtype=np.float32))
                else:
                    chunks.append(item)
                    chunk_index.append(i)
            if len(requests) > ticks:  # the idle sweeper's own requests are not client traffic
                self.metrics["batch"].observe(len(requests) - ticks)
            if chunks:
                for i, result in zip(chunk_index, self._run(chunks)):
                    if isinstance(result, Exception):
                        responses[i] = error_response(pb_utils, result, self.name)
                    else:
                        responses[i] = self._waveform(result)
            self._refresh()
        return responses

    def _run(self, chunks: list) -> list:
        """One flow batch, as one token2wav unit of the core share when there is one."""
        if self.cores is None:
            return self.scheduler.run(chunks)
        threads, alone = chunk_unit(self.cores.plan, chunks)
        with self.cores.running("token2wav", threads, alone=alone):
            return self.scheduler.run(chunks)

    @staticmethod
    def _waveform(audio: np.ndarray):
        waveform = waveform_outputs(audio, batched=True)  # (batch 1, N)
        return pb_utils.InferenceResponse(output_tensors=output_tensors(pb_utils, waveform))

    def _publish_frees(self) -> None:
        """The sweeper's wake: have Triton run an execute (which refreshes the metrics), by a no-op
        request to this model. Never touches metrics itself (see the module docstring)."""
        try:
            response = bls_request(pb_utils, self.name, token2wav_cancel_inputs(self._tick_id),
                                   TOKEN2WAV_OUTPUTS).exec()
            if response.has_error():
                raise RuntimeError(response.error().message())
        except Exception as exc:  # noqa: BLE001 - e.g. the server is shutting down; the next execute refreshes
            pb_utils.Logger.log_warn(f"{self.name}: idle frees not yet in the metrics: {exc}")

    def _refresh(self) -> None:
        """Hold self._lock, on the main thread (execute or initialize)."""
        stats = self.scheduler.stats
        self.metrics.set_gauges(lambda: {"active": stats.active_streams, "flow_batch": stats.last_flow_batch})
        for reason, count in stats.freed.items():
            self.metrics.follow_counter("freed", count, reason)

    def finalize(self):
        self._sweeper.stop()
        if self.cores is not None:
            self.cores.close()
