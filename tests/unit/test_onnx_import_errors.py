"""import_onnx's user errors: one line, naming the file, op, value or dim at fault."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_factory import F32, I64, matmul_chain, model, save, tensor

from autoshard.errors import ModelError, UnboundDimError
from autoshard.ir.onnx_import import import_onnx, unbound_dims


def one_line_error(exc_info):
    message = str(exc_info.value)
    assert "\n" not in message
    assert exc_info.value.__cause__ is None  # no protobuf/onnx traceback chained to the user
    return message


def write_bytes(tmp_path, data):
    path = tmp_path / "bad.onnx"
    path.write_bytes(data)
    return path


def truncated(tmp_path):
    full = save(matmul_chain(), tmp_path, "full.onnx").read_bytes()
    return write_bytes(tmp_path, full[: len(full) // 2])


CORRUPT = "not an ONNX protobuf (corrupt or truncated file)"
UNREADABLE = {
    "garbage": (lambda p: write_bytes(p, b"\xff\xfe not a protobuf \x00\x01" * 10), CORRUPT),
    "text": (lambda p: write_bytes(p, b"hello, I am a text file\n"), CORRUPT),
    "truncated": (truncated, CORRUPT),
    "empty": (lambda p: write_bytes(p, b""), "empty file"),
    "graph-not-model": (
        lambda p: write_bytes(p, helper.make_graph([], "g", [], []).SerializeToString()),
        "not an ONNX model (no graph)",
    ),
    "missing": (lambda p: p / "nope.onnx", "no such file"),
    "directory": (lambda p: p, "is a directory"),
}


@pytest.mark.parametrize("make, reason", UNREADABLE.values(), ids=UNREADABLE.keys())
def test_unreadable_file(tmp_path, make, reason):
    path = make(tmp_path)
    with pytest.raises(ModelError) as exc_info:
        import_onnx(path)
    assert one_line_error(exc_info) == f"cannot read ONNX model '{path}': {reason}"


def test_opset_below_7_is_rejected(tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu")]
    path = save(model(nodes, [tensor("x", F32, [2])], [tensor("y", F32, [2])], opset=6), tmp_path)
    with pytest.raises(ModelError) as exc_info:
        import_onnx(path)
    assert one_line_error(exc_info) == (
        f"model '{path}' uses opset 6; autoshard reads opset >= 13 and upgrades opsets 7 to 12 "
        "(re-export with a newer opset)"
    )


def control_flow_node(op_type):
    branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["z"])], "branch", [], [tensor("z", F32, [2])]
    )
    if op_type == "If":
        return helper.make_node("If", ["c"], ["y"], name="gate", then_branch=branch,
                                else_branch=branch)  # fmt: skip
    return helper.make_node(op_type, ["", "c"], ["y"], name="gate", body=branch)


@pytest.mark.parametrize("op_type", ["If", "Loop"])
def test_control_flow_is_rejected_naming_the_op(tmp_path, op_type):
    proto = model(
        [control_flow_node(op_type)],
        [tensor("x", F32, [2]), tensor("c", TensorProto.BOOL, [])],
        [tensor("y", F32, [2])],
    )
    path = save(proto, tmp_path)
    with pytest.raises(ModelError) as exc_info:
        import_onnx(path)
    assert one_line_error(exc_info).startswith(
        f"op 'gate' ({op_type}) is control flow, which autoshard does not support; "
    )


def two_input_model(tmp_path, x_dims=("batch", "seq"), mask_dims=("batch", "seq")):
    nodes = [helper.make_node("Add", ["input_ids", "attention_mask"], ["y"], name="add")]
    inputs = [
        tensor("input_ids", I64, list(x_dims)),
        tensor("attention_mask", I64, list(mask_dims)),
    ]
    return save(model(nodes, inputs, [tensor("y", I64, None)]), tmp_path)


def test_unbound_dims_are_listed_with_the_inputs_carrying_them(tmp_path):
    path = two_input_model(tmp_path)
    with pytest.raises(UnboundDimError) as exc_info:
        import_onnx(path)
    assert one_line_error(exc_info) == (
        "unbound symbolic dims: batch (input_ids[0], attention_mask[0]), "
        "seq (input_ids[1], attention_mask[1]); bind them with --dim NAME=SIZE"
    )


def test_partly_bound_dims_list_only_the_unbound(tmp_path):
    path = two_input_model(tmp_path)
    with pytest.raises(UnboundDimError, match=r"^unbound symbolic dims: seq \(input_ids\[1\], "):
        import_onnx(path, {"batch": 2})


def test_anonymous_unbound_dim_is_named_input_dot_axis(tmp_path):
    path = two_input_model(tmp_path, x_dims=("batch", None), mask_dims=("batch", 16))
    assert unbound_dims(path) == {"batch": ["input_ids[0]", "attention_mask[0]"],
                                  "input_ids.1": ["input_ids[1]"]}  # fmt: skip
    with pytest.raises(UnboundDimError) as exc_info:
        import_onnx(path, {"batch": 2})
    assert one_line_error(exc_info) == (
        "unbound symbolic dims: input_ids.1 (input_ids[1]); bind them with --dim NAME=SIZE "
        "(an unnamed dim is named INPUT.AXIS)"
    )
    assert import_onnx(path, {"batch": 2, "input_ids.1": 16}).values["y"].shape == (2, 16)


def test_binding_an_unknown_dim_lists_the_model_dims(tmp_path):
    path = two_input_model(tmp_path)
    with pytest.raises(ModelError) as exc_info:
        import_onnx(path, {"batch": 2, "seq": 4, "heads": 8})
    assert (
        one_line_error(exc_info)
        == f"model '{path}' has no symbolic dim 'heads'; its dims: batch, seq"
    )


def test_binding_a_dim_of_a_static_model(tmp_path):
    path = two_input_model(tmp_path, x_dims=(2, 3), mask_dims=(2, 3))
    with pytest.raises(ModelError, match=r"has no symbolic dim 'batch'; its dims: none \(all"):
        import_onnx(path, {"batch": 2})


@pytest.mark.parametrize("size", [0, -1, 2.5, True, "3"], ids=repr)
def test_dim_size_must_be_a_positive_int(tmp_path, size):
    path = two_input_model(tmp_path)
    with pytest.raises(ModelError) as exc_info:
        import_onnx(path, {"batch": size, "seq": 4})
    assert one_line_error(exc_info) == f"dim 'batch' must be a positive int, got {size!r}"


def test_unknown_domain_op_without_shape_names_the_op(tmp_path):
    nodes = [
        helper.make_node("FancyGelu", ["x"], ["g"], name="fancy", domain="com.example"),
        helper.make_node("Relu", ["g"], ["y"], name="relu"),
    ]
    proto = model(nodes, [tensor("x", F32, [2, 3])], [tensor("y", F32, None)])
    proto.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(ModelError) as exc_info:
        import_onnx(save(proto, tmp_path))
    assert one_line_error(exc_info) == (
        "value 'g' (result of op 'fancy' (FancyGelu)) has no static shape after shape inference "
        "and folding: [unknown]; shape inference does not know op type 'FancyGelu' of domain "
        "'com.example'"
    )


def test_unknown_domain_op_with_declared_shape_imports(tmp_path):
    """value_info from the exporter gives the custom op's result a shape: that is enough."""
    nodes = [helper.make_node("FancyGelu", ["x"], ["y"], name="fancy", domain="com.example")]
    proto = model(nodes, [tensor("x", F32, ["n", 3])], [tensor("y", F32, ["n", 3])])
    proto.opset_import.append(helper.make_opsetid("com.example", 1))
    graph = import_onnx(save(proto, tmp_path), {"n": 5})
    assert graph.ops[0].domain == "com.example" and graph.values["y"].shape == (5, 3)


def test_data_dependent_shape_is_rejected(tmp_path):
    nodes = [helper.make_node("NonZero", ["x"], ["idx"], name="nz")]
    proto = model(nodes, [tensor("x", F32, [4])], [tensor("idx", I64, None)])
    with pytest.raises(ModelError) as exc_info:
        import_onnx(save(proto, tmp_path))
    assert one_line_error(exc_info) == (
        "value 'idx' (result of op 'nz' (NonZero)) has no static shape after shape inference and "
        "folding: [1, ?]; NonZero results have data-dependent shapes"
    )


def test_reading_an_undefined_value_is_rejected(tmp_path):
    nodes = [helper.make_node("Add", ["x", "ghost"], ["y"], name="add")]
    proto = model(nodes, [tensor("x", F32, [4])], [tensor("y", F32, [4])])
    with pytest.raises(ModelError) as exc_info:
        import_onnx(save(proto, tmp_path))
    assert one_line_error(exc_info) == (
        "op 'add' (Add) reads 'ghost', which no node, graph input or initializer defines"
    )


def test_cycle_is_rejected(tmp_path):
    nodes = [
        helper.make_node("Add", ["x", "b"], ["a"], name="first"),
        helper.make_node("Neg", ["a"], ["b"], name="second"),
    ]
    proto = model(nodes, [tensor("x", F32, [4])], [tensor("b", F32, [4])])
    path = save(proto, tmp_path)
    with pytest.raises(ModelError) as exc_info:
        import_onnx(path)
    assert one_line_error(exc_info) == f"model '{path}' has a cycle through op 'first' (Add)"


def test_sparse_initializer_is_rejected(tmp_path):
    proto = matmul_chain()
    values = numpy_helper.from_array(np.array([1.0], np.float32), "S")
    indices = numpy_helper.from_array(np.array([0], np.int64), "S_idx")
    proto.graph.sparse_initializer.append(helper.make_sparse_tensor(values, indices, [4]))
    path = save(proto, tmp_path)
    with pytest.raises(ModelError, match="sparse initializers are not supported"):
        import_onnx(path, {"batch": 1})


def test_shape_inference_failure_is_explained(tmp_path):
    """A model that cannot run at the bound sizes (here a broadcast mismatch): the error carries
    strict inference's reason."""
    nodes = [helper.make_node("Expand", ["x", "shape"], ["y"], name="expand")]
    inits = {"shape": np.array([2, 4], np.int64)}
    proto = model(nodes, [tensor("x", F32, ["n"])], [tensor("y", F32, None)], inits)
    path = save(proto, tmp_path)
    assert import_onnx(path, {"n": 4}).values["y"].shape == (2, 4)
    with pytest.raises(ModelError) as exc_info:
        import_onnx(path, {"n": 3})
    message = one_line_error(exc_info)
    assert message.startswith("value 'y' (result of op 'expand' (Expand)) has no static shape")
    assert message.endswith("node name: expand): [ShapeInferenceError] Incompatible dimensions")


def test_input_without_shape_is_rejected(tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu")]
    path = save(model(nodes, [tensor("x", F32, None)], [tensor("y", F32, None)]), tmp_path)
    with pytest.raises(ModelError) as exc_info:
        import_onnx(path)
    assert one_line_error(exc_info) == "graph input 'x' has no shape (not even a rank)"


def test_output_nothing_computes_is_rejected(tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu")]
    proto = model(nodes, [tensor("x", F32, [2])], [tensor("y", F32, [2]), tensor("z", F32, [2])])
    path = save(proto, tmp_path)
    with pytest.raises(ModelError) as exc_info:
        import_onnx(path)
    assert one_line_error(exc_info) == f"graph output 'z' is not computed by any op of '{path}'"
