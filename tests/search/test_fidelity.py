"""The fidelity bench's measurement (`autoshard.execute.fidelity`): every op of device 0's program
timed by a probe, in one class each, with the plan's own estimate; and `calibrate --torch`."""

import json
import math
from pathlib import Path

import pytest

from autoshard.cli.main import main
from autoshard.cost.cluster import make_cluster
from autoshard.cost.measure.probes import OnnxRuntimeProbe, TorchProbe
from autoshard.execute.fidelity import CLASSES, measure
from autoshard.pipeline import PlanRequest, plan_request
from tests.export.gloo import load_module
from tests.search.test_plan import MODELS


def planned(model, dims):
    request = PlanRequest(model_path=MODELS / f"{model}.onnx", cluster=make_cluster("2"),
                          dims=dims, time_limit=10.0)  # fmt: skip
    return plan_request(request)


def check(found, requested):
    """A row per class then the total, which is their sum; each op's estimate is the plan's
    (the model is float32, as the probe): the bench compares what the plan says."""
    rows = found.classes()
    assert [r.kind for r in rows] == [*CLASSES, "total"]
    *classes, total = rows
    assert total.ops == sum(r.ops for r in classes) == len(found.ops)
    assert total.measured == pytest.approx(math.fsum(r.measured for r in classes))
    assert total.estimated == pytest.approx(math.fsum(r.estimated for r in classes))
    ops = requested.document.ops
    for timed in found.ops:
        assert timed.estimated == pytest.approx(ops[timed.name].compute_s, rel=1e-12)
        assert timed.measured >= 0
    return {r.kind: r.ops for r in rows}


def test_the_torch_probe_times_every_op_of_gpt2_on_the_cpu():
    """GPT-2 (2 layers) on 2 devices: its 13 contractions (4 Gemms a layer, QK^T and PV, the
    LM head), the memory-bound rest (the embedding lookups too), the 26 Reshapes apart;
    every op has a torch kernel."""
    pytest.importorskip("torch")
    requested = planned("gpt2", {"batch": 2, "seq": 16})
    found = measure(requested, TorchProbe("cpu", repeats=1, budget=0.0))
    assert found.skipped == ()
    counts = check(found, requested)
    assert counts["matmul"] == 13 and counts["views"] == 26 and counts["memory-bound"] == 47
    assert {o.type for o in found.ops if o.kind == "matmul"} == {"Gemm", "MatMul"}
    assert all(o.measured > 0 for o in found.ops if o.kind != "views")  # wall time, kept whole


def test_the_onnxruntime_probe_times_the_mlp():
    """Gemm, Relu, Gemm: two contractions and one memory-bound op (each time less a run's own
    cost: an op faster than that noise may read 0)."""
    requested = planned("mlp", {"batch": 8})
    found = measure(requested, OnnxRuntimeProbe(repeats=1, budget=0.0))
    assert check(found, requested) == {"matmul": 2, "memory-bound": 1, "views": 0, "total": 3}


def test_calibrate_with_torch_on_the_cpu_writes_a_cluster_file_plan_reads(tmp_path, capsys):
    """The torch probe's quick calibration (float32 on the CPU): a matmul curve, memory, a
    launch floor and a rate per special-function family; `plan --cluster` prices with it."""
    pytest.importorskip("torch")
    path = tmp_path / "cluster.json"
    assert main(["calibrate", "--torch", "--quick", "--ranks", "0", "-o", str(path)]) == 0
    assert "matmul 1024x1024x1024 (float32)" in capsys.readouterr().err
    data = json.loads(path.read_text())
    device = data["device"]
    assert data["calibration"]["probe"] == "torch float32"
    assert "(calibrated, torch float32)" in device["name"]
    assert sorted(device["transcendental"]) == sorted(
        ["exp", "log", "erf", "tanh", "pow", "int_pow", "sqrt", "trig"]
    )
    assert all(rate > 0 for rate in device["transcendental"].values())
    out = tmp_path / "plan.json"
    args = ["plan", str(MODELS / "gpt2.onnx"), "--mesh", "2", "--dim", "batch=2"]
    assert main([*args, "--dim", "seq=16", "--cluster", str(path), "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["cluster"]["device"] == device["name"]
    # the launch floor is in every op with a kernel: the plan's compute is at least that
    kernels = [o for o in plan["ops"].values() if o["compute_s"] > 0]
    assert plan["cost"]["compute_time_s"] >= len(kernels) * device["launch_s"]


def _cost_fidelity_bench():
    path = Path(__file__).resolve().parents[2] / "bench" / "cost_fidelity.py"
    return load_module(path, "cost_fidelity"), path.parent / "data" / "h100" / "fidelity.json"


def test_the_dgx_h100_preset_prices_an_h100s_kernels_within_the_targets():
    """bench/data/h100 keeps every op of Llama-2-7B-, GPT-2-XL- and BERT-large-wide forwards
    (2 layers) at batch x seq 1x512, 4x1024 and 8x2048 timed on an H100 (bfloat16 eager
    kernels, CUDA graphs). Priced by the dgx-h100 preset: each class within 25 % and each
    whole forward within 20 % of the measured sum (issue 12's targets). The access patterns,
    the misalignment and the L2 are each needed to stay within them (docs/measurements.md)."""
    bench, data = _cost_fidelity_bench()
    runs = bench.recorded_runs(data, "dgx-h100")
    assert [dims for dims, _ in runs] == [
        {"batch": 1, "seq": 512},
        {"batch": 4, "seq": 1024},
        {"batch": 8, "seq": 2048},
    ]
    for dims, results in runs:
        assert sorted(results) == ["bert", "gpt", "llama"]
        for model, found in results.items():
            rows = {r.kind: r for r in found.classes()}  # every op has a time (`_priced`)
            for kind in ("matmul", "memory-bound"):
                assert 0.75 <= rows[kind].ratio <= 1.25, (dims, model, kind, rows[kind].ratio)
            assert 0.8 <= rows["total"].ratio <= 1.2, (dims, model, rows["total"].ratio)


@pytest.mark.parametrize("op_type", ["Add", "Sub", "Mul", "Div", "Less", "GreaterOrEqual"])
def test_a_one_element_operand_is_a_number_either_side_and_the_result_the_same(op_type):
    """torch_ops gives a binary op its one-element operand as a Python number (as a model
    writes x / 8.0 or 1.0 - x), first or second: the same values as broadcasting it."""
    torch = pytest.importorskip("torch")
    from autoshard.execute.torch_ops import kernel
    from autoshard.ir.graph import Op

    x, one = torch.rand(4, 3) + 0.5, torch.tensor([2.0])
    reference = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div,
                 "Less": torch.lt, "GreaterOrEqual": torch.ge}[op_type]  # fmt: skip
    op = Op("op", op_type, inputs=("a", "b"), outputs=("y",))
    for a, b in ((x, one), (one, x)):
        assert torch.equal(kernel(op, [a, b], [(4, 3)], torch)(), reference(a, b))
