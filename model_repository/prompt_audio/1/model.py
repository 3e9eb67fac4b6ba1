"""`prompt_audio` (prompt_encoder step 1): check the recording, resample to 16 kHz, compute the prompt mel.

The same functions as `PromptEncoder.encode`, so the ensemble's features equal the library's.
"""
from __future__ import annotations

# First: what this model computes runs below the stub's health thread (cosyvoice_triton/triton/stub_priority.py).
from cosyvoice_triton.triton.stub_priority import yield_to_stub_health

yield_to_stub_health()

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from cosyvoice_triton.config import ModelPaths, read_yaml
from cosyvoice_triton.preprocess.audio import resample, validate_prompt_audio
from cosyvoice_triton.preprocess.features import MelConfig, prompt_mel
from cosyvoice_triton.preprocess.prompt import SPEAKER_RATE
from cosyvoice_triton.wire.names import REFERENCE_WAV
from cosyvoice_triton.wire.stage_tensors import prompt_audio_outputs, read_prompt_audio_batch
from cosyvoice_triton.triton.params import PromptStepParams, parse_parameters
from cosyvoice_triton.wire.tensors import TensorReader
from cosyvoice_triton.triton.pb_glue import request_arrays, respond_each


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]
        params = parse_parameters(PromptStepParams, json.loads(args["model_config"]), self.name)
        self.mel_config = MelConfig.from_yaml(read_yaml(ModelPaths(Path(params.model_dir)).yaml))

    def execute(self, requests):
        return respond_each(pb_utils, requests, self.name, self.outputs)

    def outputs(self, request) -> dict[str, np.ndarray]:
        samples, rate = read_prompt_audio_batch(TensorReader(request_arrays(request), batched=True))
        validate_prompt_audio(samples, rate, REFERENCE_WAV)
        wav16k = resample(samples, rate, SPEAKER_RATE)
        mel = prompt_mel(resample(samples, rate, self.mel_config.sampling_rate), self.mel_config).numpy()
        return prompt_audio_outputs(wav16k, mel)
