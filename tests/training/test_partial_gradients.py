"""A gradient summed from partial contributions, trained: a gated MLP (SwiGLU's shape: gate and
up projections read one hidden value h) split Megatron-style. The gradient of h is the sum of
two partial sums over the axis splitting the gated features; the search adds them partial and
reduces once (`search.partials`), and three training steps equal PyTorch autograd."""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from autoshard.cli.main import main
from autoshard.execute.artifacts import verify_training_folder


def write_gated_mlp(path):
    rng = np.random.default_rng(5)
    shapes = {"w0": (8, 8), "wg": (8, 16), "wu": (8, 16), "wd": (16, 8)}
    inits = [
        numpy_helper.from_array((rng.standard_normal(s) / 4).astype(np.float32), n)
        for n, s in shapes.items()
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["h"], name="hidden"),
        helper.make_node("MatMul", ["h", "wg"], ["g"], name="gate"),
        helper.make_node("MatMul", ["h", "wu"], ["u"], name="up"),
        helper.make_node("Mul", ["g", "u"], ["m"], name="gated"),
        helper.make_node("MatMul", ["m", "wd"], ["y"], name="down"),
    ]
    f32 = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes, "gated_mlp", [helper.make_tensor_value_info("x", f32, ["batch", 8])],
        [helper.make_tensor_value_info("y", f32, ["batch", 8])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.save(model, path)
    return path


def test_partial_gradient_contributions_are_added_then_reduced_and_train(tmp_path):
    model, plan, out = (
        write_gated_mlp(tmp_path / "gated.onnx"),
        tmp_path / "plan.json",
        tmp_path / "out",
    )
    split = {"x": "[[0]]", "wg": "[[], [1]]", "wu": "[[], [1]]", "wd": "[[1]]"}
    flags = [f for value, s in split.items() for f in ("--annotate", f"{value}={s}")]
    args = ["plan", str(model), "--mesh", "2x2", "--dim", "batch=4", "-q", "--mode", "training",
            "--precision", "fp32", "--optimizer", "sgd", *flags, "-o", str(plan)]  # fmt: skip
    assert main(args) == 0
    # The plan itself adds the two partial sums (the program does not reassociate them later).
    option = json.loads(plan.read_text())["ops"]["h@gradsum"]["sharding_option"]
    assert option.endswith("partial = sum[1]"), option
    assert main(["partition", str(model), "--plan", str(plan), "-q", "-o", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    reduced = [
        c["value"]
        for c in manifest["collectives"]
        if c["kind"] in ("all_reduce", "reduce_scatter") and c["value"].startswith("h@")
    ]
    assert reduced == ["h@gradsum"]  # not each of h@grad0 and h@grad1
    report = verify_training_folder(out, model, {}, steps=3)
    assert report.ok, [c.line() for c in report.failures]
    assert {c.step for c in report.checks} == {1, 2, 3}
