"""Library side of the Triton models in `model_repository/`: everything a `model.py` needs that can
live outside it. `pb_utils` is never imported here; functions that need it take it as `pb`, so
all of this is unit-testable with the fake `pb_utils` in tests/pb_fake.py.

contracts  the tensor contracts between models (module docstring), with builders and parsers
tensors    typed reading of request tensors (errors name the input), errors as TritonErrors
params     config.pbtxt `parameters` -> frozen dataclasses
bls        BLS clients: the pipeline's LLM and token2wav backends, the prompt encoder
service    voice resolution (store or prompt_encoder) and the synthesis service of `cosyvoice2`
streaming  decoupled requests in a bounded worker pool; chunks out with one final flag
metrics    custom metric families
stub_priority  called first in each model.py: the model's threads below the stub's health thread
"""
from __future__ import annotations

from cosyvoice_triton.pipeline.shared_cores import SharedCoreShare
from cosyvoice_triton.pipeline.threads import thread_plan


def instance_device(device: str, args: dict) -> str:
    """The torch device of this model instance: `cuda` becomes `cuda:<instance device id>` for a
    KIND_GPU instance; anything else is used as given."""
    if device == "cuda" and args.get("model_instance_kind") == "GPU":
        return f"cuda:{args.get('model_instance_device_id', '0')}"
    return device


def open_core_share(path: str | None, torch_threads: int, device: str) -> SharedCoreShare | None:
    """This server's core share for a CPU model (pipeline/shared_cores.py); None where the model keeps a
    fixed share: no share file named, a thread count given (`--torch-threads`), or not on the CPU."""
    if not path or torch_threads or device != "cpu":
        return None
    return SharedCoreShare(path, thread_plan())
