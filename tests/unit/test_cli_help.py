"""`--help` names what the commands accept: every choice a training flag takes."""

from __future__ import annotations

import enum
from pathlib import Path

import pytest

from autoshard.cli.main import build_parser
from autoshard.training.options import Attention, Mode, Optimizer, Precision, Recompute


def _flag_help(command: str, flag: str) -> str:
    """The help text of `flag` of `autoshard COMMAND`."""
    commands = next(a for a in build_parser()._actions if a.dest == "command")
    parser = commands.choices[command]  # type: ignore[index]
    action = next(a for a in parser._actions if flag in a.option_strings)
    return str(action.help)


@pytest.mark.parametrize("command", ["propagate", "plan", "partition", "sweep"])
@pytest.mark.parametrize(
    "flag, kind",
    [("--mode", Mode), ("--optimizer", Optimizer), ("--precision", Precision),
     ("--recompute", Recompute), ("--attention", Attention)],
    ids=["mode", "optimizer", "precision", "recompute", "attention"],
)  # fmt: skip
def test_training_flag_help_names_every_accepted_choice(command, flag, kind: type[enum.StrEnum]):
    """`--recompute auto` is accepted, so `--help` names it beside none and layers."""
    shown = _flag_help(command, flag)
    assert [m.value for m in kind if m.value not in shown] == []


@pytest.mark.parametrize("command", ["propagate", "plan", "partition", "layout", "sweep"])
def test_mesh_help_says_axis_names_are_labels(command):
    """`dp=2,tp=2` names axes; the plan may still split weights over "dp": --help says so."""
    assert "axis names are labels only" in _flag_help(command, "--mesh")


def test_mesh_page_says_axis_names_are_labels():
    page = (Path(__file__).resolve().parents[2] / "docs" / "concepts" / "mesh.md").read_text()
    assert "**Axis names are labels only.**" in page
