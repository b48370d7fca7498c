"""Small ONNX models built with onnx.helper, for the importer's tests (no torch needed).

Each builder returns a ModelProto; `save` writes it (and any external data) under a directory.
The shapes are chosen so each test can assert exact shapes and op lists by hand.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from autoshard.ir.graph import Graph

F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def model(nodes, inputs, outputs, inits=(), opset=17, functions=(), name="g", value_info=()):
    """A ModelProto of a single graph; `inits` are numpy arrays keyed by name or TensorProtos."""
    tensors = [
        t if isinstance(t, TensorProto) else numpy_helper.from_array(np.asarray(t[1]), t[0])
        for t in (inits.items() if isinstance(inits, dict) else inits)
    ]
    graph = helper.make_graph(
        nodes, name, inputs, outputs, initializer=tensors, value_info=list(value_info)
    )
    opsets = [helper.make_opsetid("", opset)]
    if functions:
        opsets.append(helper.make_opsetid("local", 1))
    # IR 10: what onnxruntime (the tests' oracle) accepts; helper's default is newer.
    return helper.make_model(graph, opset_imports=opsets, functions=list(functions), ir_version=10)


def tensor(name, elem_type, shape):
    return helper.make_tensor_value_info(name, elem_type, shape)


def save(proto: onnx.ModelProto, directory: Path, name: str = "model.onnx") -> Path:
    path = directory / name
    onnx.save(proto, path)
    return path


def rng_weight(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def reshapes() -> onnx.ModelProto:
    """x[4, 6, 8] (batch, seq, hidden) read two ways: Reshape to [24, 8] (batch*seq rows) and
    MatMul W[8, 8] (m); Reshape to [4, 6, 2, 4] (heads), Transpose to [4, 2, 6, 4], Relu (o).
    The Reshape ops are named like their shape initializers ("rows", "heads"), as ONNX allows:
    nodes and values are named apart."""
    nodes = [
        helper.make_node("Reshape", ["x", "rows"], ["r"], name="rows"),
        helper.make_node("MatMul", ["r", "W"], ["m"], name="mm"),
        helper.make_node("Reshape", ["x", "heads"], ["s"], name="heads"),
        helper.make_node("Transpose", ["s"], ["t"], perm=[0, 2, 1, 3], name="transpose"),
        helper.make_node("Relu", ["t"], ["o"], name="relu"),
    ]
    inits = {"W": rng_weight((8, 8)), "rows": np.array([24, 8]), "heads": np.array([4, 6, 2, 4])}
    outputs = [tensor("m", F32, [24, 8]), tensor("o", F32, [4, 2, 6, 4])]
    return model(nodes, [tensor("x", F32, [4, 6, 8])], outputs, inits)


def matmul_chain(batch="batch") -> onnx.ModelProto:
    """x[batch, 8] @ W0[8, 16] → Relu → @ W1[16, 4] → + b[4]; ops named mm0, relu, mm1, add."""
    nodes = [
        helper.make_node("MatMul", ["x", "W0"], ["h"], name="mm0"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "W1"], ["o"], name="mm1"),
        helper.make_node("Add", ["o", "b"], ["y"], name="add"),
    ]
    inits = {"W0": rng_weight((8, 16), 1), "W1": rng_weight((16, 4), 2), "b": rng_weight(4, 3)}
    return model(nodes, [tensor("x", F32, [batch, 8])], [tensor("y", F32, [batch, 4])], inits)


def torchscript_reshape() -> onnx.ModelProto:
    """`x.view(x.size(0), 3, 4)` as TorchScript exports it, plus a second shape subgraph that
    needs a second folding round (it reads the Reshape's result shape), a mask from
    ConstantOfShape/Range/Equal/Where, and an Expand of a parameter (a float bias: it must stay
    an op). Unnamed nodes, so the importer names them `Type_index`.

    x[batch, 12] → y = Reshape(x, [b, 3, 4]) → out = y + Expand(bias, Shape(y))
                                             + Where(Range(0,4) == 2, 1.0, 0.0)  (a [4] mask)
    """
    n = helper.make_node
    nodes = [
        n("Shape", ["x"], ["s"]),  # Shape_0
        n("Constant", [], ["zero"], value=numpy_helper.from_array(np.array(0, np.int64))),
        n("Gather", ["s", "zero"], ["b"], axis=0),  # Gather_2
        n("Unsqueeze", ["b", "axes0"], ["bu"]),  # Unsqueeze_3
        n("Concat", ["bu", "rest"], ["target"], axis=0),  # Concat_4
        n("Reshape", ["x", "target"], ["y"]),  # Reshape_5
        n("Shape", ["y"], ["sy"]),  # Shape_6: foldable only once y's shape is known
        n("Expand", ["bias", "sy"], ["bias_e"]),  # Expand_7: bias is a parameter
        n("Add", ["y", "bias_e"], ["y2"]),  # Add_8
        n("Shape", ["y"], ["last"], start=-1),  # Shape_9: [4]
        n("ConstantOfShape", ["last"], ["ones"], value=numpy_helper.from_array(np.ones(1))),
        n("Squeeze", ["last"], ["last_s"]),  # Squeeze_11
        n("Range", ["start", "last_s", "step"], ["pos"]),  # Range_12: [0, 1, 2, 3]
        n("Equal", ["pos", "two"], ["is2"]),  # Equal_13
        n("Cast", ["ones"], ["ones_f"], to=F32),  # Cast_14
        n("Where", ["is2", "ones_f", "zeros_f"], ["mask"]),  # Where_15
        n("Add", ["y2", "mask"], ["out"]),  # Add_16
        # Out of topological order on purpose: the importer must sort (stably).
        n("Constant", [], ["zeros_f"], value=numpy_helper.from_array(np.zeros(4, np.float32))),
    ]
    inits = {
        "axes0": np.array([0], np.int64),
        "rest": np.array([3, 4], np.int64),
        "bias": rng_weight(4, 4),
        "start": np.array(0, np.int64),
        "step": np.array(1, np.int64),
        "two": np.array(2, np.int64),
    }
    return model(
        nodes, [tensor("x", F32, ["batch", 12])], [tensor("out", F32, None)], inits, opset=17
    )


def external_weight(directory: Path, write_data: bool = True) -> Path:
    """A MatMul whose weight W[4, 3] lives in `weights.bin` at offset 16 (after another
    tensor), written only if `write_data`; returns the model path."""
    a = np.arange(4, dtype=np.float32)  # 16 bytes, first in the file
    w = np.arange(12, dtype=np.float32).reshape(4, 3) / 7
    tensors = []
    for name, array, offset in (("A", a, 0), ("W", w, 16)):
        t = TensorProto(name=name, data_type=F32, dims=array.shape)
        t.data_location = TensorProto.EXTERNAL
        for key, value in (
            ("location", "weights.bin"),
            ("offset", offset),
            ("length", array.nbytes),
        ):
            t.external_data.add(key=key, value=str(value))
        tensors.append(t)
    nodes = [
        helper.make_node("Add", ["x", "A"], ["xa"], name="add"),
        helper.make_node("MatMul", ["xa", "W"], ["y"], name="mm"),
    ]
    proto = model(nodes, [tensor("x", F32, [2, 4])], [tensor("y", F32, [2, 3])], tensors)
    path = directory / "ext.onnx"
    onnx.save(proto, path)
    if write_data:
        (directory / "weights.bin").write_bytes(a.tobytes() + w.tobytes())
    return path


def weight_values() -> dict[str, np.ndarray]:
    """The data `external_weight` writes."""
    return {
        "A": np.arange(4, dtype=np.float32),
        "W": np.arange(12, dtype=np.float32).reshape(4, 3) / 7,
    }


def onnx_param_count(path: Path) -> int:
    """onnx's own count: elements of every initializer of the file."""
    proto = onnx.load(path, load_external_data=False)
    return sum(int(np.prod(t.dims)) for t in proto.graph.initializer)


def run_all_values(path: Path, graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Run the original model in onnxruntime, every node result exposed as an output, on random
    inputs of the imported graph's (bound) shapes: name → array."""
    proto = onnx.load(path)
    dtype_of = {v.name: v.dtype for v in graph.values.values()}
    known_outputs = {o.name for o in proto.graph.output}
    for node in proto.graph.node:
        for name in node.output:
            if name and name not in known_outputs and name in dtype_of:
                elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype_of[name]))
                proto.graph.output.append(helper.make_tensor_value_info(name, elem, None))
                known_outputs.add(name)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(proto.SerializeToString(), options)
    rng = np.random.default_rng(seed)
    feeds = {}
    for name in graph.inputs:
        value = graph.values[name]
        if value.dtype.startswith("float"):
            feeds[name] = rng.standard_normal(value.shape).astype(value.dtype)
        else:  # ids and masks: 0/1 index every table and mask validly
            feeds[name] = rng.integers(0, 2, value.shape).astype(value.dtype)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))
