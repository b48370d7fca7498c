"""The "MLP 1D weight stationary" of docs/design/propagation.md on mesh [2], both versions:
annotations on tensors, and a sharding option on the second dot. Completed annotations and the
collectives that materialization needs (planned by the same `plan_reshard` that prices them)."""

import pytest

from autoshard.annotations import Annotation, AnnotationError
from autoshard.document.plan_document import describe
from autoshard.errors import AutoshardError
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.plan import RETURN
from autoshard.propagate import ConflictError, propagate
from autoshard.reshard import plan_reshard
from autoshard.sharding import Sharding, ShardingOption

from .seed_models import write_seed_mlp


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("seed001")
    return import_onnx(write_seed_mlp(folder / "mlp.onnx", "mlp"))


S = Sharding.parse
MESH = Mesh((2,))
EXPECTED_OPTIONS = {"dot1": "[[], [], [0]]", "max": "[[], [], [0]]", "dot2": "[[], [], [], [0]]"}
EXPECTED_VALUES = {
    "x": "[[], [], [0]]",
    "w1": "[[], [0]]",
    "w2": "[[0]]",
    "h": "[[], [], [0]]",
    "r": "[[], [], [0]]",
    "y": "[[]] partial = sum[0]",
    "zero": "[[]]",
}
# Where a consumer needs another sharding than the value is held in: the materialized
# program has exactly these three collectives.
EXPECTED_COLLECTIVES = [
    ("dot1", 0, "x", "all_gather mesh_axes = [0] gather_axis = 2"),
    ("max", 1, "zero", "all_slice mesh_axes = [0] slice_axis = 2"),
    (RETURN, 0, "y", "reduce_scatter mesh_axes = [0] reduction = sum scatter_axis = 2"),
]


def collectives(graph, result):
    found = []
    uses = [(op.name, i, name) for op in graph.ops for i, name in enumerate(op.inputs)]
    uses += [(RETURN, i, name) for i, name in enumerate(graph.outputs)]
    for op, i, name in uses:
        plan = plan_reshard(
            result.values[name], result.needs[(op, i)], graph.values[name].shape, MESH
        )
        found += [(op, i, name, str(c)) for c in plan]
    return found


def check(graph, result):
    assert {k: str(v) for k, v in result.options.items()} == EXPECTED_OPTIONS
    assert {k: str(v) for k, v in result.values.items()} == EXPECTED_VALUES
    assert collectives(graph, result) == EXPECTED_COLLECTIVES
    assert result.unruled == ()


def test_annotations_on_tensors(mlp):
    annotations = [
        Annotation("x", S("[[], [], [0]]")),
        Annotation("y", S("[[]] partial = sum[0]")),
        Annotation("y", S("[[], [], [0]]"), for_users=True),
    ]
    result = propagate(mlp, MESH, annotations)
    check(mlp, result)
    # The completion marks dot1's lhs replicated (`sharding = []`) and W1 [[], [0]].
    assert str(result.needs[("dot1", 0)]) == "[[]]"
    assert str(result.needs[("dot1", 1)]) == "[[], [0]]"
    # Held partial, returned as the program's %15 reads it (after its reduce_scatter).
    assert describe(result, mlp)["values"]["y"] == {
        "sharding": "[[], [], []]", "partial": "sum[0]", "returned_as": "[[], [], [0]]",
    }  # fmt: skip


def test_sharding_option_on_operation(mlp):
    annotations = [
        Annotation("x", S("[[], [], [0]]")),
        Annotation("y", S("[[], [], [0]]"), for_users=True),
    ]
    result = propagate(
        mlp, MESH, annotations, {"dot2": ShardingOption.parse("[[], [], [], [0]]", 4)}
    )
    check(mlp, result)


def test_hint_conflicts_are_resolved_without_error(mlp):
    annotations = [
        Annotation("x", S("[[0]]")),
        Annotation("h", S("[[], [], [0]]"), required=False),
    ]
    result = propagate(mlp, MESH, annotations)
    # An op reads its results first: the hint on h puts dot1's n loop on axis 0, and
    # x's required batch split, which would need axis 0 too, is skipped without error; x stays
    # held as required and dot1 reads it gathered.
    assert str(result.options["dot1"]) == "[[], [], [0]]"
    assert str(result.values["x"]) == "[[0]]" and str(result.needs[("dot1", 0)]) == "[[]]"


def test_required_conflict_names_op_values_and_shardings(mlp):
    # Both bind dot2 (for-users: how dot2 must read them) and need mesh axis 0 on two loops.
    annotations = [
        Annotation("r", S("[[0]]"), for_users=True),
        Annotation("w2", S("[[], [0]]"), for_users=True),
    ]
    with pytest.raises(ConflictError) as error:
        propagate(mlp, MESH, annotations)
    message = str(error.value)
    assert "op 'dot2' (MatMul)" in message
    assert "'r' as [[0]]" in message and "'w2' as [[], [0]]" in message


def test_held_sharding_of_an_operand_does_not_bind_its_user(mlp):
    # Required result-side annotations of two operands only say how they are held: dot2 picks
    # its option from the first and reads the second resharded, without error.
    annotations = [Annotation("r", S("[[0]]")), Annotation("w2", S("[[], [0]]"))]
    result = propagate(mlp, MESH, annotations)
    assert str(result.options["dot2"]) == "[[0]]"
    assert str(result.values["w2"]) == "[[], [0]]" and str(result.needs[("dot2", 1)]) == "[[]]"


def test_one_value_with_two_required_shardings_is_an_error(mlp):
    # Annotating one result with two different shardings is undefined; the
    # annotations are refused as given, before propagation (the search refuses them alike).
    annotations = [Annotation("h", S("[[0]]")), Annotation("h", S("[[], [], [0]]"))]
    with pytest.raises(AnnotationError, match=r"of 'h': \[\[0\]\] and \[\[\], \[\], \[0\]\]"):
        propagate(mlp, MESH, annotations)


@pytest.mark.parametrize(
    "loops, message",
    [
        (((), (), (0,)), "has 3 loops; the op has 4"),
        (((0,), (), (), (0,)), "mesh axis 0 splits on dims 0 and 3"),
        (((), (), (), (1,)), "unknown mesh axis 1"),
    ],
)
def test_fixed_options_are_checked(mlp, loops, message):
    with pytest.raises(AutoshardError) as error:
        propagate(mlp, MESH, [], {"dot2": ShardingOption(loops)})
    assert message in str(error.value)
