"""import_onnx on hand-built models: exact ops, shapes, constants, weights; ORT as oracle."""

import numpy as np
import pytest
from onnx import helper, numpy_helper
from onnx_factory import (
    F32,
    I64,
    external_weight,
    matmul_chain,
    model,
    onnx_param_count,
    run_all_values,
    save,
    tensor,
    torchscript_reshape,
    weight_values,
)

from autoshard.errors import ModelError
from autoshard.ir.graph import verify
from autoshard.ir.onnx_import import import_onnx, unbound_dims


def shapes(graph, names):
    return {name: graph.values[name].shape for name in names}


def test_matmul_chain_ops_values_and_roles(tmp_path):
    path = save(matmul_chain(), tmp_path)
    graph = import_onnx(path, {"batch": 5})
    verify(graph)
    assert [(op.name, op.type, op.inputs, op.outputs) for op in graph.ops] == [
        ("mm0", "MatMul", ("x", "W0"), ("h",)),
        ("relu", "Relu", ("h",), ("r",)),
        ("mm1", "MatMul", ("r", "W1"), ("o",)),
        ("add", "Add", ("o", "b"), ("y",)),
    ]
    assert shapes(graph, ["x", "h", "r", "o", "y", "W0", "W1", "b"]) == {
        "x": (5, 8), "h": (5, 16), "r": (5, 16), "o": (5, 4), "y": (5, 4),
        "W0": (8, 16), "W1": (16, 4), "b": (4,),
    }  # fmt: skip
    assert graph.inputs == ("x",) and graph.outputs == ("y",)
    assert list(graph.weights) == ["W0", "W1", "b"]
    assert {n: graph.role(n) for n in ("x", "W0", "h", "y")} == {
        "x": "input", "W0": "weight", "h": "activation", "y": "output"
    }  # fmt: skip
    assert graph.values["y"].dtype == "float32"
    assert graph.opset == 17 and graph.nodes_in_file == 4
    assert sum(w.size for w in graph.weights.values()) == onnx_param_count(path) == 196


def test_weights_load_embedded_data_exactly(tmp_path):
    proto = matmul_chain()
    graph = import_onnx(save(proto, tmp_path), {"batch": 1})
    for init in proto.graph.initializer:
        weight = graph.weights[init.name]
        assert weight.has_data
        np.testing.assert_array_equal(weight.load(), numpy_helper.to_array(init))


def test_torchscript_shape_subgraph_folds_to_constants(tmp_path):
    path = save(torchscript_reshape(), tmp_path)
    graph = import_onnx(path, {"batch": 2})
    verify(graph)
    # Only ops touching activations or the float parameter survive; unnamed nodes are named by
    # type and file position.
    assert [(op.name, op.type) for op in graph.ops] == [
        ("Reshape_5", "Reshape"),
        ("Expand_7", "Expand"),
        ("Add_8", "Add"),
        ("Add_16", "Add"),
    ]
    assert shapes(graph, ["x", "y", "bias_e", "y2", "out"]) == {
        "x": (2, 12), "y": (2, 3, 4), "bias_e": (2, 3, 4), "y2": (2, 3, 4), "out": (2, 3, 4),
    }  # fmt: skip
    expected = {
        "target": [2, 3, 4],
        "sy": [2, 3, 4],
        "last": [4],
        "pos": [0, 1, 2, 3],
        "mask": [0.0, 0.0, 1.0, 0.0],
    }
    for name, value in expected.items():
        np.testing.assert_array_equal(graph.constants[name], value, err_msg=name)
        assert graph.role(name) == "constant"
    assert graph.values["target"].dtype == "int64" and graph.values["mask"].dtype == "float32"
    assert graph.values["is2"].dtype == "bool"
    # Initializers read only by folded nodes stay weights; the float bias is never folded.
    assert set(graph.weights) == {"axes0", "rest", "bias", "start", "step", "two"}
    assert sum(w.size for w in graph.weights.values()) == onnx_param_count(path) == 10
    assert graph.nodes_in_file == 18


@pytest.mark.parametrize("batch", [1, 2, 7])
def test_torchscript_shapes_and_constants_match_onnxruntime(tmp_path, batch):
    path = save(torchscript_reshape(), tmp_path)
    graph = import_onnx(path, {"batch": batch})
    ran = run_all_values(path, graph)
    assert set(ran) == set(graph.values) - set(graph.inputs) - set(graph.weights)
    for name, array in ran.items():
        assert graph.values[name].shape == array.shape, name
        if name in graph.constants:
            np.testing.assert_array_equal(graph.constants[name], array, err_msg=name)


def test_matmul_chain_shapes_match_onnxruntime(tmp_path):
    path = save(matmul_chain(), tmp_path)
    graph = import_onnx(path, {"batch": 3})
    ran = run_all_values(path, graph)
    assert {name: a.shape for name, a in ran.items()} == shapes(graph, ["h", "r", "o", "y"])


def test_external_weight_with_data_loads_exact_values(tmp_path):
    path = external_weight(tmp_path, write_data=True)
    graph = import_onnx(path)
    verify(graph)
    for name, expected in weight_values().items():
        weight = graph.weights[name]
        assert weight.has_data and weight.external == tmp_path / "weights.bin"
        np.testing.assert_array_equal(weight.load(), expected)
    assert graph.values["y"].shape == (2, 3)


def test_external_weight_without_data_is_shape_only(tmp_path):
    path = external_weight(tmp_path, write_data=False)
    graph = import_onnx(path)
    verify(graph)
    assert [op.type for op in graph.ops] == ["Add", "MatMul"]
    assert not graph.weights["W"].has_data
    assert graph.values["W"].shape == (4, 3) and graph.values["y"].shape == (2, 3)
    with pytest.raises(ModelError, match=r"weight 'W' has no data: .*weights\.bin' is missing"):
        graph.weights["W"].load()


def test_unnamed_and_duplicate_node_names_are_made_unique(tmp_path):
    n = helper.make_node
    nodes = [
        n("Relu", ["x"], ["a"]),
        n("Relu", ["a"], ["b"], name="Relu_0"),  # clashes with the generated name above
        n("Neg", ["b"], ["c"], name="dup"),
        n("Neg", ["c"], ["d"], name="dup"),
    ]
    path = save(model(nodes, [tensor("x", F32, [3])], [tensor("d", F32, [3])]), tmp_path)
    graph = import_onnx(path)
    assert [op.name for op in graph.ops] == ["Relu_0", "Relu_0_1", "dup", "dup_1"]


def test_non_topological_file_order_is_sorted_stably(tmp_path):
    n = helper.make_node
    nodes = [
        n("Relu", ["b"], ["c"], name="third"),
        n("Neg", ["x"], ["a"], name="first"),
        n("Abs", ["x"], ["u"], name="independent"),
        n("Neg", ["a"], ["b"], name="second"),
    ]
    path = save(model(nodes, [tensor("x", F32, [3])], [tensor("c", F32, [3])]), tmp_path)
    graph = import_onnx(path)
    verify(graph)
    assert [op.name for op in graph.ops] == ["first", "independent", "second", "third"]


def test_local_functions_are_inlined(tmp_path):
    n = helper.make_node
    body = [n("Mul", ["X", "X"], ["S"]), n("Add", ["S", "X"], ["Y"])]
    function = helper.make_function(
        "local", "SquarePlus", ["X"], ["Y"], body, [helper.make_opsetid("", 17)]
    )
    nodes = [n("SquarePlus", ["x"], ["y"], domain="local", name="call")]
    proto = model(nodes, [tensor("x", F32, [2, 3])], [tensor("y", F32, [2, 3])],
                  functions=[function])  # fmt: skip
    graph = import_onnx(save(proto, tmp_path))
    verify(graph)
    assert [op.type for op in graph.ops] == ["Mul", "Add"]
    assert graph.values["y"].shape == (2, 3)
    assert graph.nodes_in_file == 1


def test_anonymous_dim_is_bound_by_input_dot_axis(tmp_path):
    proto = matmul_chain(batch=None)
    path = save(proto, tmp_path)
    assert unbound_dims(path) == {"x.0": ["x[0]"]}
    graph = import_onnx(path, {"x.0": 6})
    assert graph.values["y"].shape == (6, 4)


def test_constant_of_shape_too_big_to_fold_stays_an_op(tmp_path):
    """A [seq, seq] mask over the fold limit is not materialized; under it, it is folded."""
    n = helper.make_node
    nodes = [
        n("Shape", ["x"], ["s"], name="shape"),
        n("Concat", ["s", "s"], ["ss"], axis=0, name="concat"),
        n("ConstantOfShape", ["ss"], ["mask"], name="mask",
          value=numpy_helper.from_array(np.zeros(1, np.float32))),
        n("Add", ["mask", "x"], ["y"], name="add"),
    ]  # fmt: skip
    proto = model(nodes, [tensor("x", F32, ["seq"])], [tensor("y", F32, None)])
    path = save(proto, tmp_path)
    big = import_onnx(path, {"seq": 1000})  # 1e6 elements > 65536
    assert [op.name for op in big.ops] == ["mask", "add"]
    assert big.values["mask"].shape == (1000, 1000) and big.values["y"].shape == (1000, 1000)
    small = import_onnx(path, {"seq": 16})
    assert [op.name for op in small.ops] == ["add"]
    np.testing.assert_array_equal(small.constants["mask"], np.zeros((16, 16), np.float32))


def test_large_int_initializer_is_not_a_fold_source(tmp_path):
    """Position ids bigger than the fold limit are never loaded: their Slice stays an op."""
    n = helper.make_node
    nodes = [
        n("Slice", ["pos", "starts", "ends"], ["p"], name="slice"),
        n("Add", ["p", "x"], ["y"], name="add"),
    ]
    inits = {
        "pos": np.arange(70000, dtype=np.int64),
        "starts": np.array([0], np.int64),
        "ends": np.array([5], np.int64),
    }
    proto = model(nodes, [tensor("x", I64, [5])], [tensor("y", I64, [5])], inits)
    graph = import_onnx(save(proto, tmp_path))
    assert [op.name for op in graph.ops] == ["slice", "add"]
    assert graph.values["p"].shape == (5,)


def test_graph_output_that_folds_is_a_constant_output(tmp_path):
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape")]
    proto = model(nodes, [tensor("x", F32, ["n", 3])], [tensor("s", I64, [2])])
    graph = import_onnx(save(proto, tmp_path), {"n": 4})
    verify(graph)
    assert graph.ops == () and graph.outputs == ("s",)
    np.testing.assert_array_equal(graph.constants["s"], [4, 3])


def test_initializer_listed_as_graph_input_is_a_weight(tmp_path):
    """Old exporters (keep_initializers_as_inputs) list initializers among graph inputs."""
    proto = matmul_chain()
    proto.graph.input.extend([tensor("W0", F32, [8, 16])])
    graph = import_onnx(save(proto, tmp_path), {"batch": 2})
    assert graph.inputs == ("x",) and "W0" in graph.weights


def test_unbound_dims_lists_names_and_places(tmp_path):
    """unbound_dims lists every name with every place carrying it, in input order."""
    x = tensor("ids", I64, ["batch", "seq"])
    mask = tensor("mask", I64, ["batch", "seq"])
    nodes = [helper.make_node("Add", ["ids", "mask"], ["y"], name="add")]
    path = save(model(nodes, [x, mask], [tensor("y", I64, None)]), tmp_path)
    assert unbound_dims(path) == {"batch": ["ids[0]", "mask[0]"], "seq": ["ids[1]", "mask[1]"]}


def test_onnxruntime_operators_get_shapes_from_onnxruntime(tmp_path):
    """onnx's inference does not know com.microsoft's (or onnxruntime's ONNX-domain) fused ops;
    onnxruntime's symbolic inference gives their results' shapes, and the symbolic batch dim
    binds through them."""
    nodes = [
        helper.make_node("SkipLayerNormalization", ["x", "skip", "g", "b"], ["n", "", "", "s"],
                         name="skip_norm", domain="com.microsoft"),
        helper.make_node("FastGelu", ["n", "b"], ["a"], name="gelu", domain="com.microsoft"),
        helper.make_node("SimplifiedLayerNormalization", ["a", "g"], ["y"], name="rms"),
    ]  # fmt: skip
    x = tensor("x", F32, ["batch", 4, 8])
    inits = {"skip": np.ones((4, 8), np.float32), "g": np.ones(8, np.float32),
             "b": np.zeros(8, np.float32)}  # fmt: skip
    proto = model(nodes, [x], [tensor("y", F32, None), tensor("s", F32, None)], inits)
    proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    graph = import_onnx(save(proto, tmp_path), {"batch": 2})
    assert shapes(graph, ["n", "a", "y", "s"]) == dict.fromkeys(["n", "a", "y", "s"], (2, 4, 8))
