"""`autoshard partition` of a training step, then `autoshard verify` trains it: the MLP on a
2x2 mesh under data parallelism, Megatron tensor parallelism and weights held split over both
axes, 3 steps of Adam, AdamW and SGD, equal to PyTorch autograd and torch.optim on the original
ONNX file within 1e-5; a gradient all_reduce dropped from a device's step list, and a device's
corrupted weight, each named in one line."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from autoshard.cli.main import main
from autoshard.execute.artifacts import verify_training_folder
from autoshard.execute.train_check import TrainingReport, run_model
from autoshard.execute.verify import VerifyError, random_inputs, reference_outputs
from autoshard.ir.onnx_import import import_onnx
from tests.e2e.helpers import model_path

PLANS = {
    "dp": {"x": "[[0, 1]]"},
    "megatron": {"x": "[[0]]", "0.weight": "[[1]]", "0.bias": "[[1]]", "2.weight": "[[], [1]]"},
    "held-split": {"x": "[[0, 1]]", "0.weight": "[[0, 1]]", "2.weight": "[[0, 1]]",
                   "0.bias": "[[0, 1]]", "2.bias": "[[0, 1]]"},
}  # fmt: skip


def partition(tmp_path, plan, optimizer="adam"):
    out = tmp_path / f"{plan}-{optimizer}"
    flags = [f for value, s in PLANS[plan].items() for f in ("--annotate", f"{value}={s}")]
    args = ["partition", model_path("mlp"), "--mesh", "2x2", "--dim", "batch=4", "-q",
            "--mode", "training", "--precision", "fp32", "--optimizer", optimizer, *flags,
            "-o", out]  # fmt: skip
    assert main([str(a) for a in args]) == 0
    return out


def collectives(out):
    manifest = json.loads((out / "manifest.json").read_text())
    return [(c["kind"], c["value"]) for c in manifest["collectives"]]


@pytest.mark.parametrize(
    ("plan", "optimizer"),
    [("dp", "adam"), ("megatron", "adamw"), ("held-split", "sgd")],
)
def test_training_steps_equal_autograd(tmp_path, plan, optimizer):
    out = partition(tmp_path, plan, optimizer)
    report = verify_training_folder(out, model_path("mlp"), {}, steps=3)
    assert isinstance(report, TrainingReport)
    assert report.ok, [c.line() for c in report.failures]
    # every step checks the loss and each of the 4 weights' gradient, value and state after it
    assert len(report.checks) == 3 * (1 + 4 * 3)
    assert {c.step for c in report.checks} == {1, 2, 3}
    assert all(c.max_rel_err <= 1e-5 for c in report.checks)
    # the plan is what it says: its gradients are synchronized by collectives
    kinds = collectives(out)
    if plan == "dp":
        assert kinds.count(("all_reduce", "0.weight@grad0")) == 1
    elif plan == "megatron":
        assert ("all_reduce", "y") in kinds  # the row-parallel layer's forward sum
    else:
        assert ("reduce_scatter", "/1/Relu_output_0@grad0") in kinds


def test_a_searched_zero_plan_trains_as_autograd(tmp_path):
    """Under a 200 KB budget the search splits the MLP Megatron-style and the optimizer state
    further (TP+ZeRO-1/2): each device updates its slice of a weight, then gathers it (which
    weight is the search's choice: 2.weight since a shared reshard is priced once)."""
    plan, out = tmp_path / "plan.json", tmp_path / "zero"
    args = ["plan", model_path("mlp"), "--mesh", "2x2", "--dim", "batch=8", "--mode",
            "training", "--precision", "fp32", "--memory", "200KB", "-q", "-o", plan]  # fmt: skip
    assert main([str(a) for a in args]) == 0
    assert (
        main(["partition", str(model_path("mlp")), "--plan", str(plan), "-q", "-o", str(out)]) == 0
    )
    kinds = collectives(out)
    # which weight the search updates by slices depends on its prices: some weight does
    sliced = {value for kind, value in kinds if kind == "all_slice"}
    gathered = {value for kind, value in kinds if kind == "all_gather"}
    assert any(f"{w}@next" in gathered for w in sliced if w.endswith(("weight", "bias"))), kinds
    report = verify_training_folder(out, model_path("mlp"), {}, steps=3)
    assert report.ok, [c.line() for c in report.failures]


def test_gpt2_trains_under_megatron_as_autograd(tmp_path):
    """GPT-2 with its first MLP column- then row-parallel over axis 1 and its token embedding
    split over the vocabulary (a masked lookup, its gradient through the rewritten local ops),
    the batch over axis 0: 3 SGD steps. (Under Adam the attention's key bias, whose gradient
    is zero but for rounding, moves by about lr on the sign of that rounding, which the two
    sides need not share.)"""
    out = tmp_path / "gpt2"
    layer = "lm.transformer.h.0.mlp"
    args = ["partition", model_path("gpt2"), "--mesh", "2x2", "--dim", "batch=4", "--dim",
            "seq=8", "-q", "--mode", "training", "--precision", "fp32", "--optimizer", "sgd",
            "--annotate", "input_ids=[[0]]", "--annotate", f"{layer}.c_fc.weight=[[], [1]]",
            "--annotate", f"{layer}.c_proj.weight=[[1]]",
            "--annotate", "lm.transformer.wte.weight=[[1]]", "-o", out]  # fmt: skip
    assert main([str(a) for a in args]) == 0
    report = verify_training_folder(out, model_path("gpt2"), {}, steps=3)
    assert report.ok, [c.line() for c in report.failures]
    assert {c.step for c in report.checks} == {1, 2, 3}
    assert len({c.name for c in report.checks if c.what == "weight"}) >= 20


@pytest.mark.parametrize(
    ("name", "dims"), [("mlp", {"batch": 4}), ("gpt2", {"batch": 2, "seq": 8})]
)
def test_the_references_torch_ops_equal_onnxruntime(name, dims):
    """The reference runs the ONNX file's nodes as torch ops: its forward pass is onnxruntime's."""
    path = model_path(name)
    inputs = random_inputs(import_onnx(path, dims), seed=1)
    proto = onnx.load(str(path))
    values = {
        i.name: torch.from_numpy(numpy_helper.to_array(i).copy()) for i in proto.graph.initializer
    }
    values |= {n: torch.from_numpy(a) for n, a in inputs.items()}
    ours = run_model(proto, values)
    theirs = reference_outputs(path, inputs)
    for output, want in theirs.items():
        got = ours[output].detach().numpy()
        assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want)), output


def test_verify_command_reports_a_training_step(tmp_path, capsys):
    out = partition(tmp_path, "dp")
    capsys.readouterr()
    assert main(["verify", str(out), "--model", str(model_path("mlp")), "--steps", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"verify {out}: 1 training steps on 4 devices against torch autograd")
    assert text.split("\n")[0].endswith(": ok")


def test_a_dropped_gradient_all_reduce_is_named(tmp_path):
    out = partition(tmp_path, "dp")
    kinds = collectives(out)
    j = kinds.index(("all_reduce", "2.weight@grad0"))
    text = (out / "steps.json").read_text()
    steps = json.loads(text)
    device = steps["devices"][2]
    device["steps"] = [s for s in device["steps"] if s.get("collective") != j]
    (out / "steps.json").write_text(json.dumps(steps))
    with pytest.raises(VerifyError) as caught:
        verify_training_folder(out, model_path("mlp"), {}, steps=1)
    assert str(caught.value) == (
        "device 2: op '2.weight@sync' reads '2.weight@grad0~1', the result of collective "
        f"{j} (all_reduce of 2.weight@grad0), which its steps do not run"
    )
    # two collectives swapped in device 2's steps: it reaches the second while the rest wait
    steps = json.loads(text)
    device = steps["devices"][2]["steps"]
    first, second = (i for i, s in enumerate(device) if s.get("collective") in (j, j + 1))
    device[first], device[second] = device[second], device[first]
    (out / "steps.json").write_text(json.dumps(steps))
    with pytest.raises(VerifyError) as caught:
        verify_training_folder(out, model_path("mlp"), {}, steps=1)
    assert str(caught.value) == (
        f"device 2 runs collective {j + 1} (all_reduce of {kinds[j + 1][1]}) where the other "
        f"devices run collective {j} (all_reduce of 2.weight@grad0): its steps leave out or "
        "reorder a collective"
    )
    # dropped from every device: the gradient's sync reads what no step made
    steps = json.loads(text)
    for device in steps["devices"]:
        device["steps"] = [s for s in device["steps"] if s.get("collective") != j]
    (out / "steps.json").write_text(json.dumps(steps))
    with pytest.raises(VerifyError, match="^device 0: op '2.weight@sync' reads '2.weight@grad0~1'"):
        verify_training_folder(out, model_path("mlp"), {}, steps=1)


def test_a_corrupted_weight_shard_is_named_by_rank_step_and_parameter(tmp_path):
    out = partition(tmp_path, "megatron")
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["devices"][3]
    path = out / entry["file"]
    data = bytearray(path.read_bytes())  # safetensors: header length, JSON header, data
    size = int.from_bytes(data[:8], "little")
    start = 8 + size + json.loads(data[8 : 8 + size])["0.bias"]["data_offsets"][0]
    first = np.frombuffer(bytes(data[start : start + 4]), np.float32)[0]
    data[start : start + 4] = np.float32(first + 1.0).tobytes()  # device 3's half of the bias
    path.write_bytes(bytes(data))
    entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))
    report = verify_training_folder(out, model_path("mlp"), {}, steps=1)
    lines = [c.line() for c in report.failures]
    assert not report.ok
    assert any(line.startswith("step 1, rank 3: weight of 0.bias differs") for line in lines)
