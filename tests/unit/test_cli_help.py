"""`--help` names what the commands accept: every choice a training flag takes."""

from __future__ import annotations

import enum

import pytest

from autoshard.cli.main import build_parser
from autoshard.training.options import Mode, Optimizer, Precision, Recompute


def _flag_help(command: str, flag: str) -> str:
    """The help text of `flag` of `autoshard COMMAND`."""
    commands = next(a for a in build_parser()._actions if a.dest == "command")
    parser = commands.choices[command]  # type: ignore[index]
    action = next(a for a in parser._actions if flag in a.option_strings)
    return str(action.help)


@pytest.mark.parametrize("command", ["propagate", "plan", "partition"])
@pytest.mark.parametrize(
    "flag, kind",
    [("--mode", Mode), ("--optimizer", Optimizer), ("--precision", Precision),
     ("--recompute", Recompute)],
    ids=["mode", "optimizer", "precision", "recompute"],
)  # fmt: skip
def test_training_flag_help_names_every_accepted_choice(command, flag, kind: type[enum.StrEnum]):
    """`--recompute auto` is accepted, so `--help` names it beside none and layers."""
    shown = _flag_help(command, flag)
    assert [m.value for m in kind if m.value not in shown] == []
