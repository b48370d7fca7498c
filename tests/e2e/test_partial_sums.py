"""Partial sums added before they are reduced (`search.partials`): ops that commute with a sum
(Add, Sub, Sum, Neg, and those that only move elements: reshapes, Transpose, Split, Concat,
Slice, Expand) computing on partial values, partitioned, run on every device and compared with
onnxruntime; the program reduces once, after them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from autoshard.collectives import CollectiveKind
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.passes.lower import lower
from autoshard.passes.partition import partition
from autoshard.propagate import propagate
from autoshard.rules import rule_for
from autoshard.sharding import ReductionKind, Sharding, ShardingOption

from .helpers import model_path
from .test_partition import check_numerics

REDUCING = (CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER)


def write_products(path):
    """Four products of x with weights, contracted over 8 features, combined linearly:
    out = Sum(x·a, x·b, x·c) - Neg(x·d) + bias, the bias the column sums of x·e (broadcast,
    [8] onto [4, 8])"""
    rng = np.random.default_rng(3)
    weights = {f"w{n}": rng.standard_normal((8, 8)).astype(np.float32) for n in "abcde"}
    nodes = [helper.make_node("MatMul", ["x", f"w{n}"], [f"p{n}"], name=f"mm{n}") for n in "abcde"]
    nodes += [
        helper.make_node("Sum", ["pa", "pb", "pc"], ["s"], name="sum"),
        helper.make_node("Neg", ["pd"], ["n"], name="neg"),
        helper.make_node("Sub", ["s", "n"], ["diff"], name="sub"),
        helper.make_node("ReduceSum", ["pe", "axes"], ["bias"], name="rows", keepdims=0),
        helper.make_node("Add", ["diff", "bias"], ["out"], name="add"),
    ]
    f32 = TensorProto.FLOAT
    inits = [numpy_helper.from_array(v, n) for n, v in weights.items()]
    inits.append(numpy_helper.from_array(np.array([0], np.int64), "axes"))
    graph = helper.make_graph(
        nodes, "products", [helper.make_tensor_value_info("x", f32, [4, 8])],
        [helper.make_tensor_value_info("out", f32, [4, 8])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("mesh, axes", [((2,), (0,)), ((2, 2), (0, 1)), ((2, 2), (1,))])
def test_partial_sums_are_added_then_reduced_once(tmp_path, mesh, axes):
    model = write_products(tmp_path / "products.onnx")
    graph = import_onnx(model)
    # Four products split their contraction (loop d2) over `axes`: partial sums over them. The
    # bias's product splits its rows, which ReduceSum sums split: partial too. The linear ops
    # keep them partial, and the output is reduced once.
    contracted = ShardingOption(((), (), axes))
    fixed: dict[str, ShardingOption] = {f"mm{n}": contracted for n in "abcd"}
    fixed |= {"mme": ShardingOption((axes, (), ())), "rows": ShardingOption((axes, ()))}
    linear = ShardingOption(((), ()), axes)
    fixed |= {"sum": linear, "neg": linear, "sub": linear, "add": linear}
    plan = propagate(graph, Mesh(mesh), (), fixed)
    assert plan.values["out"] == Sharding((), axes)
    program = lower(graph, plan)
    reduced = [c for c in program.communications if c.collective.kind in REDUCING]
    assert [(c.source, c.collective.kind, c.collective.mesh_axes) for c in reduced] == [
        ("out", CollectiveKind.ALL_REDUCE, axes)
    ]
    check_numerics(graph, model, partition(program, graph))


def write_moves(path):
    """A product of x [4, 8] with w, contracted over 8 features, then only moved: reshaped to
    [4, 2, 4], transposed to [2, 4, 4], split in two on dim 0 and concatenated on dim 2
    ([1, 4, 8]), sliced to rows 1..3 of dim 1, squeezed, unsqueezed and expanded to [3, 2, 8]."""
    rng = np.random.default_rng(5)
    ints = {
        "target": [4, 2, 4], "starts": [1], "ends": [4], "axes1": [1], "axes0": [0],
        "halves": [1, 1], "wide": [3, 2, 8],
    }  # fmt: skip
    inits = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in ints.items()]
    w = rng.standard_normal((8, 8)).astype(np.float32)
    inits.append(numpy_helper.from_array(w, "w"))
    node = helper.make_node
    nodes = [
        node("MatMul", ["x", "w"], ["p"], name="mm"),
        node("Reshape", ["p", "target"], ["r"], name="reshape"),
        node("Transpose", ["r"], ["t"], name="transpose", perm=[1, 0, 2]),
        node("Split", ["t", "halves"], ["h0", "h1"], name="split", axis=0),
        node("Concat", ["h1", "h0"], ["c"], name="concat", axis=2),
        node("Slice", ["c", "starts", "ends", "axes1"], ["s"], name="slice"),
        node("Squeeze", ["s", "axes0"], ["q"], name="squeeze"),
        node("Unsqueeze", ["q", "axes1"], ["u"], name="unsqueeze"),
        node("Expand", ["u", "wide"], ["out"], name="expand"),
    ]
    f32 = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes, "moves", [helper.make_tensor_value_info("x", f32, [4, 8])],
        [helper.make_tensor_value_info("out", f32, [3, 2, 8])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("mesh, axes", [((2,), (0,)), ((2, 2), (0, 1)), ((2, 2), (1,))])
def test_partial_sums_are_moved_then_reduced_once(tmp_path, mesh, axes):
    model = write_moves(tmp_path / "moves.onnx")
    graph = import_onnx(model)
    fixed = {"mm": ShardingOption(((), (), axes))}  # the contraction split: partial sums
    for op in graph.ops[1:]:  # every move reads and writes them unreduced
        rule = rule_for(op, graph)
        assert rule is not None and rule.partial == (ReductionKind.SUM,), op.type
        fixed[op.name] = ShardingOption(((),) * len(rule.loops), axes)
    plan = propagate(graph, Mesh(mesh), (), fixed)
    assert plan.values["out"] == Sharding(((), (), ()), axes)
    program = lower(graph, plan)
    reduced = [c for c in program.communications if c.collective.kind in REDUCING]
    assert [(c.source, c.collective.kind, c.collective.mesh_axes) for c in reduced] == [
        ("out", CollectiveKind.ALL_REDUCE, axes)
    ]
    check_numerics(graph, model, partition(program, graph))


def test_a_row_parallel_product_is_reshaped_then_reduce_scattered_on_the_sequence():
    """GPT-2's dynamo export computes each block's output projections as a 2-D Gemm
    [batch·seq, 64] reshaped to [batch, seq, 64] before the residual Add. A Reshape of [8, 64]
    to [2, 4, 64] carries a split of its rows to the batch only (loop gcd(8, 2) = 2), so the
    sequence split of sequence parallelism cannot pass it. With the Gemms row parallel (partial
    sums) and the Reshapes moving them unreduced, each product is reduce-scattered once, after
    its Reshape, on the sequence dim the Add splits."""
    model = model_path("gpt2_dynamo")
    graph = import_onnx(model, {"batch": 2, "seq": 4})
    row = ShardingOption(((), (), (0,)))
    fixed = {"node_addmm_1": row, "node_addmm_3": row}
    fixed |= {f"node_view_{n}": ShardingOption(((), ()), (0,)) for n in (8, 12)}
    fixed |= {f"node_add_{n}": ShardingOption(((), (0,), ())) for n in (218, 285)}
    plan = propagate(graph, Mesh((2,)), (), fixed)
    assert plan.values["view_8"] == Sharding(((), (), ()), (0,))
    program = lower(graph, plan)
    reduced = [c for c in program.communications if c.collective.kind in REDUCING]
    assert [(c.source, c.collective.kind, c.collective.mesh_axes) for c in reduced] == [
        (f"view_{n}", CollectiveKind.REDUCE_SCATTER, (0,)) for n in (8, 12)
    ]
    check_numerics(graph, model, partition(program, graph))
