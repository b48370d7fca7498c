"""Outputs and budgets the user gets wrong: one line naming the culprit, exit 2, and nothing
half-written left behind."""

from pathlib import Path

import pytest

from autoshard.cli.main import main

MLP = str(Path(__file__).resolve().parents[2] / "models" / "mlp.onnx")


@pytest.mark.parametrize(
    "where, message",
    [
        ("folder", "cannot write '{out}': it is a directory; name a file in it"),
        ("missing/plan.json", "cannot write '{out}': No such file or directory"),
    ],
    ids=["a-directory", "a-missing-directory"],
)
def test_plan_output_that_cannot_be_written(tmp_path, capsys, where, message):
    (tmp_path / "folder").mkdir()
    out = tmp_path / where
    assert main(["plan", MLP, "--mesh", "2", "--dim", "batch=8", "-o", str(out)]) == 2
    assert capsys.readouterr().err == f"autoshard: error: {message.format(out=out)}\n"
    assert [p.name for p in tmp_path.rglob("*")] == ["folder"]  # no temporary file left


@pytest.mark.parametrize("budget", ["0", "0GiB", "0.0001B"])
def test_a_budget_of_nothing_is_refused(capsys, budget):
    assert main(["plan", MLP, "--mesh", "2", "--dim", "batch=8", "--memory", budget]) == 2
    expected = f"memory {budget!r} is no budget: give a size above 0, like 16GiB"
    assert capsys.readouterr().err == f"autoshard: error: {expected}\n"
