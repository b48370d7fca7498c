"""Every rule against onnxruntime: each case is one node; every splittable loop of its rule is
split over two simulated devices and the combined result must equal the op run whole (see
rules_oracle). `kinds` pins the loop kinds by hand: p parallel, i invalid, or the reduction."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper
from rules_oracle import Case, Data, Oracle, Param, case, check_rule, i64, kinds

from autoshard.rules import OpRule, supported_op_types

F = np.float32
D = Data


def unary(op: str, gen: str = "f", opset: int = 17, **attrs) -> Case:
    return case(op, (D((4, 6), gen),), "p p", opset=opset, **attrs)


def binary(op: str, gen: str = "f", gen_b: str | None = None, **attrs) -> Case:
    """[4, 1, 6] against [2, 6]: both broadcast, the result is [4, 2, 6]."""
    return case(op, (D((4, 1, 6), gen), D((2, 6), gen_b or gen)), "p p p", **attrs)


def ids(*values, shape=None) -> Data:
    """Fixed int64 indices."""
    array = np.array(values, dtype=np.int64)
    return D(array.shape, array=array if shape is None else array.reshape(shape))


def scatter_rows(rows: int, cols: int, take: int) -> Data:
    """[take, cols] indices, distinct in each column (so the scatter is deterministic)."""
    rng = np.random.default_rng(0)
    array = np.stack([rng.permutation(rows)[:take] for _ in range(cols)], axis=1)
    return D(array.shape, array=array.astype(np.int64))


UNARY = [
    *(unary(op) for op in ("Relu", "Tanh", "Sigmoid", "Erf", "Exp", "Neg", "Abs", "Sin", "Cos")),
    *(unary(op) for op in ("Atan", "Sinh", "Cosh", "Asinh", "Identity", "Softplus", "Softsign")),
    *(unary(op) for op in ("HardSigmoid", "HardSwish", "Elu", "Selu", "Celu", "ThresholdedRelu")),
    *(unary(op) for op in ("IsNaN", "IsInf", "Floor", "Ceil", "Round", "Sign")),
    *(unary(op, "pos") for op in ("Log", "Sqrt", "Reciprocal")),
    *(unary(op, "unit") for op in ("Tan", "Asin", "Acos", "Atanh")),
    unary("Acosh", "big"),
    unary("Gelu", opset=20),
    unary("Mish", opset=18),
    unary("Swish", opset=24),
    unary("Not", "bool"),
    unary("BitwiseNot", "int32", opset=18),
    unary("Cast", to=7),
    unary("LeakyRelu", alpha=0.2),
    unary("Shrink", lambd=0.5),
    case("CastLike", (D((4, 6)), Param(np.zeros((), np.int32))), "p p"),
    case("Clip", (D((4, 6)), Param(F(-0.5)), Param(F(0.5))), "p p"),
    case("Clip-max-only", (D((4, 6)), None, Param(F(0.5))), "p p"),
    case("Dropout", (D((4, 6)), Param(F(0.3))), "p p", outputs=2),
]

BROADCAST = [
    *(binary(op) for op in ("Add", "Sub", "Mul", "Max", "Min", "Sum", "Mean", "Less")),
    *(binary(op) for op in ("LessOrEqual", "Greater", "GreaterOrEqual")),
    *(binary(op, "bool") for op in ("And", "Or", "Xor")),
    *(binary(op, "int32", opset=18) for op in ("BitwiseAnd", "BitwiseOr", "BitwiseXor")),
    binary("Div", "f", "pos"),
    binary("Pow", "pos"),
    binary("Equal", "int"),
    binary("Mod", "int", "nz"),
    binary("BitShift", "uint", direction="LEFT"),
    case("Max-variadic", (D((4, 6)), D((6,)), D((4, 1))), "p p"),
    case("PRelu", (D((4, 6)), D((6,), "pos")), "p p"),
    case("Where", (D((4, 1), "bool"), D((4, 6)), D((6,))), "p p"),
    case("Expand", (D((4, 1)), i64(2, 4, 6)), "p p p", shape_param=1),
]

EINSUM = [
    case("MatMul-2d", (D((4, 6)), D((6, 8))), "p p sum"),
    case("MatMul-batched-broadcast", (D((4, 1, 6, 8)), D((2, 8, 10))), "p p p p sum"),
    case("MatMul-1d-lhs", (D((8,)), D((2, 8, 6))), "p p sum"),
    case("MatMul-1d-rhs", (D((2, 6, 8)), D((8,))), "p p sum"),
    case("MatMul-1d-both", (D((8,)), D((8,))), "sum"),
    case("Gemm", (D((4, 6)), D((6, 8))), "p p sum"),
    case(
        "Gemm-transB-bias",
        (D((4, 6)), D((8, 6)), D((8,))),
        "p p sum",
        transB=1,
        alpha=0.5,
        beta=2.0,
    ),
    case("Gemm-transA-bias-2d", (D((6, 4)), D((6, 8)), D((4, 8))), "p p sum", transA=1),
    case("Gemm-bias-column", (D((4, 6)), D((6, 8)), D((4, 1))), "p p sum"),
    case("Einsum-batched", (D((2, 4, 6)), D((2, 6, 8))), "p p p sum", equation="bij,bjk->bik"),
    case(
        "Einsum-attention",
        (D((2, 4, 6, 8)), D((2, 4, 10, 8))),
        "p p p p sum",
        equation="bhqd,bhkd->bhqk",
    ),
    case("Einsum-ellipsis", (D((2, 4, 6)), D((6, 8))), "p p p sum", equation="...ij,jk->...ik"),
    case("Einsum-implicit", (D((4, 6)), D((6, 8))), "p p sum", equation="ij,jk"),
    case("Einsum-row-sum", (D((4, 6)),), "p sum", equation="ij->i"),
    case("Einsum-diagonal", (D((4, 6, 6)),), "p i", equation="bii->bi"),
    case("Einsum-outer", (D((4,)), D((6,))), "p p", equation="i,j->ij"),
]

REDUCE = [
    case("ReduceSum-axes-input", (D((4, 6, 8)), i64(1)), "p sum p"),
    case("ReduceSum-drop-last", (D((4, 6, 8)), i64(-1)), "p p sum", keepdims=0),
    case("ReduceSum-all", (D((4, 6)),), "sum sum", keepdims=0),
    case("ReduceSum-noop", (D((4, 6)),), "p p", noop_with_empty_axes=1),
    case("ReduceMean-attr", (D((4, 6, 8)),), "p average average", axes=[1, 2]),
    case("ReduceMean-opset18", (D((4, 6, 8)), i64(-1)), "p p average", opset=18),
    case("ReduceMax", (D((4, 6)),), "p max", axes=[1]),
    case("ReduceMin", (D((4, 6)),), "min p", axes=[0], keepdims=0),
    case("ReduceProd", (D((4, 6), "pos"),), "p product", axes=[1]),
    case("ReduceL1", (D((4, 6)),), "p sum", axes=[1]),
    case("ReduceSumSquare", (D((4, 6)),), "p sum", axes=[1]),
    case("ReduceL2", (D((4, 6)),), "p i", axes=[1]),
    case("ReduceLogSum", (D((4, 6), "pos"),), "p i", axes=[1]),
    case("ReduceLogSumExp", (D((4, 6)),), "i p", axes=[0]),
    case("Softmax", (D((4, 6, 8)),), "p p i"),
    case("Softmax-axis1", (D((4, 6, 8)),), "p i p", axis=1),
    case("LogSoftmax", (D((4, 6)),), "p i"),
    case("Hardmax", (D((4, 6)),), "i p", axis=0),
    case("ArgMax", (D((4, 6, 8)),), "p i p", axis=1, keepdims=0),
    case("ArgMin", (D((4, 6)),), "p i", axis=-1),
    case("TopK", (D((4, 6, 8)), i64(3)), "p p i", outputs=2),
    case("TopK-axis0", (D((8, 6)), i64(2)), "i p", axis=0, outputs=2),
]

IMAGE = D((2, 4, 6, 6))
NN = [
    case("LayerNormalization", (D((4, 6, 8)), D((8,)), D((8,))), "p p i", outputs=3),
    case("LayerNormalization-axis1", (D((4, 6, 8)), D((6, 8))), "p i i", axis=1),
    case("RMSNormalization", (D((4, 6, 8)), D((8,))), "p p i", opset=23),
    # onnxruntime's RMS norm in the ONNX domain: onnx has no shape inference for it
    case(
        "SimplifiedLayerNormalization", (D((4, 6, 8)), D((8,))), "p p i", outputs=2, hand_built=True
    ),  # fmt: skip
    # Grouped-query attention (4 query heads over 2 key-value heads), mask [B, 1, Sq, T]:
    # loops batch, head groups, heads in a group, queries, keys, head size.
    case(
        "Attention",
        (D((2, 4, 4, 8)), D((2, 2, 6, 8)), D((2, 2, 6, 8)), D((2, 1, 4, 6))),
        "p p i p i i",
        opset=23,
    ),
    # (a causal Attention's query split needs its mask written out: tests/e2e/
    # test_partition_attention.py checks it with that rewrite)
    case(
        "RotaryEmbedding",
        (D((2, 4, 6, 8)), D((16, 4)), D((16, 4)), D((2, 6), array=np.arange(12).reshape(2, 6))),
        "p p p i",
        opset=23,
    ),
    case(
        "BatchNormalization",
        (D((4, 6, 4, 2)), D((6,)), D((6,)), D((6,)), D((6,), "pos")),
        "p p p p",
    ),
    case("InstanceNormalization", (D((4, 6, 4, 2)), D((6,)), D((6,))), "p p i i"),
    # onnx has no shape inference for GroupNormalization (a function op): built by hand
    case(
        "GroupNormalization",
        (D((4, 6, 4, 2)), D((6,)), D((6,))),
        "p p i i",
        num_groups=2,
        opset=21,
        hand_built=True,
    ),
    case("Conv-bias", (IMAGE, D((6, 4, 3, 3)), D((6,))), "p p i i sum i i", pads=[1, 1, 1, 1]),
    case(
        "Conv-stride-dilation",
        (D((2, 4, 9, 9)), D((6, 4, 3, 3))),
        "p p i i sum i i",
        strides=[2, 2],
        dilations=[2, 2],
    ),
    case("Conv-1d", (D((2, 4, 8)), D((6, 4, 3)), D((6,))), "p p i sum i"),
    case("Conv-depthwise", (IMAGE, D((4, 1, 3, 3)), D((4,))), "p p i i i i i", group=4),
    case("Conv-depthwise-multiplier", (IMAGE, D((8, 1, 3, 3))), "p p i i i i i", group=4),
    case("Conv-grouped", (IMAGE, D((6, 2, 3, 3)), D((6,))), "p p i i i i i", group=2),
    case("MaxPool", (IMAGE,), "p p i i i i", kernel_shape=[2, 2], strides=[2, 2]),
    case("AveragePool-pads", (IMAGE,), "p p i i i i", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
    case("LpPool", (D((2, 4, 6)),), "p p i i", kernel_shape=[2]),
    case("GlobalAveragePool", (IMAGE,), "p p average average"),
    case("GlobalMaxPool", (IMAGE,), "p p max max"),
    case("GlobalLpPool", (IMAGE,), "p p i i"),
]

SHAPE = [
    case("Transpose", (D((2, 4, 6)),), "p p p", perm=[1, 2, 0]),
    case("Transpose-default", (D((2, 4, 6)),), "p p p"),
    case("Reshape-split-heads", (D((2, 6, 768)), i64(2, 6, 12, 64)), "p p p", shape_param=1),
    case("Reshape-merge-heads-0-1", (D((2, 6, 12, 64)), i64(0, 0, -1)), "p p p", shape_param=1),
    case("Reshape-flatten-batch", (D((2, 16, 8)), i64(-1, 8)), "p p", shape_param=1),
    case("Reshape-regroup", (D((4, 6)), i64(8, 3)), "p", shape_param=1),
    case("Reshape-size-1", (D((4, 1, 6)), i64(1, 4, 6, 1)), "p p", shape_param=1),
    case("Flatten", (D((2, 4, 6, 8)),), "p p", axis=2),
    case("Squeeze", (D((4, 1, 6)), i64(1)), "p p"),
    case("Unsqueeze", (D((4, 6)), i64(0, 2)), "p p"),
    case("Concat", (D((4, 2, 6)), D((4, 4, 6))), "p i p", axis=1),
    case("Split", (D((4, 6, 2)), i64(2, 4)), "p i p", axis=1, outputs=2),
    case("Split-num-outputs", (D((4, 6)),), "p i", axis=-1, num_outputs=3, outputs=3, opset=18),
    case("Slice", (D((4, 6, 8)), i64(1), i64(5), i64(2)), "p p i"),
    case("Slice-full-axis", (D((4, 6, 8)), i64(0, 1), i64(4, 5)), "p i p"),
    case("Slice-reverse", (D((4, 6)), i64(-1), i64(-100), i64(0), i64(-1)), "i p"),
    case("Gather-embedding", (D((8, 6)), ids(0, 5, 2, 7, 1, 4, 3, 6, shape=(2, 4))), "p p p sum"),
    case(
        "Gather-negative-ids",
        (D((8, 6)), ids(-1, 0, 3, -5, 7, 4, -8, 2, shape=(2, 4))),
        "p p p sum",
    ),
    case("Gather-axis1", (D((4, 8, 6)), ids(1, 6, 7, 2, shape=(2, 2))), "p p p p sum", axis=1),
    case("Gather-scalar", (D((8, 6)), ids(5, shape=())), "p sum"),
    # Constant ids, block-local along their dim 0 (BERT's mask gather): no reduction loop.
    case("Gather-block-local", (D((8, 6)), Param(np.arange(8).reshape(2, 4))), "p p p"),
    case(
        "Gather-block-local-axis1", (D((3, 8)), Param(np.array([[1, 0], [5, 4]]))), "p p p", axis=1
    ),
    case("GatherElements", (D((4, 6)), ids(*[0, 5, 2, 3] * 4, shape=(4, 4))), "p i", axis=1),
    case("GatherND", (D((4, 6, 8)), ids(0, 3, 1, 2, 2, 0, 3, 1, shape=(2, 4, 1))), "p p p p i"),
    # Constant ids [r, c] = (2r + c, 2c + r): component 0 local to row blocks, 1 to columns.
    case(
        "GatherND-block-local",
        (D((4, 4)), Param(np.array([[[0, 0], [1, 2]], [[2, 1], [3, 3]]]))),
        "p p",
    ),
    case(
        "GatherND-batch",
        (D((2, 6, 8)), ids(0, 5, 1, 2, 4, 0, 3, 1, shape=(2, 4, 1))),
        "p p p i",
        batch_dims=1,
    ),
    case("ScatterND", (D((6, 8)), ids(4, 1, shape=(2, 1)), D((2, 8))), "i p i"),
    case("ScatterElements", (D((6, 4)), scatter_rows(6, 4, 2), D((2, 4))), "i p i"),
    case("Trilu", (D((2, 4, 4)), i64(1)), "p i i", upper=0),
    case("Tile", (D((4, 6)), i64(1, 2)), "p i"),
    case("Pad", (D((4, 6)), i64(0, 1, 0, 1)), "p i"),
    case("Pad-axes", (D((4, 6)), i64(1, 2), Param(F(0.5)), i64(0)), "i p", opset=18),
    case("Resize-sizes", (D((2, 4, 4, 4)), None, None, i64(2, 4, 8, 6)), "p p i i", shape_param=3),
    case("CumSum", (D((4, 6)), Param(np.int64(1))), "p i"),
    case("OneHot", (ids(*(k % 8 for k in range(24)), shape=(4, 6)), i64(8), i64(0, 1)), "p p i"),
    # the importer folds a ConstantOfShape of a constant shape away: built by hand
    case(
        "ConstantOfShape",
        (i64(4, 6),),
        "p p",
        shape_param=0,
        hand_built=True,
        value=numpy_helper.from_array(np.array([1.5], F)),
    ),
]

CASES = UNARY + BROADCAST + EINSUM + REDUCE + NN + SHAPE

REPLICATED = {"Shape", "Size", "Range", "NonZero"}
"""Registered to return None (computed replicated): see autoshard/rules/shape.py."""


LINEAR = {
    "Add", "Sub", "Sum", "Neg", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze",
    "Transpose", "Concat", "Split", "Slice", "Expand",
}  # fmt: skip
"""The ops whose rules read and write partial sums (`OpRule.partial`): linear in their data."""


@pytest.mark.parametrize("spec", CASES, ids=lambda c: c.id)
def test_split_matches_whole(spec: Case, tmp_path) -> None:
    oracle = Oracle(spec, tmp_path)
    check_rule(oracle.rule, oracle.op, oracle.graph)
    assert kinds(oracle.rule) == spec.kinds, str(oracle.rule)
    assert bool(oracle.rule.partial) == (spec.op_type in LINEAR), oracle.rule.partial
    whole = oracle.whole()
    loops = oracle.splittable()
    assert loops, f"{spec.id}: no loop to split"
    for loop in loops:
        split = oracle.split(loop)
        for got, want in zip(split, whole, strict=True):
            np.testing.assert_allclose(
                got, want, rtol=1e-5, atol=1e-5, err_msg=f"{spec.id}: loop d{loop} split"
            )


@pytest.mark.parametrize("spec", [c for c in CASES if c.op_type in LINEAR], ids=lambda c: c.id)
def test_partial_sums_in_give_partial_sums_out(spec: Case, tmp_path) -> None:
    """Each data operand cut into two random addends (device 0's and device 1's partial sums):
    the op run on each device's addends, its results summed, equals the op run whole."""
    oracle = Oracle(spec, tmp_path)
    rng = np.random.default_rng(7)
    devices: list[dict[str, np.ndarray]] = [{}, {}]
    for name, array, m in zip(spec.input_names, oracle.arrays, oracle.rule.operands, strict=False):
        if array is None:
            continue
        part = rng.standard_normal(array.shape).astype(array.dtype) if m else array
        devices[0][name], devices[1][name] = part, array - part if m else array
    summed = [a + b for a, b in zip(*(oracle.run(feeds) for feeds in devices), strict=True)]
    for got, want in zip(summed, oracle.whole(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=spec.id)


def test_every_registered_op_type_has_a_case() -> None:
    covered = {spec.op_type for spec in CASES} | REPLICATED
    assert sorted(supported_op_types() - covered) == []


def terse(rule: OpRule) -> tuple[str, list[str], list[str], str]:
    """(loops as `p(4) sum(8) i(3)`, operand maps, result maps, note)."""
    tokens = kinds(rule).split()
    loops = " ".join(f"{t}({loop.size})" for t, loop in zip(tokens, rule.loops, strict=True))
    operands = [str(m) if m is not None else "-" for m in rule.operands]
    return loops, operands, [str(m) for m in rule.results], rule.note


EXACT = {
    "MatMul-batched-broadcast": (
        "p(4) p(2) p(6) p(10) sum(8)",
        ["(d0, 0, d2, d4)", "(d1, d4, d3)"],
        ["(d0, d1, d2, d3)"],
        "",
    ),
    "Gemm": ("p(4) p(8) sum(6)", ["(d0, d2)", "(d2, d1)"], ["(d0, d1)"], ""),
    "Gemm-transB-bias": (
        "p(4) p(8) sum(6)",
        ["(d0, d2)", "(d1, d2)", "(d1)"],
        ["(d0, d1)"],
        "bias_once",
    ),
    "Gemm-bias-column": (
        "p(4) p(8) sum(6)",
        ["(d0, d2)", "(d2, d1)", "(d0, 0)"],
        ["(d0, d1)"],
        "bias_once",
    ),
    "Reshape-split-heads": ("p(2) p(6) p(12)", ["(d0, d1, d2)", "-"], ["(d0, d1, d2, 0)"], ""),
    "Reshape-merge-heads-0-1": ("p(2) p(6) p(12)", ["(d0, d1, d2, 0)", "-"], ["(d0, d1, d2)"], ""),
    "Transpose": ("p(4) p(6) p(2)", ["(d2, d0, d1)"], ["(d0, d1, d2)"], ""),
    "Conv-bias": (
        "p(2) p(6) i(6) i(6) sum(4) i(3) i(3)",
        ["(d0, d4, d2 + d5, d3 + d6)", "(d1, d4, d5, d6)", "(d1)"],
        ["(d0, d1, d2, d3)"],
        "bias_once",
    ),
    "Conv-stride-dilation": (
        "p(2) p(6) i(3) i(3) sum(4) i(3) i(3)",
        ["(d0, d4, 2*d2 + 2*d5, 2*d3 + 2*d6)", "(d1, d4, d5, d6)"],
        ["(d0, d1, d2, d3)"],
        "",
    ),
    "Conv-grouped": (
        "p(2) p(2) i(4) i(4) i(2) i(3) i(3)",
        ["(d0, d1, d2 + d5, d3 + d6)", "(d1, d4, d5, d6)", "(d1)"],
        ["(d0, d1, d2, d3)"],
        "local_group",
    ),
    "Gather-embedding": (
        "p(2) p(4) p(6) sum(8)",
        ["(d3, d2)", "(d0, d1)"],
        ["(d0, d1, d2)"],
        "masked_lookup",
    ),
    "Gather-axis1": (
        "p(4) p(2) p(2) p(6) sum(8)",
        ["(d0, d4, d3)", "(d1, d2)"],
        ["(d0, d1, d2, d3)"],
        "masked_lookup",
    ),
    "Gather-scalar": ("p(6) sum(8)", ["(d1, d0)", "()"], ["(d0)"], "masked_lookup"),
    "Gather-block-local": (
        "p(2) p(4) p(6)",
        ["(d0, d2)", "(d0, d1)"],
        ["(d0, d1, d2)"],
        "masked_lookup",
    ),
    "GatherND-block-local": (
        "p(2) p(2)",
        ["(d0, d1)", "(d0, d1, 0)"],
        ["(d0, d1)"],
        "masked_lookup",
    ),
    "Gather-block-local-axis1": (
        "p(3) p(2) p(2)",
        ["(d0, d1)", "(d1, d2)"],
        ["(d0, d1, d2)"],
        "masked_lookup",
    ),
    "LayerNormalization": (
        "p(4) p(6) i(8)",
        ["(d0, d1, d2)", "(d2)", "(d2)"],
        ["(d0, d1, d2)", "(d0, d1, 0)", "(d0, d1, 0)"],
        "",
    ),
    "GlobalAveragePool": (
        "p(2) p(4) average(6) average(6)",
        ["(d0, d1, d2, d3)"],
        ["(d0, d1, 0, 0)"],
        "",
    ),
}


@pytest.mark.parametrize("case_id", sorted(EXACT), ids=str)
def test_exact_rule(case_id: str, tmp_path) -> None:
    (spec,) = [c for c in CASES if c.id == case_id]
    assert terse(Oracle(spec, tmp_path).rule) == EXACT[case_id]
