"""`autoshard propagate` end to end: seed 001's MLP through the CLI, JSON keys, bad input."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

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
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 8])
    weights = [
        numpy_helper.from_array(np.ones((8, 32), np.float32), "w1"),
        numpy_helper.from_array(np.ones((32, 8), np.float32), "w2"),
    ]
    zero = numpy_helper.from_array(np.zeros((2, 4, 32), np.float32))
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="dot1"),
        helper.make_node("Constant", [], ["zero"], value=zero),
        helper.make_node("Max", ["h", "zero"], ["r"], name="max"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="dot2"),
    ]
    graph = helper.make_graph(nodes, "mlp", [x], [y], weights)
    model = folder / "mlp.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
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
    assert data["values"]["w1"] == {"sharding": "[[], [0]]", "partial": None}
    assert data["values"]["y"] == {"sharding": "[[], [], []]", "partial": "sum[0]"}
    assert data["ops"]["dot2"] == {"type": "MatMul", "sharding_option": "[[], [], [], [0]]"}
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
