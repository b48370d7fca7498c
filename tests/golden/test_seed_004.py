"""The "2D weight-stationary" MLP (docs/design/propagation.md) on mesh 2x2x2: propagated annotations
and the materialized collectives (all_gather over [1, 2], all_reduce over [0], reduce_scatter over
[1, 2]). The design page writes partial axes as a trailing entry: its `[[], [], [1, 2], [0]]` for a
2x4x32 value is `[[], [], [1, 2]] partial = sum[0]` here."""

import pytest

from autoshard.annotations import Annotation
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.passes.materialize import materialize
from autoshard.propagate import propagate
from autoshard.sharding import Sharding

from .seed_models import write_seed_mlp

S = Sharding.parse
MESH = Mesh((2, 2, 2))


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("seed004")
    return import_onnx(write_seed_mlp(folder / "mlp.onnx", "mlp_2d_weight_stationary"))


ANNOTATIONS = [
    Annotation("x", S("[[], [], [0, 1, 2]]")),
    Annotation("h", S("[[], [], [1, 2]] partial = sum[0]")),
    Annotation("y", S("[[], [], [0]] partial = sum[1, 2]")),
    Annotation("y", S("[[], [], [0, 1, 2]]"), for_users=True),
]


def test_propagation(mlp):
    result = propagate(mlp, MESH, ANNOTATIONS)
    assert {k: str(v) for k, v in result.options.items()} == {
        "dot1": "[[], [], [1, 2], [0]]",
        "max": "[[], [], [1, 2]]",
        "dot2": "[[], [], [0], [1, 2]]",
    }
    # The completed annotations: W1 [[0], [1, 2]], W2 [[1, 2], [0]], dot1 reads x as
    # [[], [], [0]], max and dot2 read [[], [], [1, 2]].
    assert str(result.values["w1"]) == "[[0], [1, 2]]"
    assert str(result.values["w2"]) == "[[1, 2], [0]]"
    assert str(result.needs[("dot1", 0)]) == "[[], [], [0]]"
    assert str(result.needs[("max", 0)]) == "[[], [], [1, 2]]"
    assert str(result.needs[("dot2", 0)]) == "[[], [], [1, 2]]"


def test_materialization(mlp):
    program = materialize(mlp, propagate(mlp, MESH, ANNOTATIONS))
    steps = [(program.tensors[s.source].value, str(s.collective)) for s in program.communications]
    assert steps == [
        ("x", "all_gather mesh_axes = [1, 2] gather_axis = 2"),
        ("h", "all_reduce mesh_axes = [0] reduction = sum"),
        ("zero", "all_slice mesh_axes = [1, 2] slice_axis = 2"),
        ("y", "reduce_scatter mesh_axes = [1, 2] reduction = sum scatter_axis = 2"),
    ]
