"""The MLP of docs/design/propagation.md and lowering.md as an ONNX model: x 2x4x8, dot with W1
8x32, max with a zero constant, dot with W2 32x8 (the pages' `mhlo.dot_general`/`mhlo.maximum`
program)."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def write_seed_mlp(path, name="mlp"):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 8])
    weights = [
        numpy_helper.from_array(np.ones((8, 32), np.float32), "w1"),
        numpy_helper.from_array(np.ones((32, 8), np.float32), "w2"),
    ]
    zero = numpy_helper.from_array(np.zeros((2, 4, 32), np.float32))
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="dot1"),
        helper.make_node("Constant", [], ["zero"], value=zero),
        helper.make_node("Max", ["h", "zero"], ["r"], name="max"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="dot2"),
    ]
    graph = helper.make_graph(nodes, name, [x], [y], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path
