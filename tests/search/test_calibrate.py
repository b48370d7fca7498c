"""`autoshard calibrate` and described devices: the fit recovers a known curve, a device given
field by field prices ops by the same roofline, and the file calibrate writes plans."""

import json
import math
import re

import pytest

from autoshard.cli import main
from autoshard.cost.calibrate import fit_half_dim
from autoshard.cost.cluster import ClusterError, device_kind, make_cluster
from autoshard.cost.model import OpCost, op_cost
from autoshard.plan import ShardingOption
from autoshard.rules import rule_for
from tests.search.test_plan import MODELS
from tests.search.test_roofline import one_op


def test_the_fit_recovers_the_curve_it_was_drawn_from():
    """Rates drawn from E · Π d / (d + 48) with E = 1e11: the fit gives E and h = 48 back."""
    shapes = [(256,) * 3, (1024,) * 3, (2048, 32, 2048), (32, 2048, 2048), (2048, 128, 2048)]
    rates = [(s, 1e11 * math.prod(d / (d + 48) for d in s)) for s in shapes]
    peak, half = fit_half_dim(rates)
    assert half == 48 and peak == pytest.approx(1e11)


DEVICE = {
    "name": "test device", "flops": {"float32": 1e12}, "default_flops": 1e11,
    "memory": 2**30, "link_bandwidth": 1e9, "hbm_bandwidth": 1e10,
    "matmul_efficiency": 1.0, "memory_efficiency": 1.0, "matmul_half_dim": 32,
    "launch_s": 1e-6,
}  # fmt: skip


def test_a_described_device_prices_the_same_roofline(tmp_path):
    """[512, 512] @ [512, 512] float32 at 1e12 · s(512)³ (s = 512/544): 322 us; its 3 MiB at
    10 GB/s: 315 us. Compute-bound: 323.3 us with the 1 us launch."""
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"device": DEVICE}))
    cluster = make_cluster(mesh="2", file=path)
    op, graph = one_op("MatMul", {"x": (512, 512), "w": (512, 512)}, (512, 512), dtype="float32")
    rule = rule_for(op, graph)
    flops, moved = 2 * 512**3, 3 * 512 * 512 * 4
    seconds = flops / (1e12 * (512 / 544) ** 3)
    assert seconds > moved / 1e10
    assert op_cost(op, rule, ShardingOption(((),) * 3), graph, cluster) == OpCost(
        flops, moved, pytest.approx(seconds + 1e-6)
    )
    assert seconds + 1e-6 == pytest.approx(323.3e-6, rel=1e-3)
    assert cluster.bandwidth == (1e9,) and cluster.device.name == "test device"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"speed": 1}, "unknown device key(s) ['speed']"),
        ({"hbm_bandwidth": None}, "device key 'hbm_bandwidth' has a bad value None"),
        ({"matmul_efficiency": 0}, "rates, sizes and efficiencies must be > 0"),
    ],
)
def test_a_bad_described_device_is_named(change, message):
    with pytest.raises(ClusterError, match=re.escape(message)):
        device_kind(DEVICE | change)


def test_a_described_device_needs_its_rates():
    with pytest.raises(ClusterError, match=r"device is missing \['hbm_bandwidth'\]"):
        device_kind({k: v for k, v in DEVICE.items() if k != "hbm_bandwidth"})


def test_calibrate_writes_a_cluster_file_plan_reads(tmp_path, capsys):
    """A quick calibration of this machine (numpy float32), then a plan priced with it."""
    path = tmp_path / "cluster.json"
    assert main(["calibrate", "--quick", "-o", str(path)]) == 0
    data = json.loads(path.read_text())
    device = data["device"]
    assert device["hbm_bandwidth"] > 0 and device["flops"]["float32"] > 0
    assert len(data["calibration"]["matmul_flops"]) == 8
    assert "matmul 1024x1024x1024" in capsys.readouterr().err  # progress, shown as it runs
    out = tmp_path / "plan.json"
    args = ["plan", str(MODELS / "mlp.onnx"), "--mesh", "2", "--dim", "batch=8", "--cluster"]
    args.append(str(path))
    assert main([*args, "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["cluster"]["device"] == device["name"]
    assert plan["cluster"]["hbm_bandwidth_bytes_per_s"] == device["hbm_bandwidth"]
    ops = plan["ops"].values()
    assert math.fsum(o["compute_s"] for o in ops) == pytest.approx(plan["cost"]["compute_time_s"])
