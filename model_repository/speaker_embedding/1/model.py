"""`speaker_embedding` (prompt_encoder step 2a): CAM++ embedding (192,) of 16 kHz audio, on the
`engine` and `device` of its parameters (`open_campplus`; a fallback is one warning line in Triton's log)."""
from __future__ import annotations

# First: what this model computes runs below the stub's health thread (cosyvoice_triton/triton/stub_priority.py).
from cosyvoice_triton.triton.stub_priority import yield_to_stub_health

yield_to_stub_health()

import json
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from cosyvoice_triton.engines.select import open_campplus
from cosyvoice_triton.preprocess.prompt import PromptEncoder
from cosyvoice_triton.wire.names import WAV16K
from cosyvoice_triton.wire.stage_tensors import embedding_outputs, read_wav16k
from cosyvoice_triton.triton.finite import check_finite
from cosyvoice_triton.triton.logs import library_logs_to_triton
from cosyvoice_triton.triton.params import SpeakerEmbeddingParams, parse_parameters
from cosyvoice_triton.wire.tensors import TensorReader
from cosyvoice_triton.triton.pb_glue import request_arrays, respond_each


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]
        params = parse_parameters(SpeakerEmbeddingParams, json.loads(args["model_config"]), self.name)
        # One thread per instance (fbank in torch, CAM++ in ONNX Runtime, which takes torch's count):
        # scale with instances, as the other ONNX Runtime steps do.
        torch.set_num_threads(1)
        onnx_dir = Path(params.onnx_dir) if params.onnx_dir else Path(params.model_dir) / "onnx"
        with library_logs_to_triton(pb_utils, self.name):
            runner = open_campplus(params.model_dir, params.engine, params.device, cache_dir=onnx_dir / "trt",
                                   ort_providers=params.ort_providers)
        self.encoder = PromptEncoder(campplus=runner, speech_tokenizer=None)  # only .speaker_embedding

    def execute(self, requests):
        return respond_each(pb_utils, requests, self.name, self.outputs)

    def outputs(self, request) -> dict[str, np.ndarray]:
        wav16k = check_finite(WAV16K, read_wav16k(TensorReader(request_arrays(request), batched=True)))
        return embedding_outputs(self.encoder.speaker_embedding(wav16k))
