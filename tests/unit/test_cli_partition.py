"""`autoshard partition --plan`: what it takes from the plan file when the user leaves it out."""

from __future__ import annotations

import json
from pathlib import Path

from autoshard.cli.main import main

MODELS = Path(__file__).resolve().parents[2] / "models"
GPT2, MLP = MODELS / "gpt2.onnx", MODELS / "mlp.onnx"


def test_partition_of_a_plan_file_binds_the_plans_dims(tmp_path, capsys):
    """GPT-2's batch and seq are symbolic: a plan made with --dim is partitioned without
    repeating them (the plan's dims), and other dims are refused naming both."""
    plan, out = tmp_path / "plan.json", tmp_path / "out"
    args = ["--mesh", "2", "--dim", "batch=2", "--dim", "seq=8"]
    assert main(["plan", str(GPT2), *args, "-o", str(plan), "-q"]) == 0
    assert main(["partition", str(GPT2), "--mesh", "2", "--plan", str(plan), "-o", str(out)]) == 0
    assert json.loads((out / "manifest.json").read_text())["dims"] == {"batch": 2, "seq": 8}
    capsys.readouterr()
    other = ["--dim", "batch=4", "--dim", "seq=8"]
    argv = ["partition", str(GPT2), "--mesh", "2", *other, "--plan", str(plan), "-o", str(out)]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"autoshard: error: plan {plan} is for dims batch=2 seq=8, not batch=4 seq=8; give the "
        "plan's --dim values or plan again\n"
    )


def test_partition_of_a_plan_file_takes_the_plans_mesh(tmp_path, capsys):
    """The plan records its mesh: without --mesh the partition is on it; a --mesh other than
    the plan's is refused naming both, and without --plan --mesh is needed."""
    plan, out = tmp_path / "plan.json", tmp_path / "out"
    assert main(["plan", str(MLP), "--mesh", "dp=2,tp=2", "--dim", "batch=8", "-o", str(plan)]) == 0
    assert main(["partition", str(MLP), "--plan", str(plan), "-o", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["devices"]) == 4
    capsys.readouterr()
    assert main(["partition", str(MLP), "--plan", str(plan), "--mesh", "4", "-o", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"autoshard: error: plan {plan} is for mesh dp=2,tp=2, not 4: leave out --mesh "
        "to partition it on the plan's mesh, or plan again for this one\n"
    )
    assert main(["partition", str(MLP), "--dim", "batch=8", "-o", str(out)]) == 2
    assert capsys.readouterr().err == (
        "autoshard: error: partition needs --mesh (or --plan, whose mesh it takes)\n"
    )
