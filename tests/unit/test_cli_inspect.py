"""`autoshard inspect` as a user runs it: every bundled model, JSON keys, and bad input."""

import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

MODELS = Path(__file__).resolve().parents[2] / "models"
BINDINGS = {
    "mlp.onnx": ["--dim", "batch=2"],
    "cnn.onnx": ["--dim", "batch=2"],
    "gpt2.onnx": ["--dim", "batch=2", "--dim", "seq=16"],
    "gpt2_dynamo.onnx": ["--dim", "batch=2", "--dim", "seq=16"],
    "bert.onnx": ["--dim", "batch=2", "--dim", "seq=16"],
    "decoder_32l_shape_only.onnx": ["--dim", "batch=8", "--dim", "seq=2048"],
}


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "autoshard", *args], capture_output=True, text=True, timeout=120
    )


def onnx_parameter_count(path):
    model = onnx.load(str(path), load_external_data=False)
    count = 0
    for init in model.graph.initializer:
        size = 1
        for d in init.dims:
            size *= d
        count += size
    return count


@pytest.mark.parametrize("name", sorted(BINDINGS))
def test_inspect_json_on_every_model(name):
    result = run("inspect", str(MODELS / name), *BINDINGS[name], "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["parameters"] == onnx_parameter_count(MODELS / name)
    assert summary["unbound_dims"] == {}
    assert summary["nodes"] == sum(summary["op_types"].values())
    for entry in summary["inputs"] + summary["outputs"]:
        assert set(entry) == {"name", "shape", "dtype"}
        assert all(isinstance(d, int) and d > 0 for d in entry["shape"])


def test_inspect_text_gpt2():
    result = run("inspect", str(MODELS / "gpt2.onnx"), "--dim", "batch=8", "--dim", "seq=128")
    assert result.returncode == 0, result.stderr
    assert "  input_ids  int64[8, 128]" in result.stdout
    assert "  logits  float32[8, 128, 512]" in result.stdout
    assert "parameters: 173.82 K" in result.stdout


def test_inspect_lists_unbound_dims():
    result = run("inspect", str(MODELS / "bert.onnx"), "--dim", "batch=2", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["unbound_dims"] == {"seq": ["input_ids[1]", "attention_mask[1]"]}
    assert summary["inputs"][0] == {"name": "input_ids", "shape": [2, "seq"], "dtype": "int64"}
    assert summary["nodes"] == summary["nodes_in_file"] == 267
    text = run("inspect", str(MODELS / "bert.onnx")).stdout
    assert "  batch  input_ids[0], attention_mask[0]" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["nope.onnx"], "cannot read ONNX model 'nope.onnx': no such file"),
        (["README.md"], "cannot read ONNX model 'README.md': not an ONNX protobuf"),
        (
            [str(MODELS / "mlp.onnx"), "--dim", "bogus=2"],
            "has no symbolic dim 'bogus'; its dims: batch",
        ),
        ([str(MODELS / "mlp.onnx"), "--dim", "batch"], "--dim 'batch' is not NAME=SIZE"),
        ([str(MODELS / "mlp.onnx"), "--dim", "batch=0"], "--dim 'batch=0': size must be >= 1"),
        (
            [str(MODELS / "mlp.onnx"), "--dim", "batch=2", "--dim", "batch=3"],
            "--dim batch given twice",
        ),
    ],
)
def test_inspect_errors_are_one_line(args, message):
    result = run("inspect", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
