"""`autoshard calibrate` and described devices: the fit recovers a known curve, a device given
field by field prices ops by the same roofline, and the file calibrate writes plans."""

import json
import math
import re

import pytest

from autoshard.cli.main import main
from autoshard.collectives import CollectiveKind, ring_steps
from autoshard.cost.attention import attention_flops
from autoshard.cost.cluster import Cluster, device_kind, make_cluster
from autoshard.cost.compute import OpCost, op_cost
from autoshard.cost.devices import gpu_reserve
from autoshard.cost.measure.calibrate import (
    PACK_RATES,
    Calibration,
    LinkSample,
    attention_efficiencies,
    fit_half_dim,
    fit_link,
    fit_links,
    fit_packing,
    fp8_peak,
    kernel_rates,
    working_set,
)
from autoshard.cost.measure.probes import TorchProbe
from autoshard.errors import ClusterError
from autoshard.mesh import Mesh
from autoshard.rules import rule_for
from autoshard.sharding import ShardingOption
from tests.search.test_plan import MODELS
from tests.search.test_roofline import one_op


def test_the_fit_recovers_the_curve_it_was_drawn_from():
    """Rates drawn from E · Π d / (d + 48) with E = 1e11: the fit gives E and h = 48 back."""
    shapes = [(256,) * 3, (1024,) * 3, (2048, 32, 2048), (32, 2048, 2048), (2048, 128, 2048)]
    rates = [(s, 1e11 * math.prod(d / (d + 48) for d in s)) for s in shapes]
    peak, half, speedup = fit_half_dim(rates)
    assert half == 48 and peak == pytest.approx(1e11) and speedup == 1.0


def test_a_gpus_samples_are_kernel_rates_where_they_tell_one():
    """Launch 2 us, 3 TB/s: 128^3 in 3 us is launch-bound (under 10 floors), 16384x32x16384
    moves 539 MB (180 us): bound by them in 300 us, kept in 500; 4096^3 in 190 us is kept at
    its rate with the launch taken off."""
    thin = (16384, 32, 16384)
    flops = {s: 2 * math.prod(s) for s in [(128,) * 3, thin, (4096,) * 3]}
    assert working_set(thin, 2) / 3e12 == pytest.approx(179.6e-6, rel=1e-3)
    rates = [((128,) * 3, flops[(128,) * 3] / 3e-6), (thin, flops[thin] / 300e-6),
             ((4096,) * 3, flops[(4096,) * 3] / 190e-6)]  # fmt: skip
    kept = dict(kernel_rates(rates, 2e-6, 3e12, 2))
    assert list(kept) == [(4096,) * 3]
    assert kept[(4096,) * 3] == pytest.approx(flops[(4096,) * 3] / 188e-6)
    rates[1] = (thin, flops[thin] / 500e-6)
    assert list(dict(kernel_rates(rates, 2e-6, 3e12, 2))) == [thin, (4096,) * 3]


def test_the_fit_finds_the_cache_level_and_its_speedup():
    """The same curve, but shapes of at most 768 KiB of float32 operands and result (256^3)
    run 3x faster: the fit gives E, h, the speedup and that limit back."""
    shapes = [(64,) * 3, (128,) * 3, (256,) * 3, (1024,) * 3, (2048, 32, 2048),
              (32, 2048, 2048), (2048, 128, 2048)]  # fmt: skip
    limit = 4 * 3 * 256 * 256
    assert working_set((256,) * 3, 4) == limit == 786432

    def speed(shape):
        return 3 if working_set(shape, 4) <= limit else 1

    rates = [(s, speed(s) * 1e11 * math.prod(d / (d + 48) for d in s)) for s in shapes]
    peak, half, speedup, found, pack = fit_packing(rates, 4)
    assert (half, found, pack) == (48, limit, 0.0)
    assert peak == pytest.approx(1e11) and speedup == pytest.approx(3.0)
    # without a faster level, none is found
    plain = [(s, 1e11 * math.prod(d / (d + 48) for d in s)) for s in shapes]
    assert fit_packing(plain, 4)[2:] == (1.0, 0, 0.0)


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
    assert main(["calibrate", "--quick", "--ranks", "0", "-o", str(path)]) == 0
    data = json.loads(path.read_text())
    device = data["device"]
    assert device["hbm_bandwidth"] > 0 and device["flops"]["float32"] > 0
    assert len(data["calibration"]["matmul_flops"]) == 10
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
    # onnxruntime on a CPU runs no flash-attention kernel: training plans price attention
    # op by op on it by default
    assert device["attention_efficiency"] == device["attention_backward_efficiency"] == 0
    assert not device_kind(device).flash_attention


def test_torchs_fused_attention_is_measured_as_the_cost_model_counts_it():
    """SDPA (torch, on this CPU) forward and backward: fractions of a peak that are its
    attention FLOPs (`attention_flops`) over its measured time."""
    probe = TorchProbe("cpu", repeats=2, budget=0.01)
    shape = (1, 2, 128, 16)
    seconds = probe.attention(shape)
    assert seconds > 0 and probe.attention(shape, backward=True) > 0
    flops = attention_flops(1, 2, 128, 128, 16, True, False)
    assert flops == 2 * 2 * 2 * (128 * 129 // 2) * 16
    forward, backward = attention_efficiencies(probe, peak=1e15, launch=0.0, scale=16)
    assert 0 < forward <= 1 and 0 < backward <= 1


# ---- links: collectives fitted to the α–β model ------------------------------------------------

KINDS = (CollectiveKind.ALL_GATHER, CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER,
         CollectiveKind.ALL_TO_ALL)  # fmt: skip


def synthetic(alpha, beta, ranks=4, sizes=(4096, 65536, 1 << 20), kinds=KINDS):
    """Timings drawn from the model itself: t = ring_steps·α + ring_bytes/β."""
    samples = []
    for kind in kinds:
        for local in sizes:
            probe = LinkSample(kind, ranks, local, 1.0)
            samples.append(LinkSample(kind, ranks, local, probe.steps * alpha + probe.sent / beta))
    return samples


def test_the_link_fit_recovers_alpha_and_beta_exactly():
    """Over 4 ranks an all_reduce of 1 MiB per rank is 6 steps and 1.5 MiB sent: at α = 7 us,
    β = 3 GB/s, 42 us + 524.288 us. The fit of every kind together, and of each alone, gives
    α and β back."""
    samples = synthetic(7e-6, 3e9)
    big = next(s for s in samples if s.kind is CollectiveKind.ALL_REDUCE and s.local == 1 << 20)
    assert (big.steps, big.sent) == (6, 1572864)
    assert big.seconds == pytest.approx(42e-6 + 524.288e-6)
    fit = fit_link(samples)
    assert fit.latency == pytest.approx(7e-6, rel=1e-9)
    assert fit.bandwidth == pytest.approx(3e9, rel=1e-9)
    links = fit_links("gloo", samples)
    assert [str(k) for k, _ in links.by_kind] == sorted(str(k) for k in KINDS)
    for _, one in links.by_kind:
        assert one.latency == pytest.approx(7e-6, rel=1e-9)
        assert one.bandwidth == pytest.approx(3e9, rel=1e-9)


def test_a_latency_below_zero_is_held_at_zero():
    """Timings 0.1 us below t = x/β: the free fit's α is negative, so α = 0 and 1/β is the
    relative least squares of t = x·γ alone, Σ (x/t) / Σ (x/t)²."""
    shifted = [
        LinkSample(s.kind, 2, s.local, s.seconds - 1e-7) for s in synthetic(0.0, 1e9, ranks=2)
    ]
    ratios = [s.sent / s.seconds for s in shifted]
    fit = fit_link(shifted)
    assert fit.latency == 0.0
    assert fit.bandwidth == pytest.approx(math.fsum(r * r for r in ratios) / math.fsum(ratios))
    assert fit.bandwidth > 1e9


def test_timings_that_do_not_grow_with_bytes_are_refused():
    flat = [LinkSample(CollectiveKind.ALL_REDUCE, 2, size, 1e-3) for size in (4096, 8192)]
    with pytest.raises(ClusterError, match="do not grow with their bytes"):
        fit_link(flat)


def test_calibrate_refuses_one_rank(tmp_path, capsys):
    assert main(["calibrate", "--quick", "--ranks", "1", "-o", str(tmp_path / "c.json")]) == 2
    message = "autoshard: error: --ranks 1: give 0 (links not measured) or 2 and more\n"
    assert capsys.readouterr().err == message


def test_calibrate_measures_the_links_on_gloo_and_plan_prices_with_them(tmp_path, capsys):
    """Two gloo ranks, the quick sizes (two processes start and time 12 collectives):
    the file's links are the fit, and a plan with it prices a collective by α and β."""
    pytest.importorskip("torch")
    path = tmp_path / "cluster.json"
    assert main(["calibrate", "--quick", "--ranks", "2", "--backend", "gloo", "-o", str(path)]) == 0
    err = capsys.readouterr().err
    assert "all_to_all of 1048576 B per rank over 2 ranks (gloo)" in err and "links fit" in err
    data = json.loads(path.read_text())
    links = data["calibration"]["links"]
    assert links["ranks"] == 2 and len(links["samples"]) == 12
    assert {s["kind"] for s in links["samples"]} == {str(k) for k in KINDS}
    bandwidth, latency = links["bandwidth_bytes_per_s"], links["latency_s"]
    assert data["device"]["link_bandwidth"] == bandwidth
    assert data["bandwidth"] == f"{bandwidth / 1e9:.6g}GB/s"
    out = tmp_path / "plan.json"
    args = ["plan", str(MODELS / "mlp.onnx"), "--mesh", "2", "--dim", "batch=8"]
    args += ["--annotate", "x=[[], [0]]"]  # x held split: the plan gathers it
    assert main([*args, "--cluster", str(path), "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["cluster"]["bandwidth_bytes_per_s"] == [pytest.approx(bandwidth, rel=1e-5)]
    assert plan["cluster"]["latency_s"] == [pytest.approx(latency, rel=1e-5)]
    # The plan's communication time is the α–β model at the measured link, collective by one.
    (beta,), (alpha,) = plan["cluster"]["bandwidth_bytes_per_s"], plan["cluster"]["latency_s"]
    expected = math.fsum(
        ring_steps(CollectiveKind(c["kind"]), 2) * alpha + c["bytes_per_device"] / beta
        for c in plan["collectives"]
        if c["bytes_per_device"]
    )
    assert plan["collectives"] and plan["cost"]["comm_time_s"] == pytest.approx(expected)


def test_calibrate_refuses_nccl_without_gpus_before_any_work(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    path = tmp_path / "c.json"
    assert main(["calibrate", "--ranks", "2", "--backend", "nccl", "-o", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        "autoshard: error: --backend nccl needs 2 CUDA GPUs; this machine has 0: use "
        "--backend gloo or fewer --ranks\n"
    )
    assert not path.exists()


def test_the_fit_separates_packing_from_multiplying():
    """Times drawn from 2MKN / (5e10 · (3 in the cache) · Π d / (d + 16)) plus a pass over B
    at 4.0 GB/s (on the grid of packing rates: 0.5 · 1.26^9): the fit gives the curve, the
    cache level and the packing rate back."""
    shapes = [(128,) * 3, (256,) * 3, (512,) * 3, (1024,) * 3, (2048,) * 3, (2048, 32, 2048),
              (2048, 2048, 32), (32, 2048, 2048), (2048, 128, 2048), (128, 4096, 4096)]  # fmt: skip
    limit = working_set((512,) * 3, 4)

    def rate(shape):
        m, k, n = shape
        level = 3 if working_set(shape, 4) <= limit else 1
        curve = level * 5e10 * math.prod(d / (d + 16) for d in shape)
        return 2 * m * k * n / (2 * m * k * n / curve + 4 * k * n / PACK_RATES[10])

    peak, half, speedup, found, pack = fit_packing([(s, rate(s)) for s in shapes], 4)
    assert (half, found) == (16, limit)
    assert peak == pytest.approx(5e10) and speedup == pytest.approx(3)
    assert pack == PACK_RATES[10] == pytest.approx(4.0e9, rel=1e-3)


def test_the_fp8_peak_and_reserve_follow_the_models():
    """A measured 8192^3 e4m3 matmul at 1500 TFLOP/s, bf16's half dim 64: the peak at
    efficiency 1 is 1500e12 / (8192 / 8256)^3; a GPU of 80 GB with 0.6 GB of context holds
    back 0.6 GB + 0.5 GiB + 0.8 GB."""
    assert fp8_peak(1500e12, 8192, 64) == pytest.approx(1500e12 * (8256 / 8192) ** 3)
    assert gpu_reserve(80 * 10**9, 6 * 10**8) == 6 * 10**8 + 2**29 + 8 * 10**8


def test_a_calibrated_device_carries_its_fp8_rate_and_reserve():
    calibration = Calibration((), 1e14, 64, 1e12, 2e-6, 80 * 10**9, dtype="bfloat16",
                              fp8_peak=2e15, reserve=3 * 10**9)  # fmt: skip
    device = device_kind(calibration.device("gpu"))
    assert device.peak("float8_e4m3fn") == 2e15 and device.reserve == 3 * 10**9
    assert Cluster(Mesh((2,)), device).memory == 77 * 10**9
