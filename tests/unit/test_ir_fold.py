"""What the shape folder folds, and what it must leave alone."""

import numpy as np
import pytest
from onnx import helper, numpy_helper
from onnx_factory import F32, I64, model, rng_weight, save, tensor

from autoshard.ir import fold
from autoshard.ir.fold import TensorType, fold_shapes
from autoshard.ir.onnx_import import import_onnx

n = helper.make_node


def import_nodes(tmp_path, nodes, inputs, inits=(), dims=None, opset=17):
    proto = model(nodes, inputs, [tensor(nodes[-1].output[0], F32, None)], inits, opset=opset)
    return import_onnx(save(proto, tmp_path), dims)


def test_float_parameter_is_not_folded_but_float_scalar_is(tmp_path):
    """Transpose(W) of a weight stays an op (a parameter must stay a parameter, data or not);
    Sqrt of a scalar initializer is a constant."""
    nodes = [
        n("Transpose", ["W"], ["Wt"], name="wt"),
        n("Sqrt", ["d"], ["scale"], name="sqrt"),
        n("MatMul", ["x", "Wt"], ["h"], name="mm"),
        n("Div", ["h", "scale"], ["y"], name="div"),
    ]
    inits = {"W": rng_weight((4, 3)), "d": np.array(16.0, np.float32)}
    graph = import_nodes(tmp_path, nodes, [tensor("x", F32, [2, 3])], inits)
    assert [op.name for op in graph.ops] == ["wt", "mm", "div"]
    np.testing.assert_array_equal(graph.constants["scale"], np.float32(4.0))


@pytest.mark.parametrize("op_type", ["RandomUniformLike", "RandomNormalLike"])
def test_random_ops_are_never_folded(tmp_path, op_type):
    nodes = [
        n("Shape", ["x"], ["s"], name="shape"),
        n("Cast", ["s"], ["sf"], to=F32, name="cast"),
        n(op_type, ["sf"], ["r"], name="random"),
        n("Add", ["r", "x"], ["y"], name="add"),
    ]
    graph = import_nodes(tmp_path, nodes, [tensor("x", F32, [2])])
    assert [op.name for op in graph.ops] == ["random", "add"]


def test_other_domain_ops_are_never_folded(tmp_path):
    nodes = [
        n("Shape", ["x"], ["s"], name="shape"),
        n("Mystery", ["s"], ["m"], name="mystery", domain="com.example"),
        n("Add", ["x", "x"], ["y"], name="add"),
    ]
    proto = model(nodes, [tensor("x", F32, [2])], [tensor("y", F32, None)],
                  value_info=[tensor("m", I64, [1])])  # fmt: skip
    proto.opset_import.append(helper.make_opsetid("com.example", 1))
    graph = import_onnx(save(proto, tmp_path))
    assert [op.name for op in graph.ops] == ["mystery", "add"]


def test_shape_with_start_end_and_size(tmp_path):
    nodes = [
        n("Shape", ["x"], ["mid"], start=1, end=-1, name="mid"),
        n("Size", ["x"], ["count"], name="size"),
        n("Relu", ["x"], ["y"], name="relu"),
    ]
    graph = import_nodes(tmp_path, nodes, [tensor("x", F32, ["a", 3, 5, 7])], dims={"a": 2})
    np.testing.assert_array_equal(graph.constants["mid"], [3, 5])
    np.testing.assert_array_equal(graph.constants["count"], 210)
    assert graph.constants["count"].dtype == np.int64


def test_range_result_needs_a_second_round(tmp_path):
    """Range's result size is unknown until its limit is an initializer: round 1 folds the
    limit, round 2 the Range (it is never evaluated blind: it may expand)."""
    nodes = [
        n("Shape", ["x"], ["s"], name="shape"),
        n("Squeeze", ["s"], ["len"], name="squeeze"),
        n("Range", ["zero", "len", "one"], ["pos"], name="range"),
        n("Cast", ["pos"], ["posf"], to=F32, name="cast"),
        n("Add", ["x", "posf"], ["y"], name="add"),
    ]
    inputs = [tensor("x", F32, [5])]
    proto = model(nodes, inputs, [tensor("y", F32, None)])
    sources = {"zero": np.array(0, np.int64), "one": np.array(1, np.int64)}
    proto.graph.input.extend([tensor("zero", I64, []), tensor("one", I64, [])])
    result = fold_shapes(proto, sources)
    assert [node.name for node in result.nodes] == ["add"]
    np.testing.assert_array_equal(result.constants["posf"], np.arange(5, dtype=np.float32))
    assert result.rounds == 3  # round 3 folds nothing: the fixed point
    assert result.types["y"] == TensorType(1, (5,))


def _reshape_by_shape_code() -> tuple:
    """x.view(b, 3, 4) as exporters write it: Shape -> Gather -> Unsqueeze -> Concat ->
    Reshape, x float32[2, 12]; the model and its sources."""
    nodes = [
        n("Shape", ["x"], ["s"], name="shape"),
        n("Gather", ["s", "zero"], ["b"], axis=0, name="gather"),
        n("Unsqueeze", ["b", "zero1"], ["b1"], name="unsqueeze"),
        n("Concat", ["b1", "tail"], ["t"], axis=0, name="concat"),
        n("Reshape", ["x", "t"], ["y"], name="reshape"),
    ]
    proto = model(nodes, [tensor("x", F32, [2, 12])], [tensor("y", F32, None)])
    sources = {"zero": np.array(0, np.int64), "zero1": np.array([0], np.int64),
               "tail": np.array([3, 4], np.int64)}  # fmt: skip
    proto.graph.input.extend(
        [tensor("zero", I64, []), tensor("zero1", I64, [1]), tensor("tail", I64, [2])]
    )
    return proto, sources


def _watched(monkeypatch) -> list[bool]:
    """Each inference's `data_prop`, as fold_shapes runs them."""
    runs: list[bool] = []
    infer_types = fold.infer_types

    def watched(model, data_prop=True):
        runs.append(data_prop)
        return infer_types(model, data_prop)

    monkeypatch.setattr(fold, "infer_types", watched)
    return runs


def test_folding_sees_through_shape_code_without_data_propagation(monkeypatch):
    """Round 1 (inference without data propagation: y's dims unknown) folds the shape code,
    round 2's inference knows y from the folded target, and folds nothing more: data
    propagation (ten times the cost on a large model) never runs, and the types are what it
    gives on the folded model."""
    proto, sources = _reshape_by_shape_code()
    runs = _watched(monkeypatch)
    result = fold_shapes(proto, sources)
    assert [node.name for node in result.nodes] == ["reshape"]
    assert result.rounds == 2 and runs == [False, False]
    assert result.types["y"] == TensorType(1, (2, 3, 4))
    assert result.types == fold.infer_types(result.model, data_prop=True)


def test_data_propagation_runs_where_folding_stalls(monkeypatch):
    """With folding that folds nothing, the shape code stays, and only inference with data
    propagation sees through it to y's type."""
    proto, sources = _reshape_by_shape_code()
    monkeypatch.setattr(fold, "_fold_pass", lambda nodes, *_: (nodes, {}))
    runs = _watched(monkeypatch)
    result = fold_shapes(proto, sources)
    assert runs == [False, True] and result.rounds == 2
    assert result.types["y"] == TensorType(1, (2, 3, 4))


def test_the_last_round_is_derived_when_inference_knew_every_type(monkeypatch):
    """Every type is known in round 1 (x's size read as a shape, scaled), yet the pass folds
    something: round 2 is derived, not run, and its types are what running inference on the
    folded model gives (the folded values typed as their initializers)."""
    nodes = [
        n("Shape", ["x"], ["s"], name="shape"),
        n("Mul", ["s", "two"], ["t"], name="twice"),
        n("Relu", ["x"], ["y"], name="relu"),
    ]
    proto = model(nodes, [tensor("x", F32, [2, 12])], [tensor("y", F32, None)])
    proto.graph.input.append(tensor("two", I64, [1]))
    runs = _watched(monkeypatch)
    result = fold_shapes(proto, {"two": np.array([2], np.int64)})
    assert [node.name for node in result.nodes] == ["relu"]
    np.testing.assert_array_equal(result.constants["t"], [4, 24])
    assert result.rounds == 2 and runs == [False]
    assert result.types["t"] == TensorType(7, (2,))
    assert result.types == fold.infer_types(result.model)


def test_node_the_evaluator_cannot_run_stays_and_says_why(tmp_path):
    nodes = [n("Gather", ["table", "idx"], ["g"], axis=0, name="gather")]
    proto = model(nodes, [], [tensor("g", I64, None)])
    sources = {"table": np.arange(3, dtype=np.int64), "idx": np.array([7], np.int64)}
    result = fold_shapes(proto, sources)
    assert [node.name for node in result.nodes] == ["gather"]
    assert result.failures["gather"].startswith("IndexError")


def test_limit_bounds_what_is_materialized(tmp_path):
    nodes = [n("Tile", ["t", "reps"], ["big"], name="tile")]
    proto = model(nodes, [], [tensor("big", I64, None)])
    sources = {"t": np.arange(10, dtype=np.int64), "reps": np.array([10], np.int64)}
    assert [node.name for node in fold_shapes(proto, sources, limit=99).nodes] == ["tile"]
    assert fold_shapes(proto, sources, limit=100).nodes == ()


def test_folding_source_tensors_are_not_modified(tmp_path):
    nodes = [n("Neg", ["t"], ["u"], name="neg")]
    proto = model(nodes, [], [tensor("u", I64, None)])
    t = np.arange(3, dtype=np.int64)
    before = proto.SerializeToString()
    result = fold_shapes(proto, {"t": t})
    np.testing.assert_array_equal(result.constants["u"], [0, -1, -2])
    np.testing.assert_array_equal(t, [0, 1, 2])
    assert proto.SerializeToString() == before


def test_constant_node_forms_are_evaluated(tmp_path):
    nodes = [
        n("Constant", [], ["ints"], value_ints=[1, 2], name="c1"),
        n("Constant", [], ["f"], value_float=0.5, name="c2"),
        n("Constant", [], ["t"], value=numpy_helper.from_array(np.eye(2, dtype=np.float32)),
          name="c3"),
        n("Add", ["x", "f"], ["y"], name="add"),
    ]  # fmt: skip
    graph = import_nodes(tmp_path, nodes, [tensor("x", F32, [2])])
    assert [op.name for op in graph.ops] == ["add"]
    assert graph.values["ints"].dtype == "int64" and graph.values["f"].shape == ()
    np.testing.assert_array_equal(graph.constants["t"], np.eye(2))


@pytest.mark.parametrize("axis", [1, -1])
def test_gather_elements_over_many_choices_folds(tmp_path, axis):
    """onnx.reference's GatherElements fails past 32 choices (np.choose); BERT slices its
    token_type_ids buffer [1, 128] this way."""
    nodes = [n("GatherElements", ["table", "idx"], ["g"], axis=axis, name="ge")]
    proto = model(nodes, [], [tensor("g", I64, None)])
    table = np.arange(128, dtype=np.int64).reshape(1, 128) * 10
    idx = np.array([[0, 5, 127, -1]], np.int64)
    result = fold_shapes(proto, {"table": table, "idx": idx})
    assert result.nodes == ()
    np.testing.assert_array_equal(result.constants["g"], [[0, 50, 1270, 1270]])


def test_results_take_the_onnx_element_type(monkeypatch):
    """A kernel computing in float64 for a float32 op: the constant is float32."""
    monkeypatch.setitem(fold._KERNELS, ("", "Neg"), lambda node, x: -x.astype(np.float64))
    nodes = [n("Neg", ["t"], ["u"], name="neg")]
    proto = model(nodes, [], [tensor("u", F32, None)])
    result = fold_shapes(proto, {"t": np.array(2.0, np.float32)})
    assert result.constants["u"].dtype == np.float32 and result.constants["u"] == -2.0


def test_result_contradicting_inference_is_not_folded(monkeypatch):
    monkeypatch.setitem(fold._KERNELS, ("", "Neg"), lambda node, x: np.zeros(3, x.dtype))
    nodes = [n("Neg", ["t"], ["u"], name="neg")]
    proto = model(nodes, [], [tensor("u", I64, None)])
    result = fold_shapes(proto, {"t": np.array([1, 2], np.int64)})
    assert [node.name for node in result.nodes] == ["neg"]
    assert result.failures["neg"] == "evaluated 'u' as [3], inferred [2]"


def test_runtime_shape_inference_leaves_no_file_in_the_working_directory(tmp_path, monkeypatch):
    """onnxruntime's symbolic shape inference saves its model as sym_shape_infer_temp.onnx in
    the working directory when it cannot infer every shape (here: an op of an unknown domain);
    the import's types are then none, and the user's directory is as it was."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.onnx").write_bytes(b"kept")
    nodes = [helper.make_node("Foo", ["x"], ["y"], domain="custom")]
    proto = model(nodes, [tensor("x", F32, ["b", 64])], [tensor("y", F32, None)], {})
    proto.opset_import.append(helper.make_opsetid("custom", 1))
    assert fold._runtime_types(proto) == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.onnx"]
