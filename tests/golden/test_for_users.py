"""A required annotation for users (`mesh.shard ... annotate_for_users`, `as_result = false`:
docs/design/propagation.md) says how every user of a value reads it: each op reading it, and the
return of a graph output, reads it so, a reshard coming between where the value is held
otherwise. `autoshard propagate` and `autoshard plan` (the search) alike."""

from __future__ import annotations

import re

import pytest
from onnx import helper

from autoshard.annotations import Annotation
from autoshard.cost.cluster import make_cluster
from autoshard.document.plan_document import plan_from_document
from autoshard.errors import AutoshardError
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.passes.lower import lower
from autoshard.pipeline import PlanRequest, plan_request
from autoshard.plan import RETURN
from autoshard.propagate import propagate
from autoshard.sharding import Sharding
from tests.unit.onnx_factory import F32, model, reshapes, save, tensor

n = helper.make_node


def held(value, text):
    return Annotation(value, Sharding.parse(text))


def read(value, text):
    return Annotation(value, Sharding.parse(text), for_users=True)


CASES = {
    # The explain helper's "heads" case: o split on the batch pulls the heads Reshape to read
    # x split; x read whole is required, so it reads x whole and the split comes after it
    # (a free all_slice of s), not an all_slice of x before it.
    "heads": [read("x", "[[]]"), held("o", "[[0]]")],
    # The same with m split on its rows: the rows Reshape reads x whole, the MatMul slices r.
    "rows": [read("x", "[[]]"), held("m", "[[0]]")],
    # x read split on the batch although o wants the heads split: an all_to_all after.
    "split-read": [read("x", "[[0]]"), held("o", "[[], [0]]")],
    # A graph output returned as its users (the return) read it: split on the features.
    "output": [read("m", "[[], [0]]"), held("o", "[[0]]")],
}


def readers(graph, value):
    uses = [
        (op.name, i) for op in graph.consumers(value) for i, v in enumerate(op.inputs) if v == value
    ]
    return uses + [(RETURN, i) for i, v in enumerate(graph.outputs) if v == value]


def assert_read_as_annotated(graph, plan, annotations):
    for a in annotations:
        if a.for_users:
            assert readers(graph, a.value)
            for use in readers(graph, a.value):
                assert plan.needs[use] == a.sharding, (use, str(plan.needs[use]))
        else:
            assert plan.values[a.value] == a.sharding


@pytest.mark.parametrize("annotations", CASES.values(), ids=CASES)
def test_propagate_reads_as_annotated_for_users(tmp_path, annotations):
    graph = import_onnx(save(reshapes(), tmp_path))
    plan = propagate(graph, Mesh.parse("2"), annotations)
    assert_read_as_annotated(graph, plan, annotations)


@pytest.mark.parametrize("annotations", CASES.values(), ids=CASES)
def test_plan_reads_as_annotated_for_users(tmp_path, annotations):
    path = save(reshapes(), tmp_path)
    requested = plan_request(PlanRequest(model_path=path, cluster=make_cluster("2"), dims={},
                                         annotations=tuple(annotations)))  # fmt: skip
    graph, plan = requested.graph, requested.planned.plan
    assert_read_as_annotated(graph, plan, annotations)
    # The plan file says it: read back, the plan reads and returns the same.
    again = plan_from_document(requested.document, graph, plan.mesh)
    assert again.needs == plan.needs


def test_the_reshard_comes_after_the_reader(tmp_path):
    """The heads case lowered: x is read whole by both Reshapes; the split to o's batch is one
    free all_slice of s (the heads Reshape's result), and nothing moves x."""
    graph = import_onnx(save(reshapes(), tmp_path))
    program = lower(graph, propagate(graph, Mesh.parse("2"), CASES["heads"]))
    moved = [
        (program.tensors[c.source].value, c.collective.kind.value, c.collective.bytes_per_device)
        for c in program.communications
    ]
    assert moved == [("s", "all_slice", 0)]


def test_split_read_reshards_after_the_reader(tmp_path):
    """x read split on the batch, o held split on the heads: the heads Reshape reads x as
    required and an all_to_all (1/2 of a 384 B shard sent) brings its result to the heads."""
    graph = import_onnx(save(reshapes(), tmp_path))
    plan = propagate(graph, Mesh.parse("2"), CASES["split-read"])
    program = lower(graph, plan)
    moved = [(c.collective.kind.value, c.collective.bytes_per_device)
             for c in program.communications if c.collective.bytes_per_device]  # fmt: skip
    assert moved == [("all_to_all", 192)]


def unruled(path):
    """y[4] = Det(x[4, 3, 3]): Det has no sharding rule (computed whole)."""
    nodes = [n("Det", ["x"], ["y"], name="det")]
    return save(model(nodes, [tensor("x", F32, [4, 3, 3])], [tensor("y", F32, [4])]), path)


def test_an_op_without_a_rule_cannot_read_split(tmp_path):
    path = unruled(tmp_path)
    graph = import_onnx(path)
    message = ("op 'det' (Det) cannot read 'x' as its required annotation for users asks, "
               "[[0]]: no rule")  # fmt: skip
    with pytest.raises(AutoshardError, match=re.escape(message)):
        propagate(graph, Mesh.parse("2"), [read("x", "[[0]]")])
    with pytest.raises(AutoshardError) as error:
        plan_request(PlanRequest(model_path=path, cluster=make_cluster("2"), dims={},
                                 annotations=(read("x", "[[0]]"),)))  # fmt: skip
    assert str(error.value) == message
    # Read whole as it is anyway: nothing to refuse.
    plan = propagate(graph, Mesh.parse("2"), [read("x", "[[]]")])
    assert plan.needs[("det", 0)] == Sharding()
