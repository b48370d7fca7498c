"""Partial sums added before they are reduced (`search.partials`): ops that commute with a sum
(Add, Sub, Sum, Neg) computing on partial values, partitioned, run on every device and compared
with onnxruntime; the program reduces once, after them."""

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
from autoshard.sharding import Sharding, ShardingOption

from .test_partition import check_numerics


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
    reducing = (CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER)
    reduced = [c for c in program.communications if c.collective.kind in reducing]
    assert [(c.source, c.collective.kind, c.collective.mesh_axes) for c in reduced] == [
        ("out", CollectiveKind.ALL_REDUCE, axes)
    ]
    check_numerics(graph, model, partition(program, graph))
