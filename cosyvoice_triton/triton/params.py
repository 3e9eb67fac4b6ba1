"""`parameters` of each model's config.pbtxt, parsed once in `initialize()` into a frozen dataclass.

Triton hands them over as `{"key": {"string_value": "..."}}`. Every key a dataclass declares must be
present (the templates write them all, so a missing key is a template bug) and unknown keys are refused;
an empty string means "not set" only where a field says so (`| None`); a `Literal[...]` field takes one
of its values only.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from typing import Literal

from cosyvoice_triton.errors import ParameterError
from cosyvoice_triton.pipeline.audible import DEFAULT_THRESHOLD_DBFS


# As `cosyvoice_triton.engines.base.ENGINES` / `PRECISIONS` (a unit test keeps them equal).
Engine = Literal["torch", "onnxruntime", "openvino", "tensorrt"]
Precision = Literal["fp32", "fp16", "bf16"]
GraphEngine = Literal["onnxruntime", "openvino", "tensorrt"]  # for models that ship as ONNX only (CAM++)
LLMPrecision = Literal["fp32", "bf16", "int8", "int8-dynamic"]  # models.llm_precision.LLM_PRECISIONS
ChunkKind = Literal["fixed", "adaptive"]  # messages.CHUNK_POLICIES: the server's chunk policy
# models.compiled.COMPILE_SETTINGS and engines.cuda_graphs.CUDA_GRAPH_SETTINGS: auto decides by the device
OffAutoOn = Literal["off", "auto", "on"]
ChunkPresetName = Literal["official", "quick"]  # pipeline/chunk_policy.CHUNK_PRESETS
TensorForm = Literal["native", "official"]  # wire/official.TENSOR_FORMS: cosyvoice2's tensors, ours or the official's
FamilyName = Literal["cosyvoice2", "cosyvoice3"]  # family.FAMILIES' names (a unit test keeps them equal)


def parse_parameters(cls, model_config: dict | str, model: str = ""):
    """An instance of the frozen dataclass `cls` from a model config's `parameters`."""
    config = json.loads(model_config) if isinstance(model_config, str) else model_config
    raw = {key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()}
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise ParameterError(f"{model}: unknown parameters {', '.join(unknown)}")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            if f.default is not dataclasses.MISSING:
                values[f.name] = f.default
                continue
            raise ParameterError(f"{model}: parameter {f.name} is missing")
        values[f.name] = _convert(raw[f.name], hints[f.name], f"{model}: parameter {f.name}")
    return cls(**values)


def _convert(text: str, hint, where: str):
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)
    if optional:
        if text.strip() == "":
            return None
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        if text not in choices:
            raise ParameterError(f"{where}: {text!r} is not one of {', '.join(choices)}")
        return text
    try:
        if hint is bool:
            lowered = text.strip().lower()
            if lowered not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return lowered in ("true", "1")
        if hint is int:
            return int(text)
        if hint is float:
            return float(text)
        if hint is str:
            return text
    except ValueError:
        raise ParameterError(f"{where}: {text!r} is not a {hint.__name__}") from None
    raise ParameterError(f"{where}: unsupported type {hint}")


@dataclass(frozen=True)
class LLMParams:
    model_dir: str
    device: str  # "cpu", "cuda", "cuda:0"
    max_batch: int  # KV-cache slots: streams decoded together
    max_seq_len: int  # positions per stream (prompt + speech tokens)
    max_queue: int  # requests waiting for a slot; more are refused (UNAVAILABLE)
    max_token_text_ratio: float | None  # None: the model's own (20, as the official code)
    torch_threads: int  # 0: chosen from the core count (pipeline/threads.py)
    core_share: str | None  # the server's core-share file (pipeline/shared_cores.py); None: a fixed share
    precision: LLMPrecision  # of the backbone (models/llm_precision.py)
    compile: OffAutoOn = "off"  # torch.compile of the decoder layers (models/compiled.py)
    cuda_graphs: OffAutoOn = "auto"  # the decode step per slot-count bucket (engines/cuda_graphs.py)


@dataclass(frozen=True)
class Token2WavParams:
    model_dir: str
    device: str
    max_streams: int  # streams with state at once; more are refused (UNAVAILABLE)
    max_batch: int  # chunks per flow call (also the model's max_batch_size)
    idle_timeout_s: float  # a stream with no chunk for this long is freed
    flow_cache_frames: int | None  # torch flow: mel frames cached per stream (models/flow_cache.py); 0: no cache; None: the family's
    torch_threads: int
    core_share: str | None  # as LLMParams.core_share
    engine: Engine  # flow encoder, flow estimator and HiFT decode on this engine (engines/select.py)
    precision: Precision  # of TensorRT plans and OpenVINO's hint; torch and ONNX Runtime run fp32
    onnx_dir: str | None  # exported graphs (TensorRT plans in <onnx_dir>/trt); None: <model_dir>/onnx
    ort_providers: str | None  # onnxruntime's execution providers (engines/providers.py); None: CPU / CUDA
    prompt_cache_mb: float = 512.0  # torch flow: MB of voices' frames kept (models/prompt_cache.py); 0: off
    flow_precision: str = "fp32"  # torch flow estimator: fp32 | bf16 | int8-dynamic (models/flow.py); the launcher resolves auto
    chunk_preset: ChunkPresetName = "official"  # quick: the last chunk a cached streaming call (chunk_policy.py)
    compile: OffAutoOn = "off"  # torch.compile of the flow estimator's and HiFT's blocks (models/compiled.py)
    cuda_graphs: OffAutoOn = "auto"  # the torch estimator's step per (rows, frames) bucket (engines/cuda_graphs.py)


@dataclass(frozen=True)
class PromptStepParams:
    model_dir: str
    device: str  # onnxruntime: "cpu", "cuda" or "auto"


@dataclass(frozen=True)
class SpeakerEmbeddingParams:
    model_dir: str
    device: str  # "cpu", "cuda", "cuda:N"; a fallback ends on ONNX Runtime on the CPU
    engine: GraphEngine
    onnx_dir: str | None  # TensorRT plans go to <onnx_dir>/trt; None: <model_dir>/onnx
    ort_providers: str | None  # onnxruntime's execution providers (engines/providers.py); None: CPU / CUDA


@dataclass(frozen=True)
class CosyVoice2Params:
    model_dir: str
    voice_store: str | None  # sqlite path or redis:// url; None: the library's default file
    max_workers: int  # requests synthesized at once by this instance (decoupled)
    max_pending: int  # requests accepted beyond max_workers before UNAVAILABLE
    max_text_chars: int
    llm_model: str
    token2wav_model: str
    prompt_encoder_model: str
    # Split deployment: backend servers holding `token2wav_model`, as comma-separated
    # grpc://host:port[?metrics=URL]; None: this server's own token2wav, through BLS.
    token2wav_backends: str | None = None
    token2wav_timeout_s: float = 60.0  # longest wait for one remote token2wav chunk
    chunk_policy: ChunkKind = "fixed"  # requests that name none (pipeline/chunk_policy.py)
    chunk_preset: ChunkPresetName = "official"  # their schedule's defaults (pipeline/chunk_policy.py)
    max_seq_len: int = 4096  # the llm's positions per stream: longer prompts are refused (prompt_budget)
    # admission (cosyvoice_triton/admission.py): a request expected to wait longer to start is refused
    max_queue_wait_s: float = 2.0
    # streams (decoupled) in real-time units (pipeline/capacity.py): every running stream gets audio this many
    # times faster than real time, or a new one waits; 0: off (cost-based admission only)
    realtime_margin: float = 0.0
    realtime_capacity: float = 0.0  # audio seconds per second this instance makes; 0: measured
    # native: our tensors (max_batch_size 0); official: the official runtime's ([1, ...] each; wire/official.py)
    tensor_form: TensorForm = "native"
    # the family the model is named for (wire/names.FAMILY_MODELS); `check_family` holds model_dir to it
    family: FamilyName = "cosyvoice2"
    # first audible audio (pipeline/audible.py): a 10 ms window with an RMS above this many dBFS is heard
    audible_threshold_dbfs: float = DEFAULT_THRESHOLD_DBFS


@dataclass(frozen=True)
class RegisterVoiceParams:
    model_dir: str
    voice_store: str | None
    prompt_encoder_model: str
    max_seq_len: int = 4096  # the llm's positions per stream: longer transcripts are refused (prompt_budget)


def check_family(params: CosyVoice2Params, model: str) -> None:
    """ParameterError when `params.model_dir` is not a folder of the family the model is named for (a repository
    rendered by hand with another folder): a model called cosyvoice3 serves CosyVoice3 and nothing else."""
    from cosyvoice_triton.family import family_of

    found = family_of(params.model_dir)
    if found.name != params.family:
        raise ParameterError(f"{model}: parameter family is {params.family}, but model_dir {params.model_dir} is a "
                             f"{found.name} folder (it holds {found.yaml_file})")
