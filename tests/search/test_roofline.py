"""The roofline compute model (`cost.compute.op_cost`) against hand-computed times on the H100
preset: 989 TFLOP/s bf16 matrix peak at 0.8, 67 TFLOP/s vector, 3.35 TB/s HBM at 0.85 (an op
moving at most 25 MiB: the L2's 8 TB/s at 0.85), a 2 us launch floor, matmul half-speed dim
64, misaligned matmuls at 0.2, broadcast or permuted reads at 0.5, transposed ones at 0.17
(measured on an H100: bench/data/h100)."""

import numpy as np
import pytest

from autoshard.cost.cluster import make_cluster
from autoshard.cost.compute import OpCost, matmul_efficiency, op_cost
from autoshard.ir.graph import Graph, Op, Value
from autoshard.rules import rule_for
from autoshard.rules.gradient import TRAIN, TrainOp
from autoshard.sharding import ShardingOption

HBM = 3.35e12 * 0.85  # bytes/s a streaming kernel reaches
L2 = 8e12 * 0.85  # the same, moving at most half the L2 (25 MiB)
STRIDED, TRANSPOSED = 0.5, 0.17
LAUNCH = 2e-6
VECTOR = 67e12


def s(d):
    """A matmul dim's share of the large-shape efficiency: d / (d + 64)."""
    return d / (d + 64)


def one_op(op_type, inputs, output, attrs=None, constants=None, dtype="bfloat16"):
    """A graph of one op named `op` reading `inputs` ({name: shape}) into `y` of `output`."""
    values = {n: Value(n, shape, "int64" if n == "ids" else dtype) for n, shape in inputs.items()}
    values["y"] = Value("y", output, dtype)
    constants = {k: np.asarray(v) for k, v in (constants or {}).items()}
    for name, array in constants.items():
        values[name] = Value(name, array.shape, "int64")
    op = Op("op", op_type, inputs=(*inputs, *constants), outputs=("y",), attrs=attrs or {})
    graph = Graph("g", (op,), values, tuple(inputs), ("y",), {}, constants)
    return op, graph


def cost(op, graph, option, mesh="1"):
    rule = rule_for(op, graph)
    option = ShardingOption.parse(option, len(rule.loops)) if option is not None else None
    return op_cost(op, rule, option, graph, make_cluster(mesh=mesh))


def test_a_large_matmul_is_compute_bound_below_peak():
    """[4096, 4096] @ [4096, 4096] bf16 on one H100: 2·4096³ FLOPs at 989e12 · 0.8 · s(4096)³
    (= 0.764 of the datasheet) take 182 us, 184 with the launch; its 3 · 32 MiB move in 35."""
    op, graph = one_op("MatMul", {"x": (4096, 4096), "w": (4096, 4096)}, (4096, 4096))
    flops, moved = 2 * 4096**3, 3 * 4096 * 4096 * 2
    seconds = flops / (989e12 * 0.8 * s(4096) ** 3) + LAUNCH
    assert cost(op, graph, "[]") == OpCost(flops, moved, pytest.approx(seconds))
    assert seconds == pytest.approx(183.98e-6, rel=1e-4)


def test_a_tensor_parallel_shard_is_thinner_and_slower_per_flop():
    """The same matmul with n split 8 ways: N = 512 locally, s(512) = 0.889 instead of 0.985:
    the shard runs 1/8 of the FLOPs at 90% of the whole's rate."""
    op, graph = one_op("MatMul", {"x": (4096, 4096), "w": (4096, 4096)}, (4096, 4096))
    flops = 2 * 4096 * 512 * 4096
    moved = (4096 * 4096 + 4096 * 512 + 4096 * 512) * 2
    seconds = flops / (989e12 * 0.8 * s(4096) ** 2 * s(512)) + LAUNCH
    assert cost(op, graph, "[[], [0]]", mesh="8") == OpCost(flops, moved, pytest.approx(seconds))


@pytest.mark.parametrize(
    "shape, expected",
    [
        ((4096, 4096, 4096), 0.8 * s(4096) ** 3),
        # K, N not a multiple of 8: the preset's misaligned_efficiency
        ((4096, 4100, 4096), 0.8 * s(4096) ** 2 * s(4100) * 0.2),
        ((4096, 4096, 4092), 0.8 * s(4096) ** 2 * s(4092) * 0.2),
        ((16, 4096, 4096), 0.8 * s(16) * s(4096) ** 2),  # a thin M: 20% of the large rate
    ],
    ids=["aligned", "odd-K", "odd-N", "thin-M"],
)
def test_matmul_efficiency(shape, expected):
    m, k, n = shape
    op, graph = one_op("MatMul", {"x": (m, k), "w": (k, n)}, (m, n))
    rule, cluster = rule_for(op, graph), make_cluster(mesh="1")
    option = ShardingOption(((),) * 3)
    assert matmul_efficiency(rule, option, cluster.mesh, "bfloat16", cluster.device) == (
        pytest.approx(expected)
    )


def test_an_attention_score_matmul_with_k_64_is_memory_bound():
    """Q [8, 12, 512, 64] @ Kᵀ [8, 12, 64, 512]: 2·96·512²·64 = 3.2e9 FLOPs at
    989e12·0.8·s(512)²·s(64) (0.316 of peak) take 10.3 us; the two 6 MiB operands and the
    48 MiB of scores take 22.1 us at 2.85 TB/s: memory-bound."""
    op, graph = one_op("MatMul", {"q": (8, 12, 512, 64), "k": (8, 12, 64, 512)}, (8, 12, 512, 512))
    flops = 2 * 96 * 512 * 512 * 64
    moved = (2 * 96 * 512 * 64 + 96 * 512 * 512) * 2
    assert flops / (989e12 * 0.8 * s(512) ** 2 * s(64)) < moved / HBM
    assert cost(op, graph, "[]") == OpCost(flops, moved, pytest.approx(moved / HBM + LAUNCH))


def test_softmax_reads_twice_and_writes_once():
    """Softmax over the last axis of [8, 12, 128, 128] bf16: E = 1572864 elements, 5 FLOPs
    each at the vector rate (0.12 us) vs 2 reads + 1 write of 2 bytes each = 9437184 bytes in
    the L2 at 6.8 TB/s (1.39 us): memory-bound, 3.39 us with the launch (5.31 from HBM)."""
    op, graph = one_op("Softmax", {"x": (8, 12, 128, 128)}, (8, 12, 128, 128), {"axis": -1})
    elements = 8 * 12 * 128 * 128
    expected = OpCost(5 * elements, 6 * elements, pytest.approx(6 * elements / L2 + LAUNCH))
    assert cost(op, graph, "[]") == expected
    assert expected.seconds == pytest.approx(3.388e-6, rel=1e-3)
    # split over heads on 4 devices: a quarter of the traffic, the same launch floor
    split = cost(op, graph, "[[], [0]]", mesh="4")
    assert split.bytes == 6 * elements // 4
    assert split.seconds == pytest.approx(6 * elements / 4 / L2 + LAUNCH)


def test_the_l2_holds_what_moves_at_most_25_mib():
    """The same softmax over [8, 12, 256, 256] (4x: 36 MiB moved) streams from HBM."""
    op, graph = one_op("Softmax", {"x": (8, 12, 256, 256)}, (8, 12, 256, 256), {"axis": -1})
    moved = 6 * 8 * 12 * 256 * 256
    assert moved > 25 << 20
    assert cost(op, graph, "[]").seconds == pytest.approx(moved / HBM + LAUNCH)
    # 2 ways over heads: 18 MiB a device, in the L2
    assert cost(op, graph, "[[], [0]]", mesh="2").seconds == pytest.approx(moved / 2 / L2 + LAUNCH)


def test_a_gather_moves_the_rows_it_reads_not_the_table():
    """An embedding [50257, 768] bf16 looked up by ids [8, 128]: 1024 rows of 768 (1.5 MiB)
    read, 8 KiB of int64 ids, 1.5 MiB written; no FLOPs. The table is 73.6 MiB: pricing it
    would be 25x too high."""
    op, graph = one_op("Gather", {"table": (50257, 768), "ids": (8, 128)}, (8, 128, 768))
    moved = 1024 * 768 * 2 + 1024 * 8 + 1024 * 768 * 2
    assert cost(op, graph, "[]") == OpCost(0, moved, pytest.approx(moved / L2 + LAUNCH))
    # vocabulary split 8 ways (each device masks its rows): still the rows read, at most
    assert cost(op, graph, "[[], [], [], [0]]", mesh="8").bytes == moved


def test_a_small_table_is_read_whole():
    """Positions [16, 768] looked up by 1024 ids: the table (24 KiB) is less than the rows."""
    op, graph = one_op("Gather", {"table": (16, 768), "ids": (8, 128)}, (8, 128, 768))
    assert cost(op, graph, "[]").bytes == 16 * 768 * 2 + 1024 * 8 + 1024 * 768 * 2


def test_a_lookups_table_gradient_is_a_scatter_add():
    """The gradient of an embedding [50257, 768] bf16 looked up by ids [8, 128] with respect
    to its table: the [50257, 768] gradient written once (73.6 MiB), the 1024 x 768 gradient
    read and its rows read and written (1.5 MiB each): at HBM's rate, 786432 additions. Not
    the masked product over every row (1024 x 768 x 50257 multiply-adds, 18 ms at the vector
    rate: 600 times as long). Vocabulary split 8 ways: an eighth of the table's gradient, the
    same rows at most."""
    op, graph = one_op("Gather", {"table": (50257, 768), "ids": (8, 128)}, (8, 128, 768))
    values = {**graph.values, "dy": Value("dy", (8, 128, 768), "bfloat16"),
              "dtable": Value("dtable", (50257, 768), "bfloat16")}  # fmt: skip
    grad = Op("op@grad0", TrainOp.GRAD, TRAIN, ("table", "ids", "dy"), ("dtable",),
              {"op": "op", "operand": 0})  # fmt: skip
    graph = Graph("g", (op, grad), values, ("table", "ids", "dy"), ("dtable",), {}, {})
    rows = 1024 * 768
    moved = 50257 * 768 * 2 + 3 * rows * 2
    assert cost(grad, graph, "[]") == OpCost(rows, moved, pytest.approx(moved / HBM + LAUNCH))
    split = cost(grad, graph, "[[], [], [], [0]]", mesh="8")
    assert split.flops == rows and split.bytes == 6283 * 768 * 2 + 3 * rows * 2


def test_a_transpose_reads_and_writes_once():
    """[8, 128, 12, 64] -> [8, 12, 128, 64] bf16: 786432 elements read and written (3 MiB),
    permuted with the innermost axis kept: at half the L2's rate (an H100's eager copy)."""
    op, graph = one_op(
        "Transpose", {"x": (8, 128, 12, 64)}, (8, 12, 128, 64), {"perm": [0, 2, 1, 3]}
    )
    moved = 2 * 786432 * 2
    expected = moved / (L2 * STRIDED) + LAUNCH
    assert cost(op, graph, "[]") == OpCost(0, moved, pytest.approx(expected))
    assert expected == pytest.approx(2.925e-6, rel=1e-3)


def test_a_transpose_of_the_innermost_axis_reads_at_a_sixth():
    """Keys [8, 2048, 32, 128] -> [8, 32, 128, 2048] (an attention's Kᵀ made contiguous):
    256 MiB read and written at 0.17 of HBM's rate, 553 us."""
    op, graph = one_op(
        "Transpose", {"x": (8, 2048, 32, 128)}, (8, 32, 128, 2048), {"perm": [0, 2, 3, 1]}
    )
    moved = 2 * 8 * 2048 * 32 * 128 * 2
    assert cost(op, graph, "[]").seconds == pytest.approx(moved / (HBM * TRANSPOSED) + LAUNCH)


def test_a_split_along_an_inner_axis_reads_rows_of_a_stride():
    """A fused QKV [8, 2048, 4800] split in three along the last axis reads strided rows;
    along the first axis (of 3) each part is one contiguous block."""
    inner = Op("op", "Split", inputs=("x",), outputs=("q", "k", "v"), attrs={"axis": 2})
    values = {"x": Value("x", (8, 2048, 4800), "bfloat16")} | {
        n: Value(n, (8, 2048, 1600), "bfloat16") for n in "qkv"
    }
    graph = Graph("g", (inner,), values, ("x",), tuple("qkv"), {}, {})
    moved = 2 * 8 * 2048 * 4800 * 2
    assert cost(inner, graph, "[]").seconds == pytest.approx(moved / (HBM * STRIDED) + LAUNCH)
    outer = Op("op", "Split", inputs=("x",), outputs=("q", "k", "v"), attrs={"axis": 0})
    values = {"x": Value("x", (3, 2048, 4800), "bfloat16")} | {
        n: Value(n, (1, 2048, 4800), "bfloat16") for n in "qkv"
    }
    graph = Graph("g", (outer,), values, ("x",), tuple("qkv"), {}, {})
    moved = 2 * 3 * 2048 * 4800 * 2
    assert cost(outer, graph, "[]").seconds == pytest.approx(moved / HBM + LAUNCH)


def test_a_view_is_free():
    op, graph = one_op(
        "Reshape", {"x": (8, 128, 768)}, (8, 128, 12, 64), constants={"shape": [8, 128, 12, 64]}
    )
    assert cost(op, graph, "[]") == OpCost(0, 0, 0.0)


def test_an_elementwise_add_broadcasts_its_bias_once():
    """[8, 128, 768] + [768] bf16: the activation and the bias read, the result written, at
    half the rate (the broadcast operand costs a GPU's kernel its vectorized loads)."""
    op, graph = one_op("Add", {"x": (8, 128, 768), "b": (768,)}, (8, 128, 768))
    elements = 8 * 128 * 768
    moved = (2 * elements + 768) * 2
    expected = OpCost(elements, moved, pytest.approx(moved / (L2 * STRIDED) + LAUNCH))
    assert cost(op, graph, "[]") == expected


def test_a_constant_number_and_a_norms_parameters_are_no_broadcast_reads():
    """x * 0.125 (a one-element constant: the kernel takes a number) and a LayerNorm's scale
    and bias (read once per row by its fused kernel) stream at the full rate; x * s with s a
    one-element input is a broadcast read."""
    shape = (8, 2048, 1024)
    elements = 8 * 2048 * 1024
    values = {n: Value(n, shape, "bfloat16") for n in ("x", "y")}
    values["c"] = Value("c", (), "bfloat16")
    scaled = Op("op", "Mul", inputs=("x", "c"), outputs=("y",))
    graph = Graph("g", (scaled,), values, ("x",), ("y",), {}, {"c": np.array(0.125)})
    assert cost(scaled, graph, "[]").seconds == pytest.approx(4 * elements / HBM + LAUNCH)
    graph = Graph("g", (scaled,), values, ("x", "c"), ("y",), {}, {})
    assert cost(scaled, graph, "[]").seconds == pytest.approx(
        (4 * elements + 2) / (HBM * STRIDED) + LAUNCH
    )
    op, graph = one_op(
        "LayerNormalization", {"x": shape, "w": (1024,), "b": (1024,)}, shape, {"axis": -1}
    )
    moved = 2 * (2 * (elements + 2 * 1024) + elements)
    assert cost(op, graph, "[]").seconds == pytest.approx(moved / HBM + LAUNCH)


def test_an_op_without_a_rule_runs_whole():
    """No rule: its outputs' elements as FLOPs, every input and output moved whole."""
    op, graph = one_op("Add", {"x": (64, 64), "b": (64, 64)}, (64, 64))
    assert cost(op, graph, None) == OpCost(
        4096, 3 * 4096 * 2, pytest.approx(3 * 8192 / L2 + LAUNCH)
    )


def test_float32_matmul_runs_at_the_vector_peak():
    """No tensor-core rate for float32 on the preset: 67 TFLOP/s, at the same efficiency."""
    op, graph = one_op(
        "MatMul", {"x": (2048, 2048), "w": (2048, 2048)}, (2048, 2048), dtype="float32"
    )
    flops = 2 * 2048**3
    seconds = flops / (VECTOR * 0.8 * s(2048) ** 3) + LAUNCH
    assert cost(op, graph, "[]").seconds == pytest.approx(seconds)
