"""The `llm` model of a benchmark server: the served `llm` model, its streams exactly N speech tokens long.

perf/exact_length.py renders this file as `llm/1/model.py` of a run's templates, with the served model file
beside it as `served_model.py` and the parameter `exact_speech_tokens` (N) added to `llm/config.pbtxt`.
It runs the served model's `initialize` on the config without that parameter (the served model knows no
such parameter), then makes the scheduler's LLM exact-length; requests, streams and metrics are the served
model's own. Private (a leading underscore): it imports only inside a Triton model repository.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils

from cosyvoice_triton.perf.exact_length import PARAMETER, SERVED_MODEL, exact_length


def _served_model():
    """The served llm model file beside this one, as a module."""
    path = Path(__file__).with_name(SERVED_MODEL)
    spec = importlib.util.spec_from_file_location("served_llm_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class TritonPythonModel(_served_model().TritonPythonModel):
    def initialize(self, args):
        config = json.loads(args["model_config"])
        n = int(config["parameters"].pop(PARAMETER)["string_value"])
        super().initialize({**args, "model_config": json.dumps(config)})
        exact_length(self.scheduler.llm, n)
        pb_utils.Logger.log_info(f"{self.name}: exactly {n} speech tokens per stream, stop tokens masked "
                                 f"(benchmark overlay, perf/exact_length.py)")
