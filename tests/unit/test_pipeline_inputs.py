"""A pipeline's bad inputs from `sweep` (a point's row names the culprit in one line, as
`plan` and the REST API do: tests/unit/test_pipesearch.py, tests/api/test_api.py)."""

from __future__ import annotations

import json
from pathlib import Path

from autoshard.cli.main import main

MODELS = Path(__file__).resolve().parents[2] / "models"
GPT2 = MODELS / "gpt2.onnx"
TRAINING = ["--mode", "training", "--dim", "batch=2", "--dim", "seq=16"]


def test_a_sweep_point_with_more_stages_than_layers_is_its_row(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["sweep", str(GPT2), "-o", str(out), "--mesh", "4x1", "--pipeline-axis", "0", *TRAINING,
            "--executor", "local", "--workers", "1", "-q"]  # fmt: skip
    assert main(argv) == 0
    (row,) = json.loads((out / "points.json").read_text())["points"]
    assert row["status"] == "error"
    assert row["error"] == (
        "pipeline axis 0 has 4 stages but the model has 2 repeated layers; choose a pipeline "
        "axis of at most 2"
    )
