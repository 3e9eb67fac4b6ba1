"""`register_voice`: reference recording -> prompt features (prompt_encoder, BLS) -> voice store."""
from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from cosyvoice_triton.runtime.voice_store import open_voice_store
from cosyvoice_triton.triton.bls import BlsPromptEncoder
from cosyvoice_triton.triton.contracts import parse_register_inputs
from cosyvoice_triton.triton.params import RegisterVoiceParams, parse_parameters
from cosyvoice_triton.triton.service import Voices, token_mel_ratio
from cosyvoice_triton.triton.tensors import TensorReader, error_response, request_arrays, string_array


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]
        params = parse_parameters(RegisterVoiceParams, json.loads(args["model_config"]), self.name)
        encoder = BlsPromptEncoder(pb_utils, params.prompt_encoder_model, token_mel_ratio(params.model_dir))
        self.voices = Voices(open_voice_store(params.voice_store), encoder)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                info = self.voices.register(parse_register_inputs(TensorReader(request_arrays(request))))
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("voice_id", string_array(info.voice_id)),
                    pb_utils.Tensor("audio_sha256", string_array(info.audio_sha256)),
                    pb_utils.Tensor("prompt_tokens", np.array([info.tokens], dtype=np.int32))]))
            except Exception as exc:  # noqa: BLE001 - answered to this request only
                responses.append(error_response(pb_utils, exc, self.name))
        return responses

    def finalize(self):
        self.voices.store.close()
