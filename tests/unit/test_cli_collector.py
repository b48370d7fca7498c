"""`main` raises the collector's threshold while a command runs and gives back the caller's."""

import gc
from pathlib import Path

import pytest

from autoshard.cli.main import GC_THRESHOLD, main

MLP = Path(__file__).resolve().parents[2] / "models" / "mlp.onnx"


@pytest.fixture
def caller_threshold():
    before = gc.get_threshold()
    gc.set_threshold(123, 4, 5)
    yield (123, 4, 5)
    gc.set_threshold(*before)


@pytest.mark.parametrize(
    "args, code",
    [
        (["inspect", str(MLP), "--dim", "batch=2"], 0),
        (["plan", str(MLP), "--mesh", "2x2", "--dim", "batch=8", "--memory", "1B"], 2),
    ],
    ids=["done", "failed"],
)
def test_the_callers_threshold_comes_back(caller_threshold, args, code, capsys):
    assert main(args) == code
    assert gc.get_threshold() == caller_threshold


def test_a_command_runs_at_the_raised_threshold(caller_threshold, tmp_path):
    seen = []
    gc.callbacks.append(lambda phase, info: seen.append(gc.get_threshold()))
    try:
        assert main(["plan", str(MLP), "--mesh", "2x2", "--dim", "batch=8", "-q",
                     "-o", str(tmp_path / "plan.json")]) == 0  # fmt: skip
    finally:
        gc.callbacks.pop()
    # At the caller's 123 this plan makes some twenty passes; at the raised threshold, none.
    assert all(threshold == (GC_THRESHOLD, 4, 5) for threshold in seen)
