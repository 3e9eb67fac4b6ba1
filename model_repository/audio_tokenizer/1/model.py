"""`audio_tokenizer` (prompt_encoder step 2b): S3 speech tokens (25 Hz) of 16 kHz audio."""
from __future__ import annotations

# First: what this model computes runs below the stub's health thread (cosyvoice_triton/triton/stub_priority.py).
from cosyvoice_triton.triton.stub_priority import yield_to_stub_health

yield_to_stub_health()

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from cosyvoice_triton.config import ModelPaths
from cosyvoice_triton.engines.onnx_session import open_session
from cosyvoice_triton.preprocess.prompt import PromptEncoder
from cosyvoice_triton.wire.names import WAV16K
from cosyvoice_triton.wire.stage_tensors import read_wav16k, speech_tokens_outputs
from cosyvoice_triton.triton.finite import check_finite
from cosyvoice_triton.triton.params import PromptStepParams, parse_parameters
from cosyvoice_triton.wire.tensors import TensorReader
from cosyvoice_triton.triton.pb_glue import request_arrays, respond_each


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]
        params = parse_parameters(PromptStepParams, json.loads(args["model_config"]), self.name)
        session = open_session(ModelPaths(Path(params.model_dir)).speech_tokenizer, device=params.device)
        self.encoder = PromptEncoder(campplus=None, speech_tokenizer=session)  # only .speech_tokens

    def execute(self, requests):
        return respond_each(pb_utils, requests, self.name, self.outputs)

    def outputs(self, request) -> dict[str, np.ndarray]:
        wav16k = check_finite(WAV16K, read_wav16k(TensorReader(request_arrays(request), batched=True)))
        return speech_tokens_outputs(self.encoder.speech_tokens(wav16k), batched=True)
