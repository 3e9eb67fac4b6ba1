"""`register_voice`: reference recording -> prompt features (prompt_encoder, BLS) -> voice store.

The store is asked first, by content key (audio hash + transcript + owner, `voice_store.register_once`):
a recording already registered with the same transcript by the same owner returns its voice without
running the prompt encoder again. A transcript that would leave an LLM stream no room for a sentence is
refused first (`prompt_budget`, with the llm's `max_seq_len`).
"""
from __future__ import annotations

# First: what this model computes runs below the stub's health thread (cosyvoice_triton/triton/stub_priority.py).
from cosyvoice_triton.triton.stub_priority import yield_to_stub_health

yield_to_stub_health()

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from cosyvoice_triton.family import family_of
from cosyvoice_triton.voices.stores import open_voice_store
from cosyvoice_triton.triton.bls import BlsPromptEncoder
from cosyvoice_triton.wire.outputs import RegisterOutputs
from cosyvoice_triton.wire.requests import parse_register_inputs
from cosyvoice_triton.triton.params import RegisterVoiceParams, parse_parameters
from cosyvoice_triton.triton.service import Voices, prompt_budget, token_mel_ratio
from cosyvoice_triton.wire.tensors import TensorReader
from cosyvoice_triton.triton.pb_glue import request_arrays, respond_each


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]
        params = parse_parameters(RegisterVoiceParams, json.loads(args["model_config"]), self.name)
        encoder = BlsPromptEncoder(pb_utils, params.prompt_encoder_model, token_mel_ratio(params.model_dir))
        self.voices = Voices(open_voice_store(params.voice_store), encoder,
                             prompt_budget(params.model_dir, params.max_seq_len), family=family_of(params.model_dir).name)

    def execute(self, requests):
        return respond_each(pb_utils, requests, self.name, self.outputs)

    def outputs(self, request) -> dict[str, np.ndarray]:
        info = self.voices.register(parse_register_inputs(TensorReader(request_arrays(request))))
        return RegisterOutputs(info.voice_id, info.audio_sha256, info.tokens).tensors()

    def finalize(self):
        self.voices.store.close()
