"""What the Triton model files in `model_repository/` import, and nothing else: each `model.py` stays an
adapter (tensors in, a call into the library, responses out). `pb_utils` is never imported here; functions
that need it take it as `pb`, so all of this runs under the fake `pb_utils` of tests/pb_fake.py. What the
gateway and the SDK share with the models is the wire package (`cosyvoice_triton.wire`), not this one.

pb_glue           a request's tensors, BLS answers, responses; errors as TritonErrors
params            config.pbtxt `parameters` -> frozen dataclasses
decoupled         decoupled requests in a bounded worker pool (admission); chunks out with one final flag
service           cosyvoice2 and register_voice: voice resolution (store or prompt_encoder), the pipeline
vc_service        cosyvoice2's mode vc: voice conversion over the audio_tokenizer and token2wav
bls               BLS stages: token2wav, the prompt encoder, the llm (fallback), a BLS request
grpc_llm          the llm stage over the server's own gRPC endpoint (why not BLS: its docstring)
remote_token2wav  the token2wav stage on backend servers (split deployment)
llm_streams       the llm model's loop: scheduler streams forwarded to their clients
metrics           custom metric families
finite            NaN / Inf checks of floating-point inputs
logs              the library's log records into Triton's log
stub_priority     called first in each model.py: the model's threads below the stub's health thread
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
