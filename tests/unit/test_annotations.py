"""check_annotations: what every face (plan, propagate, why-not, the service) refuses before a
search, with one line naming the value and both shardings."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoshard.annotations import Annotation, AnnotationError, check_annotations
from autoshard.cli.main import main
from autoshard.mesh import Mesh
from autoshard.sharding import Sharding

MLP = Path(__file__).resolve().parents[2] / "models" / "mlp.onnx"
SHAPES = {"w": (8, 4)}


def pin(spec: str, required: bool = True, for_users: bool = False) -> Annotation:
    return Annotation("w", Sharding.parse(spec), required, for_users)


@pytest.mark.parametrize(
    "annotations",
    [
        [pin("[[0]]"), pin("[[0], []]")],  # the same sharding, spelled twice
        [pin("[[0]]"), pin("[[1]]", required=False)],  # a hint yields to the pin
        [pin("[[0]]"), pin("[[1]]", for_users=True)],  # held one way, read another
    ],
    ids=["same-twice", "hint", "result-and-users"],
)
def test_compatible_annotations_pass(annotations):
    check_annotations(annotations, SHAPES, Mesh.parse("2x2"))


@pytest.mark.parametrize("for_users", [False, True], ids=["result", "users"])
def test_two_required_pins_of_one_side_conflict(for_users):
    annotations = [pin("[[0]]", for_users=for_users), pin("[[], [1]]", for_users=for_users)]
    with pytest.raises(AnnotationError) as error:
        check_annotations(annotations, SHAPES, Mesh.parse("2x2"))
    assert str(error.value) == "conflicting required annotations of 'w': [[0]] and [[], [1]]"


def test_plan_refuses_conflicting_annotations(capsys):
    """The search took the first pin of a weight and said nothing."""
    flags = ["--annotate", "0.weight=[[0], []]", "--annotate", "0.weight=[[], []]"]
    assert main(["plan", str(MLP), "--mesh", "2x2", "--dim", "batch=8", *flags]) == 2
    assert capsys.readouterr().err == (
        "autoshard: error: conflicting required annotations of '0.weight': [[0]] and [[]]\n"
    )
