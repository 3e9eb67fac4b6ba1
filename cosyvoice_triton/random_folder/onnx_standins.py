"""Random ONNX stand-ins for the two released ONNX networks, with their exact I/O contract.

- `campplus.onnx` (CAM++ speaker embedding): `input` float32 [B, T, 80] (mean-normalized Kaldi
  fbank) → `output` float32 [B, 192]. Stand-in: a per-frame tanh layer, then mean and mean-square
  pooling over time, then a linear map. Since the pooled statistics follow the input's spectrum,
  different voices give different embeddings.
- `speech_tokenizer_v2.onnx` (S3 tokenizer v2): `feats` float32 [B, 128, T] (Whisper log mel) and
  `feats_length` int32 [B] → `indices` int64 [B, ceil(T / 4)] in [0, 6561). Stand-in: frames past
  `feats_length` are zeroed, two stride-2 convolutions (403 frames → 202 → 101), a projection to 8
  dimensions, tanh, and rounding to {-1, 0, 1} per dimension: a 3^8 = 6561-entry finite scalar
  quantizer, read as a base-3 number.

The graphs use opset 17 and IR version 8 so that older ONNX Runtime and TensorRT releases load
them. Weights come from `numpy.random.default_rng(seed)`: the same seed writes the same bytes.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
PRODUCER = "cosyvoice_triton-standin"

FBANK_BINS = 80
EMBEDDING_DIM = 192
CAMPPLUS_HIDDEN = 128

WHISPER_MELS = 128
TOKENIZER_CHANNELS = 64
FSQ_DIMS = 8  # 3 levels each: 3**8 = 6561 speech tokens
FSQ_LEVELS = 3


def _weights(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int, gain: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * gain / np.sqrt(fan_in)).astype(np.float32)


def _initializer(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(array, name=name)


def _save(graph: onnx.GraphProto, path: str | Path) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name=PRODUCER)
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def write_campplus_standin(path: str | Path, seed: int) -> None:
    """Write a CAM++ stand-in: `input` [B, T, 80] → `output` [B, 192]."""
    rng = np.random.default_rng(seed)
    weights = [
        _initializer("frame_weight", _weights(rng, (FBANK_BINS, CAMPPLUS_HIDDEN), FBANK_BINS)),
        _initializer("embed_weight", _weights(rng, (CAMPPLUS_HIDDEN, EMBEDDING_DIM), CAMPPLUS_HIDDEN, gain=4.0)),
        _initializer("variance_floor", np.array(1e-6, dtype=np.float32)),
    ]
    nodes = [
        helper.make_node("MatMul", ["input", "frame_weight"], ["frame_proj"]),  # (B, T, H)
        helper.make_node("Mul", ["frame_proj", "frame_proj"], ["frame_sq"]),
        helper.make_node("ReduceMean", ["frame_sq"], ["variance"], axes=[1], keepdims=0),  # (B, H)
        helper.make_node("Add", ["variance", "variance_floor"], ["variance_floored"]),
        helper.make_node("Log", ["variance_floored"], ["log_variance"]),
        helper.make_node("ReduceMean", ["log_variance"], ["log_level"], axes=[1], keepdims=1),  # (B, 1)
        helper.make_node("Sub", ["log_variance", "log_level"], ["spectral_shape"]),  # (B, H)
        helper.make_node("MatMul", ["spectral_shape", "embed_weight"], ["output"]),  # (B, 192)
    ]
    graph = helper.make_graph(
        nodes, "campplus_standin",
        inputs=[helper.make_tensor_value_info("input", TensorProto.FLOAT, ["B", "T", FBANK_BINS])],
        outputs=[helper.make_tensor_value_info("output", TensorProto.FLOAT, ["B", EMBEDDING_DIM])],
        initializer=weights)
    _save(graph, path)


def _length_mask_nodes() -> list[onnx.NodeProto]:
    """Nodes that turn `feats_length` (B,) into `frame_mask` float (B, 1, T): 1 for valid frames."""
    return [
        helper.make_node("Shape", ["feats"], ["time_dim"], start=2, end=3),  # (1,) = [T]
        helper.make_node("Squeeze", ["time_dim"], ["time_len"]),  # scalar T
        helper.make_node("Range", ["zero_i64", "time_len", "one_i64"], ["frame_index"]),  # (T,)
        helper.make_node("Unsqueeze", ["frame_index", "axis_0"], ["frame_index_row"]),  # (1, T)
        helper.make_node("Cast", ["feats_length"], ["length_i64"], to=TensorProto.INT64),
        helper.make_node("Unsqueeze", ["length_i64", "axis_1"], ["length_col"]),  # (B, 1)
        helper.make_node("Less", ["frame_index_row", "length_col"], ["valid"]),  # (B, T) bool
        helper.make_node("Cast", ["valid"], ["valid_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["valid_f", "axis_1"], ["frame_mask"]),  # (B, 1, T)
    ]


def write_speech_tokenizer_standin(path: str | Path, seed: int) -> None:
    """Write an S3 tokenizer stand-in: `feats` [B, 128, T], `feats_length` [B] → `indices` [B, ceil(T/4)]."""
    rng = np.random.default_rng(seed)
    channels = TOKENIZER_CHANNELS
    weights = [
        _initializer("conv1_weight", _weights(rng, (channels, WHISPER_MELS, 3), WHISPER_MELS * 3, gain=2.0)),
        _initializer("conv1_bias", _weights(rng, (channels,), 1, gain=0.1)),
        _initializer("conv2_weight", _weights(rng, (channels, channels, 3), channels * 3, gain=2.0)),
        _initializer("conv2_bias", _weights(rng, (channels,), 1, gain=0.1)),
        _initializer("fsq_weight", _weights(rng, (channels, FSQ_DIMS), channels, gain=1.5)),
        _initializer("fsq_place_values", (FSQ_LEVELS ** np.arange(FSQ_DIMS, dtype=np.float32))[:, None]),
        _initializer("one_f", np.array(1.0, dtype=np.float32)),
        _initializer("zero_i64", np.array(0, dtype=np.int64)),
        _initializer("one_i64", np.array(1, dtype=np.int64)),
        _initializer("axis_0", np.array([0], dtype=np.int64)),
        _initializer("axis_1", np.array([1], dtype=np.int64)),
        _initializer("axis_2", np.array([2], dtype=np.int64)),
    ]
    conv = {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}  # length L → ceil(L / 2)
    nodes = _length_mask_nodes() + [
        helper.make_node("ReduceMean", ["feats"], ["frame_level"], axes=[1], keepdims=1),  # (B, 1, T)
        helper.make_node("Sub", ["feats", "frame_level"], ["frame_shape"]),  # loudness removed
        helper.make_node("Mul", ["frame_shape", "frame_mask"], ["masked"]),  # (B, 128, T)
        helper.make_node("Conv", ["masked", "conv1_weight", "conv1_bias"], ["conv1"], **conv),  # (B, C, T/2)
        helper.make_node("Tanh", ["conv1"], ["act1"]),
        helper.make_node("Conv", ["act1", "conv2_weight", "conv2_bias"], ["conv2"], **conv),  # (B, C, T/4)
        helper.make_node("Transpose", ["conv2"], ["frames"], perm=[0, 2, 1]),  # (B, T2, C)
        helper.make_node("MatMul", ["frames", "fsq_weight"], ["fsq_proj"]),  # (B, T2, 8)
        helper.make_node("Tanh", ["fsq_proj"], ["fsq_bounded"]),  # (-1, 1)
        helper.make_node("Round", ["fsq_bounded"], ["fsq_level"]),  # {-1, 0, 1}
        helper.make_node("Add", ["fsq_level", "one_f"], ["fsq_digit"]),  # {0, 1, 2}
        helper.make_node("MatMul", ["fsq_digit", "fsq_place_values"], ["code_col"]),  # (B, T2, 1)
        helper.make_node("Squeeze", ["code_col", "axis_2"], ["code"]),  # (B, T2), exact in float32
        helper.make_node("Cast", ["code"], ["indices"], to=TensorProto.INT64),
    ]
    graph = helper.make_graph(
        nodes, "speech_tokenizer_standin",
        inputs=[helper.make_tensor_value_info("feats", TensorProto.FLOAT, ["B", WHISPER_MELS, "T"]),
                helper.make_tensor_value_info("feats_length", TensorProto.INT32, ["B"])],
        outputs=[helper.make_tensor_value_info("indices", TensorProto.INT64, ["B", "T2"])],
        initializer=weights)
    _save(graph, path)
