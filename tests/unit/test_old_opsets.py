"""Models of opsets 7-12 are upgraded on import (onnx.version_converter) and then plan,
partition and verify like any other; a conversion that fails names the op that blocked it.

The model is shaped like the ONNX model zoo's opset-9 CNNs: initializers also listed as graph
inputs, a bias produced by ConstantOfShape, Reshape to a constant shape, and ops whose
attributes became inputs at opset 13 (Unsqueeze, ReduceSum axes) or changed meaning
(Softmax's axis coerces to 2-D before 13).
"""

import json

import numpy as np
import pytest
from onnx import helper, numpy_helper
from onnx_factory import F32, rng_weight, save, tensor

from autoshard.cli.main import main
from autoshard.errors import ModelError
from autoshard.ir.onnx_import import import_onnx

n = helper.make_node


def zoo_like(opset: int):
    """x[2, 3, 8, 8] -> Conv(4, 3x3, pad 1) -> BatchNormalization -> Relu -> MaxPool 2
    -> Reshape [2, 64] -> Gemm(W[64, 10]) + ConstantOfShape bias -> Unsqueeze(axes=[1])
    -> ReduceSum(axes=[1]) -> Softmax(axis=1) -> y[2, 10]."""
    inits = {
        "conv_w": rng_weight((4, 3, 3, 3), 1),
        "conv_b": rng_weight((4,), 2),
        "bn_scale": rng_weight((4,), 3) ** 2 + 0.5,
        "bn_bias": rng_weight((4,), 4),
        "bn_mean": rng_weight((4,), 5),
        "bn_var": rng_weight((4,), 6) ** 2 + 0.5,
        "fc_w": rng_weight((64, 10), 7),
    }

    def const(name, array):
        return n("Constant", [], [name], name=name, value=numpy_helper.from_array(array))

    bias = np.full(10, 0.25, np.float32)
    if opset >= 9:  # ConstantOfShape is new in opset 9
        fill = numpy_helper.from_array(bias[:1])
        make_bias = [
            const("bias_shape", np.array([10], np.int64)),
            n("ConstantOfShape", ["bias_shape"], ["fc_b"], name="fc_bias", value=fill),
        ]
    else:
        make_bias = [const("fc_b", bias)]
    bn_inputs = ["c", "bn_scale", "bn_bias", "bn_mean", "bn_var"]
    nodes = [
        n("Conv", ["x", "conv_w", "conv_b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        n("BatchNormalization", bn_inputs, ["b"], name="bn"),
        n("Relu", ["b"], ["r"], name="relu"),
        n("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        const("shape", np.array([2, 64], np.int64)),
        n("Reshape", ["p", "shape"], ["f"], name="flatten"),
        *make_bias,
        n("Gemm", ["f", "fc_w", "fc_b"], ["g"], name="fc"),
        n("Unsqueeze", ["g"], ["u"], name="unsqueeze", axes=[1]),
        n("ReduceSum", ["u"], ["s"], name="sum", axes=[1], keepdims=0),
        n("Softmax", ["s"], ["y"], name="softmax", axis=1),
    ]
    tensors = [numpy_helper.from_array(v, k) for k, v in inits.items()]
    # Old exporters list every initializer as a graph input too.
    inputs = [tensor("x", F32, [2, 3, 8, 8])] + [tensor(k, F32, v.shape) for k, v in inits.items()]
    graph = helper.make_graph(nodes, "zoo", inputs, [tensor("y", F32, [2, 10])], tensors)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=min(opset - 4, 7)
    )


@pytest.mark.parametrize("opset", [7, 9, 11, 12])
def test_old_opset_is_upgraded_on_import(tmp_path, opset):
    graph = import_onnx(save(zoo_like(opset), tmp_path))
    assert graph.opset == 13
    assert graph.inputs == ("x",)  # initializers listed as inputs are weights, not inputs
    assert sorted(graph.weights) == sorted(
        ["conv_w", "conv_b", "bn_scale", "bn_bias", "bn_mean", "bn_var", "fc_w"]
    )
    ops = {op.name: op for op in graph.ops}
    assert ops["unsqueeze"].attrs.get("axes") is None and len(ops["unsqueeze"].inputs) == 2
    assert graph.values["y"].shape == (2, 10)


def test_old_opset_plans_partitions_and_verifies(tmp_path, capsys):
    path = save(zoo_like(9), tmp_path)
    plan, out = tmp_path / "plan.json", tmp_path / "out"
    assert main(["plan", str(path), "--mesh", "2", "--objective", "bytes", "-o", str(plan)]) == 0
    assert main(["partition", str(path), "--mesh", "2", "--plan", str(plan), "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["verify", str(out), "--model", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["devices"] == 2


def test_a_conversion_that_fails_names_the_op(tmp_path):
    """An op the converter knows but cannot bring forward (ConstantOfShape in an opset-8
    model: it is new in opset 9)."""
    model = zoo_like(9)
    model.opset_import[0].version = 8
    path = save(model, tmp_path)
    with pytest.raises(ModelError) as error:
        import_onnx(path)
    assert str(error.value) == (
        f"model '{path}' uses opset 8; upgrading it to opset 13 failed: op 'fc_bias' "
        "(ConstantOfShape) cannot be converted: No Adapter From Version $8 for ConstantOfShape "
        "(re-export with opset >= 13)"
    )


def test_a_removed_op_blocks_the_upgrade(tmp_path):
    nodes = [
        n("Relu", ["x"], ["r"], name="relu"),
        n("ImageScaler", ["r"], ["y"], name="scale", scale=2.0),  # removed from ONNX
    ]
    graph = helper.make_graph(
        nodes, "g", [tensor("x", F32, [1, 3, 2, 2])], [tensor("y", F32, None)]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], ir_version=4)
    path = save(model, tmp_path)
    with pytest.raises(ModelError) as error:
        import_onnx(path)
    assert str(error.value) == (
        f"model '{path}' uses opset 9; upgrading it to opset 13 failed: op 'scale' (ImageScaler) "
        "is not an operator of this ONNX version (re-export with opset >= 13)"
    )
