"""`autoshard propagate` end to end: the design pages' MLP through the CLI, JSON keys, bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .seed_models import write_seed_mlp

MODELS = Path(__file__).resolve().parents[2] / "models"


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "autoshard", "propagate", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def seed_mlp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    model = write_seed_mlp(folder / "mlp.onnx")
    annotations = folder / "annotations.json"
    annotations.write_text(
        json.dumps(
            {
                "annotations": [
                    {"value": "x", "sharding": "[[], [], [0]]", "required": True},
                    {"value": "y", "sharding": "[[]] partial = sum[0]"},
                    {"value": "y", "sharding": "[[], [], [0]]", "for": "users"},
                ]
            }
        )
    )
    return model, annotations


def test_seed_001_through_the_cli(seed_mlp):
    model, annotations = seed_mlp
    result = run(str(model), "--mesh", "2", "--annotations", str(annotations), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    # The plan document `autoshard plan --json` prints; the search's blocks are null.
    assert list(data) == [
        "schema", "model", "story", "mesh", "cluster", "values", "ops", "unruled",
        "collectives", "cost", "breakdown", "solver", "search", "timing",
    ]  # fmt: skip
    assert data["schema"] == "autoshard.plan/1" and data["mesh"] == "2"
    assert data["solver"] is None and data["search"] is None and data["timing"] is None
    assert data["values"]["w1"] == {
        "sharding": "[[], [0]]",
        "partial": None,
        "read_as": {"dot1": "[[], [0]]"},
    }
    # Held partial, returned as its users (the return) read it: one reduce_scatter.
    assert data["values"]["y"] == {
        "sharding": "[[], [], []]", "partial": "sum[0]", "returned_as": "[[], [], [0]]",
    }  # fmt: skip
    # Each op's entry also says what a device spends on it (issue 12's per-op costs): dot2's
    # local shard runs b 2 x m 4 x n 8 x k 16 multiply-adds on [2, 4, 16] @ [16, 8] floats.
    efficiency = 0.8 * (8 / 72) * (8 / 72) * (16 / 80)  # M = b·m 8, N 8, K 16: tiny and thin
    assert data["ops"]["dot2"] == {
        "type": "MatMul", "sharding_option": "[[], [], [], [0]]", "flops": 2048,
        "bytes": (128 + 128 + 64) * 4,
        "compute_s": pytest.approx(2048 / (67e12 * efficiency) + 2e-6),
    }  # fmt: skip
    # 2x4x4 floats gathered from the other device; half of 2x4x8 floats reduce-scattered.
    assert [
        (c["kind"], c["value"], c["mesh_axes"], c["bytes_per_device"]) for c in data["collectives"]
    ] == [
        ("all_gather", "x", [0], 128),
        ("all_slice", "zero", [0], 0),
        ("reduce_scatter", "y", [0], 128),
    ]
    assert data["collectives"][0]["gather_axis"] == 2
    assert data["collectives"][2]["scatter_axis"] == 2
    assert data["collectives"][2]["reduction"] == "sum"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--annotate", "q=[[0]]"], "the model has no value 'q'"),
        (["--annotate", "x=[[5]]"], "unknown mesh axis 5 in [[5]]; mesh @mesh0 has axes 0"),
        (["--annotate", "x"], "--annotate 'x' is not VALUE=SHARDING"),
        (["--annotations", "missing.json"], "annotations file 'missing.json': no such file"),
    ],
)
def test_bad_annotations(args, message):
    result = run(str(MODELS / "mlp.onnx"), "--mesh", "8", "--dim", "batch=16", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
