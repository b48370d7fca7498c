"""Propagation on the bundled models from a single annotation on the input (batch split), and
from the data-parallel baseline (every batch input split)."""

import functools
from pathlib import Path

import pytest

from autoshard.annotations import Annotation
from autoshard.collectives import CollectiveKind
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.passes.materialize import materialize
from autoshard.plan import RETURN
from autoshard.propagate import propagate
from autoshard.reshard import plan_reshard
from autoshard.search.baselines import data_parallel
from autoshard.sharding import Sharding

MODELS = Path(__file__).resolve().parents[2] / "models"
CASES = {
    "mlp": ({"batch": 8}, "x"),
    "cnn": ({"batch": 8}, "image"),
    "gpt2": ({"batch": 8, "seq": 16}, "input_ids"),
    "gpt2_dynamo": ({"batch": 8, "seq": 16}, "input_ids"),
    "bert": ({"batch": 8, "seq": 16}, "input_ids"),
    "decoder_32l_shape_only": ({"batch": 8, "seq": 256}, "input_ids"),
}


@pytest.mark.parametrize("name", CASES)
def test_data_parallel_needs_no_communication(name):
    dims, first_input = CASES[name]
    graph = import_onnx(MODELS / f"{name}.onnx", dims)
    mesh = Mesh((2, 4))
    result = propagate(graph, mesh, [Annotation(first_input, Sharding.parse("[[0]]"))])
    assert result.unruled == ()
    # The batch split reaches every output...
    assert [str(result.values[o]) for o in graph.outputs] == ["[[0]]"] * len(graph.outputs)
    # ...and no use needs data from another device: at most a free local slice of a
    # replicated constant or weight (e.g. a mask or position table cut to the local batch).
    uses = [(op.name, i, x) for op in graph.ops for i, x in enumerate(op.inputs) if x]
    uses += [(RETURN, i, x) for i, x in enumerate(graph.outputs)]
    for op, i, value in uses:
        plan = plan_reshard(
            result.values[value], result.needs[(op, i)], graph.values[value].shape, mesh
        )
        assert all(c.kind is CollectiveKind.ALL_SLICE for c in plan), (op, value, plan)


@functools.cache
def _graph(name):
    return import_onnx(MODELS / f"{name}.onnx", CASES[name][0])


@pytest.mark.parametrize("axes", [(0,), (0, 1)], ids=["dp-axis0", "dp-axes01"])
@pytest.mark.parametrize("name", CASES)
def test_data_parallel_baseline_needs_no_communication(name, axes):
    # Every batch input split (BERT's attention mask too, whose constant-id gathers stay
    # local): the materialized program moves nothing; at most it slices replicated constants.
    graph, mesh = _graph(name), Mesh((2, 4))
    annotations = data_parallel(graph, mesh, axes)
    assert [a.value for a in annotations] == list(graph.inputs)
    program = materialize(graph, propagate(graph, mesh, annotations))
    kinds = {step.collective.kind for step in program.communications}
    assert kinds <= {CollectiveKind.ALL_SLICE} and program.bytes_per_device == 0, kinds
