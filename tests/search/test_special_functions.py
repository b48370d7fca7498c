"""The roofline's special-function term (`cost.compute.special`, `special_rate`) against
hand-computed times: a measured rate per family where the device has one, else its vector
rate over the instructions an evaluation takes (`TRANSCENDENTAL_FLOPS`)."""

import json

import numpy as np
import pytest

from autoshard.cost.cluster import device_kind, make_cluster
from autoshard.cost.compute import TRANSCENDENTAL_FLOPS, OpCost, op_cost, special
from autoshard.errors import ClusterError
from autoshard.ir.graph import Graph, Op, Value
from autoshard.rules import rule_for
from autoshard.sharding import ShardingOption
from tests.search.test_calibrate import DEVICE
from tests.search.test_roofline import one_op

N = 1 << 20  # elements of every tensor below, float32
RATES = {"erf": 1e9, "pow": 1e8, "exp": 4e9}  # evaluations/s, as calibrate writes them


@pytest.fixture
def cluster(tmp_path):
    """DEVICE (10 GB/s memory, 1e11 vector FLOP/s, 1 us launch) with measured rates."""
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"device": DEVICE | {"transcendental": RATES}}))
    return make_cluster(mesh="2", file=path)


def priced(op, graph, cluster, option="[]"):
    rule = rule_for(op, graph)
    return op_cost(op, rule, ShardingOption.parse(option, len(rule.loops)), graph, cluster)


def pow_graph(exponent):
    """y = x ** exponent, the exponent a constant scalar."""
    values = {"x": Value("x", (N,), "float32"), "e": Value("e", (), "float32"),
              "y": Value("y", (N,), "float32")}  # fmt: skip
    op = Op("op", "Pow", inputs=("x", "e"), outputs=("y",))
    return op, Graph("g", (op,), values, ("x",), ("y",), {}, {"e": np.float32(exponent)})


def test_an_erf_is_bound_by_its_measured_rate_not_memory(cluster):
    """Erf of 1 Mi float32: 8 MiB read + written at 10 GB/s is 839 us; 1 Mi evaluations at
    1e9/s is 1049 us: the special function bounds it, 1050 us with the launch."""
    op, graph = one_op("Erf", {"x": (N,)}, (N,), dtype="float32")
    assert priced(op, graph, cluster) == OpCost(N, 8 * N, pytest.approx(N / 1e9 + 1e-6))
    assert round((N / 1e9 + 1e-6) * 1e6, 3) == 1049.576
    assert 8 * N / 1e10 < N / 1e9
    # split over 2 devices: half the evaluations each
    assert priced(op, graph, cluster, "[[0]]").seconds == pytest.approx(N / 2 / 1e9 + 1e-6)


def test_a_softmax_prices_its_exp_among_its_flops(cluster):
    """Softmax of [1024, 1024]: its exp is inside the fused row kernel, counted among its 5
    FLOPs an element (no special term): 5 Mi FLOPs at 1e11 (52 us) against 3 passes of 4 MiB
    = 12 MiB at 10 GB/s (1258 us): memory-bound."""
    op, graph = one_op("Softmax", {"x": (1024, 1024)}, (1024, 1024), {"axis": -1}, dtype="float32")
    assert special(op, graph) is None
    assert priced(op, graph, cluster).seconds == pytest.approx(12 * N / 1e10 + 1e-6)


@pytest.mark.parametrize(
    "exponent, family, seconds",
    [
        # a general power: 1 Mi evaluations at 1e8/s = 10486 us
        (1.7, "pow", N / 1e8),
        # cubes and squares are multiplications (int_pow, not measured: 1e11 / 2 = 5e10/s,
        # 21 us): memory, 8 MiB at 10 GB/s = 839 us
        (3.0, "int_pow", 8 * N / 1e10),
        (2.0, "int_pow", 8 * N / 1e10),
        # a copy
        (1.0, None, 8 * N / 1e10),
        # a square root with no measured rate: vector rate / 4 instructions = 2.5e10/s, 42 us,
        # under memory's 839 us
        (0.5, "sqrt", 8 * N / 1e10),
    ],
    ids=["x**1.7", "x**3", "x**2", "x**1", "x**0.5"],
)
def test_a_pow_costs_what_its_exponent_asks(cluster, exponent, family, seconds):
    op, graph = pow_graph(exponent)
    assert special(op, graph) == family
    assert priced(op, graph, cluster).seconds == pytest.approx(seconds + 1e-6)


def test_without_a_measured_rate_a_family_runs_at_the_vector_rate_over_its_instructions():
    """Tanh of 1 Mi bf16 on one H100: 12 instructions at 67 TFLOP/s = 5.58e12/s, 0.19 us;
    4 MiB in the L2 at 8 TB/s x 0.85 is 0.62 us: on a GPU memory bounds it, 2.62 us with
    launch (3.47 were it read from HBM)."""
    assert TRANSCENDENTAL_FLOPS["tanh"] == 12
    op, graph = one_op("Tanh", {"x": (N,)}, (N,))
    rule = rule_for(op, graph)
    found = op_cost(op, rule, ShardingOption(((),)), graph, make_cluster(mesh="1"))
    assert N * 12 / 67e12 < 4 * N / (8e12 * 0.85)
    assert found.seconds == pytest.approx(4 * N / (8e12 * 0.85) + 2e-6)


def test_an_approximate_gelu_is_a_tanh():
    op, graph = one_op("Gelu", {"x": (8,)}, (8,), {"approximate": "tanh"})
    assert special(op, graph) == "tanh"
    op, graph = one_op("Gelu", {"x": (8,)}, (8,))
    assert special(op, graph) == "erf"


def test_an_unknown_family_is_named():
    with pytest.raises(ClusterError, match=r"unknown transcendental families \['gamma'\]; valid"):
        device_kind(DEVICE | {"transcendental": {"gamma": 1e9}})


# ---- a CPU's caches: what `autoshard calibrate` measures and plans price with ----------------

CPU = DEVICE | {"cache_bytes": 1 << 20, "cache_bandwidth": 1e11, "matmul_cache_bytes": 1 << 20,
                "matmul_cache_speedup": 4.0, "misaligned_efficiency": 1.0}  # fmt: skip


def described(tmp_path, device):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"device": device}))
    return make_cluster(mesh="1", file=path)


def test_an_op_moving_less_than_the_cache_streams_at_its_rate(tmp_path):
    """Add of 64 Ki float32: 768 KiB moved, within the 1 MiB cache: at 1e11 B/s, 7.86 us + 1.
    Of 1 Mi: 12 MiB, from memory at 1e10 B/s: 1258 us + 1."""
    cluster = described(tmp_path, CPU)
    op, graph = one_op("Add", {"a": (1 << 16,), "b": (1 << 16,)}, (1 << 16,), dtype="float32")
    assert priced(op, graph, cluster).seconds == pytest.approx(786432 / 1e11 + 1e-6)
    op, graph = one_op("Add", {"a": (N,), "b": (N,)}, (N,), dtype="float32")
    assert priced(op, graph, cluster).seconds == pytest.approx(12 * N / 1e10 + 1e-6)


def test_a_matmul_in_the_private_caches_runs_faster(tmp_path):
    """[128, 128] @ [128, 128] float32: 192 KiB of operands and result, within 1 MiB: 2·128³
    FLOPs at 1e12 · (128/160)³ · 4 = 2.048 us (its 192 KiB from the cache: 1.97 us), 3.048
    with the launch; without the cache level, 4x the compute and memory's 19.7 us."""
    op, graph = one_op("MatMul", {"x": (128, 128), "w": (128, 128)}, (128, 128), dtype="float32")
    flops = 2 * 128**3
    seconds = flops / (1e12 * 0.8**3 * 4)
    assert seconds == pytest.approx(2.048e-6) and seconds > 196608 / 1e11
    assert priced(op, graph, described(tmp_path, CPU)).seconds == pytest.approx(seconds + 1e-6)
    plain = priced(op, graph, described(tmp_path, DEVICE)).seconds
    assert plain == pytest.approx(196608 / 1e10 + 1e-6)


def test_misalignment_costs_what_the_device_says(tmp_path):
    """[1024, 1024] @ [1024, 1023] float32 (N = 1023, not a multiple of 4): compute-bound, at
    half the rate on the default (a GPU's cuBLAS), at the full rate where calibrate found no
    loss (a CPU): exactly twice the compute time."""
    op, graph = one_op("MatMul", {"x": (1024, 1024), "w": (1024, 1023)}, (1024, 1023),
                       dtype="float32")  # fmt: skip
    flops = 2 * 1024 * 1024 * 1023
    full = flops / (1e12 * (1024 / 1056) ** 2 * (1023 / 1055))
    assert priced(op, graph, described(tmp_path, CPU)).seconds == pytest.approx(full + 1e-6)
    halved = priced(op, graph, described(tmp_path, DEVICE)).seconds
    assert halved == pytest.approx(2 * full + 1e-6)


def test_a_cpu_matmul_packs_its_second_operand(tmp_path):
    """[64, 1024] @ [1024, 4096] float32 with B packed at 4 GB/s: 2·64·1024·4096 FLOPs at
    1e12 · s(64) s(1024) s(4096) (s = d / (d + 32)) take 0.84 ms, its 17.25 MiB moved from
    memory at 10 GB/s 1.81 ms (memory-bound), plus B's 16 MiB packed in 4.19 ms: 6.00 ms
    with the launch."""
    op, graph = one_op("MatMul", {"x": (64, 1024), "w": (1024, 4096)}, (64, 4096),
                       dtype="float32")  # fmt: skip
    flops = 2 * 64 * 1024 * 4096
    compute = flops / (1e12 * (64 / 96) * (1024 / 1056) * (4096 / 4128))
    packed = 4 * 1024 * 4096 / 4e9
    moved = 4 * (64 * 1024 + 1024 * 4096 + 64 * 4096) / 1e10
    assert compute < moved
    cpu = described(tmp_path, DEVICE | {"pack_bandwidth": 4e9})
    assert priced(op, graph, cpu).seconds == pytest.approx(moved + packed + 1e-6)
    assert round((moved + packed + 1e-6) * 1e3, 2) == 6.00
