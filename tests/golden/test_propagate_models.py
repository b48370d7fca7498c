"""Propagation on the bundled models from a single annotation on the input (batch split)."""

from pathlib import Path

import pytest

from autoshard.annotations import Annotation
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.plan import RETURN
from autoshard.propagate import propagate
from autoshard.reshard import CollectiveKind, plan_reshard
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
