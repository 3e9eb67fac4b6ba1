"""Reduced-precision copies of the exported graphs, for TensorRT's strongly typed builds.

TensorRT 11 removed weak typing (the FP16 / BF16 builder flags that let TensorRT choose a precision per
layer): the types written in the graph decide. `mixed_precision(model, "fp16")` returns a copy in which
every matrix product and convolution (MatMul, Gemm, Conv, ConvTranspose: nearly all of the FLOPs)
computes in fp16 -- its float inputs cast down, weights converted once, its output cast back to fp32 --
while everything else stays fp32: normalisations, softmax, exp / sin, the estimator's -1e10 attention
bias (which fp16 cannot hold) and the graph's inputs and outputs. It is the split torch.autocast makes.

bf16: the same for MatMul and Gemm; ONNX has bf16 convolutions only from opset 22, so in older graphs
(ours are opset 18) convolutions stay fp32.
"""
from __future__ import annotations

import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

LOW_PRECISION_OPS = ("MatMul", "Gemm", "Conv", "ConvTranspose")
_CONV_OPS = ("Conv", "ConvTranspose")
_BF16_CONV_OPSET = 22
_TYPES = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}


def mixed_precision(model: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    """A copy of `model` with LOW_PRECISION_OPS computing in `precision` ("fp16" or "bf16")."""
    if precision not in _TYPES:
        raise ValueError(f"precision must be one of {sorted(_TYPES)}, got {precision!r}")
    low_type = _TYPES[precision]
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    ops = [op for op in LOW_PRECISION_OPS
           if not (precision == "bf16" and op in _CONV_OPS and opset < _BF16_CONV_OPSET)]
    model = onnx.ModelProto.FromString(model.SerializeToString())  # deep copy
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    low_names: dict[str, str] = {}  # fp32 tensor -> its low-precision copy (an initializer or a Cast's output)
    nodes = []
    for node in graph.node:
        if node.op_type not in ops:
            nodes.append(node)
            continue
        for k, name in enumerate(node.input):
            if not name:  # an omitted optional input
                continue
            if name not in low_names:
                low_names[name] = f"{name}.{precision}"
                if name in initializers and initializers[name].data_type == TensorProto.FLOAT:
                    graph.initializer.append(_converted(initializers[name], low_names[name], precision))
                else:  # placed right before its first low-precision consumer, after its producer
                    nodes.append(helper.make_node("Cast", [name], [low_names[name]], to=low_type))
            node.input[k] = low_names[name]
        output = node.output[0]
        node.output[0] = low_names[output] = f"{output}.{precision}"  # a low-precision consumer takes it as is
        nodes.append(node)
        nodes.append(helper.make_node("Cast", [node.output[0]], [output], to=TensorProto.FLOAT))
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def _converted(init: onnx.TensorProto, name: str, precision: str) -> onnx.TensorProto:
    values = torch.from_numpy(numpy_helper.to_array(init).copy())
    if precision == "fp16":
        return numpy_helper.from_array(values.to(torch.float16).numpy(), name)
    # numpy has no bfloat16: store the raw 16-bit patterns
    bits = values.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    return helper.make_tensor(name, TensorProto.BFLOAT16, list(values.shape), bits, raw=True)
