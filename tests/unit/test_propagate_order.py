"""Which annotation wins when two cannot both be kept (issue 47): the first one read, as in
upstream MLIR's `sharding-propagation` (LLVM 22), which tries an op's annotations results first,
then operands in order, and keeps the first combination that fits. The fewest-bytes choice of
`propagate` only rescues splits a replicated mark would skip; it never trades one user's
annotation for a later one's. tests/golden/test_upstream_mlir.py runs both cases through
`mlir-opt-22` where it is installed; these expected shardings always run."""

from __future__ import annotations

import pytest
from onnx import helper

from autoshard.annotations import Annotation
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.passes.materialize import materialize
from autoshard.plan import RETURN
from autoshard.propagate import propagate
from autoshard.sharding import Sharding
from tests.unit.onnx_factory import F32, model, save, tensor

S = Sharding.parse


def add_model(path):
    """y[8] = x[8] + z[8]."""
    nodes = [helper.make_node("Add", ["x", "z"], ["y"], name="add")]
    inputs = [tensor("x", F32, [8]), tensor("z", F32, [8])]
    return save(model(nodes, inputs, [tensor("y", F32, [8])]), path)


def mlp_model(path):
    """The weight-stationary MLP: h = x[8, 16] @ w1[16, 32], a = sigmoid(h), y = a @ w2[32, 16]."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Sigmoid", ["h"], ["a"], name="sig"),
        helper.make_node("MatMul", ["a", "w2"], ["y"], name="mm2"),
    ]
    shapes = {"x": [8, 16], "w1": [16, 32], "w2": [32, 16]}
    inputs = [tensor(name, F32, shape) for name, shape in shapes.items()]
    return save(model(nodes, inputs, [tensor("y", F32, [8, 16])]), path)


ADD_ANNOTATIONS = (Annotation("x", S("[[0]]")), Annotation("z", S("[[1]]")))
MLP_ANNOTATIONS = (
    Annotation("x", S("[[], [0, 1, 2]]")),
    Annotation("w1", S("[[0], [1, 2]]")),
    Annotation("w2", S("[[1, 2], [0]]")),
    Annotation("y", S("[[], [0, 1, 2]]"), for_users=True),
)

# (model, mesh, annotations, options, how each op reads its operands, values as produced,
#  collectives of the materialized program).
CASES = {
    # x and z held on different axes, both for the result: y follows x, the first operand, and
    # z is resharded to [[0]] (upstream: the same); x is not moved.
    "conflicting-operands": (
        add_model, "2x4", ADD_ANNOTATIONS,
        {"add": "[[0]]"},
        {("add", 0): "[[0]]", ("add", 1): "[[0]]", (RETURN, 0): "[[0]]"},
        {"y": "[[0]]"},
        [("z", "all_slice mesh_axes = [0] slice_axis = 0"), ("z", "permute mesh_axes = [0, 1]"),
         ("z", "all_gather mesh_axes = [1] gather_axis = 0")],
    ),
    # y annotated for its users and returned: mm2 produces y as they read it (its n loop over
    # the three axes), so the return reads y as produced and no collective touches y; upstream
    # derives h and a replicated, h from a K-split over the three axes (here partial, reduced
    # before the sigmoid), and reshards both weights.
    "returned-for-users": (
        mlp_model, "2x2x2", MLP_ANNOTATIONS,
        {"mm1": "[[], [], [0, 1, 2]]", "sig": "[[]]", "mm2": "[[], [0, 1, 2]]"},
        {("mm1", 0): "[[], [0, 1, 2]]", ("mm1", 1): "[[0, 1, 2]]", ("sig", 0): "[[]]",
         ("mm2", 0): "[[]]", ("mm2", 1): "[[], [0, 1, 2]]", (RETURN, 0): "[[], [0, 1, 2]]"},
        {"h": "[[]] partial = sum[0, 1, 2]", "a": "[[]]", "y": "[[], [0, 1, 2]]"},
        [("w1", "all_to_all mesh_axes = [1, 2] split_axis = 0 concat_axis = 1"),
         ("h", "all_reduce mesh_axes = [0, 1, 2] reduction = sum"),
         ("w2", "all_to_all mesh_axes = [1, 2] split_axis = 1 concat_axis = 0")],
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    "build, mesh, annotations, options, needs, produced, moved", CASES.values(), ids=CASES
)
def test_the_first_annotation_wins(
    tmp_path, build, mesh, annotations, options, needs, produced, moved
):
    graph = import_onnx(build(tmp_path))
    plan = propagate(graph, Mesh.parse(mesh), annotations)
    assert {op: str(option) for op, option in plan.options.items()} == options
    assert {use: str(plan.needs[use]) for use in needs} == needs
    assert {value: str(plan.produced[value]) for value in produced} == produced
    program = materialize(graph, plan)
    steps = [(program.tensors[s.source].value, str(s.collective)) for s in program.communications]
    assert steps == moved
