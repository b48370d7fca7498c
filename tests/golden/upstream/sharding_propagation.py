"""Upstream's `mlir/test/Dialect/Shard/sharding-propagation.mlir` (LLVM 22), case by case, as
ONNX graphs: tosa elementwise ops as their ONNX ops, `tosa.matmul` and `linalg.matmul` as
MatMul (tosa's zero points and linalg's `outs` have no ONNX input and are not compared).

`expected` is upstream's CHECK lines in our notation (split axes only: see `harness`). The
dynamic grids of the file (`?`, `?x?x?`) are written here as 2x2x2, as autoshard plans for a
mesh of known size; docs/design/upstream-propagation.md lists every case and why.
"""
# ruff: noqa: E501 (the upstream IR below is one op a line, as mlir-opt prints it)

from onnx import helper

from .harness import (
    Case,
    Op,
    held,
    read,
)

n = helper.make_node
T = "tensor<8x16xf32>"


def sigmoid_case(annotations, expected, prologue="", epilogue=""):
    """y = sigmoid(x) on 2x4, x and y 8x16; `prologue`/`epilogue` the upstream shard ops
    before and after the op (they rename x to %x_ and y to %y_)."""
    x = "%x_" if prologue else "%x"
    y = "%y_" if epilogue else "%y"
    return Case(
        mesh="2x4",
        inputs={"x": [8, 16]},
        ops=(Op(n("Sigmoid", ["x"], ["y"], name="sigmoid"), "tosa.sigmoid", 1),),
        outputs=("y",),
        annotations=annotations,
        expected={"sigmoid": expected},
        upstream=f"""
shard.grid @grid(shape = 2x4)
func.func @f(%x: {T}) -> {T} {{{prologue}
  %y = tosa.sigmoid {x} : ({T}) -> {T}{epilogue}
  return {y} : {T}
}}""",
    )


SPLIT_2D = "[[0], [1]]"
SHARD_X = f"""
  %s = shard.sharding @grid split_axes = {SPLIT_2D} : !shard.sharding
  %x_ = shard.shard %x to %s{{}} : {T}"""
SHARD_Y = f"""
  %t = shard.sharding @grid split_axes = {SPLIT_2D} : !shard.sharding
  %y_ = shard.shard %y to %t{{}} : {T}"""
FOR_USERS = " annotate_for_users"


def batch_matmul(annotations, expected, shard_a="", shard_b="", shard_y=""):
    """y[2, 16, 32] = a[2, 16, 8] @ b[2, 8, 32] (tosa.matmul, batched) on 2x4; each `shard_*`
    is a split_axes to annotate with (a `+` after it: for users)."""
    lines, refs = [], {}
    for name, spec, shape in (("a", shard_a, "2x16x8"), ("b", shard_b, "2x8x32")):
        refs[name] = f"%{name}"
        if spec:
            axes, users = spec.rstrip("+"), FOR_USERS if spec.endswith("+") else ""
            lines += [
                f"  %s{name} = shard.sharding @grid split_axes = {axes} : !shard.sharding",
                f"  %{name}_ = shard.shard %{name} to %s{name}{users} : tensor<{shape}xf32>",
            ]
            refs[name] = f"%{name}_"
    y_type, ret = "tensor<2x16x32xf32>", "%y"
    tail = []
    if shard_y:
        tail = [
            f"  %sy = shard.sharding @grid split_axes = {shard_y} : !shard.sharding",
            f"  %y_ = shard.shard %y to %sy : {y_type}",
        ]
        ret = "%y_"
    body = "\n".join(
        lines
        + [
            "  %zp = arith.constant dense<0.0> : tensor<1xf32>",
            f"  %y = tosa.matmul {refs['a']}, {refs['b']}, %zp, %zp : (tensor<2x16x8xf32>, tensor<2x8x32xf32>, tensor<1xf32>, tensor<1xf32>) -> {y_type}",
        ]
        + tail
    )
    return Case(
        mesh="2x4",
        inputs={"a": [2, 16, 8], "b": [2, 8, 32]},
        ops=(Op(n("MatMul", ["a", "b"], ["y"], name="mm"), "tosa.matmul", 2),),
        outputs=("y",),
        annotations=annotations,
        expected={"mm": expected},
        upstream=f"""
shard.grid @grid(shape = 2x4)
func.func @f(%a: tensor<2x16x8xf32>, %b: tensor<2x8x32xf32>) -> {y_type} {{
{body}
  return {ret} : {y_type}
}}""",
    )


def arrow():
    """t = tanh(x); returns abs(t) and neg(t), the latter annotated as produced."""
    return Case(
        mesh="2x4",
        inputs={"x": [8, 16]},
        ops=(
            Op(n("Tanh", ["x"], ["t"], name="tanh"), "tosa.tanh", 1),
            Op(n("Abs", ["t"], ["a"], name="abs"), "tosa.abs", 1),
            Op(n("Neg", ["t"], ["g"], name="neg"), "tosa.negate", 1),
        ),
        outputs=("a", "g"),
        annotations=(held("g", SPLIT_2D),),
        expected={
            "tanh": ((SPLIT_2D,), SPLIT_2D),
            "abs": ((SPLIT_2D,), SPLIT_2D),
            "neg": ((SPLIT_2D,), SPLIT_2D),
        },
        upstream=f"""
shard.grid @grid(shape = 2x4)
func.func @f(%x: {T}) -> ({T}, {T}) {{
  %zp = arith.constant dense<0.0> : tensor<1xf32>
  %t = tosa.tanh %x : ({T}) -> {T}
  %a = tosa.abs %t : ({T}) -> {T}
  %g = tosa.negate %t, %zp, %zp : ({T}, tensor<1xf32>, tensor<1xf32>) -> {T}
  %s = shard.sharding @grid split_axes = {SPLIT_2D} : !shard.sharding
  %g_ = shard.shard %g to %s : {T}
  return %a, %g_ : {T}, {T}
}}""",
    )


def conflicting():
    """y[2, 2] = a[2, 3] @ b[3, 2] on 2 devices: a produced row-split, y produced replicated;
    the result's annotation wins and a is read replicated."""
    return Case(
        mesh="2",
        inputs={"a": [2, 3], "b": [3, 2]},
        ops=(Op(n("MatMul", ["a", "b"], ["y"], name="mm"), "linalg.matmul", 2),),
        outputs=("y",),
        annotations=(held("a", "[[0]]"), held("y", "[[]]")),
        expected={"mm": (("[[]]", "[[]]"), "[[]]")},
        # Fewest bytes: gathering y (4 elements) after the op moves less than gathering a (6)
        # before it, so autoshard computes row-split and reshards y to its annotation.
        ours={"mm": (("[[0]]", "[[]]"), "[[0]]")},
        upstream="""
shard.grid @grid(shape = 2)
func.func @f(%a: tensor<2x3xf32>, %b: tensor<3x2xf32>, %out: tensor<2x2xf32>) -> tensor<2x2xf32> {
  %sa = shard.sharding @grid split_axes = [[0]] : !shard.sharding
  %a_ = shard.shard %a to %sa : tensor<2x3xf32>
  %y = linalg.matmul ins(%a_, %b : tensor<2x3xf32>, tensor<3x2xf32>) outs(%out : tensor<2x2xf32>) -> tensor<2x2xf32>
  %sy = shard.sharding @grid split_axes = [[]] : !shard.sharding
  %y_ = shard.shard %y to %sy : tensor<2x2xf32>
  return %y_ : tensor<2x2xf32>
}""",
    )


ALL = "[[], [], [0, 1, 2]]"


def mlp(w1, w2, h, annotations, expected, kept):
    """The weight-stationary MLP of the framework's paper (Figure 2) on 2x2x2: y = sigmoid(x @
    w1) @ w2 over a batch of 2, x 4x8, w1 8x32, w2 32x8; x and y produced split over all three
    axes, w1 and w2 as given; where `h`, h produced as x and y read so by its users too."""
    mm = "tosa.matmul {}, %zp, %zp : (tensor<2x4x{}xf32>, tensor<2x{}xf32>, tensor<1xf32>, tensor<1xf32>) -> tensor<2x4x{}xf32>"
    h_shard = "\n  %h_ = shard.shard %h to %sx : tensor<2x4x32xf32>" if h else ""
    y_ret = "%y_u" if h else "%y_"
    y_users = (
        "\n  %y_u = shard.shard %y_ to %sx annotate_for_users : tensor<2x4x8xf32>" if h else ""
    )
    return Case(
        mesh="2x2x2",
        inputs={"x": [2, 4, 8], "w1": [2, 8, 32], "w2": [2, 32, 8]},
        ops=(
            Op(n("MatMul", ["x", "w1"], ["h"], name="mm1"), "tosa.matmul", 2),
            Op(n("Sigmoid", ["h"], ["a"], name="sigmoid"), "tosa.sigmoid", 1),
            Op(n("MatMul", ["a", "w2"], ["y"], name="mm2"), "tosa.matmul", 2),
        ),
        outputs=("y",),
        annotations=annotations,
        expected=expected,
        ours=kept,
        upstream=f"""
shard.grid @grid(shape = 2x2x2)
func.func @f(%x: tensor<2x4x8xf32>, %w1: tensor<2x8x32xf32>, %w2: tensor<2x32x8xf32>) -> tensor<2x4x8xf32> {{
  %zp = arith.constant dense<0.0> : tensor<1xf32>
  %sx = shard.sharding @grid split_axes = {ALL} : !shard.sharding
  %x_ = shard.shard %x to %sx : tensor<2x4x8xf32>
  %s1 = shard.sharding @grid split_axes = {w1} : !shard.sharding
  %w1_ = shard.shard %w1 to %s1 : tensor<2x8x32xf32>
  %h = {mm.format("%x_, %w1_", 8, "8x32", 32)}{h_shard}
  %a = tosa.sigmoid {"%h_" if h else "%h"} : (tensor<2x4x32xf32>) -> tensor<2x4x32xf32>
  %s2 = shard.sharding @grid split_axes = {w2} : !shard.sharding
  %w2_ = shard.shard %w2 to %s2 : tensor<2x32x8xf32>
  %y = {mm.format("%a, %w2_", 32, "32x8", 8)}
  %y_ = shard.shard %y to %sx : tensor<2x4x8xf32>{y_users}
  return {y_ret} : tensor<2x4x8xf32>
}}""",
    )


def mlp_1d():
    w1, w2 = ALL, "[[], [0, 1, 2]]"
    annotations = (held("x", ALL), held("w1", w1), held("w2", w2), held("y", ALL))
    expected = {
        "mm1": ((ALL, "[[], [0, 1, 2]]"), "[[]]"),
        "sigmoid": (("[[]]",), "[[]]"),
        "mm2": (("[[]]", ALL), ALL),
    }
    return mlp(w1, w2, False, annotations, expected, {})


def mlp_2d():
    w1, w2 = "[[], [0], [1, 2]]", "[[], [1, 2], [0]]"
    annotations = (
        held("x", ALL),
        held("w1", w1),
        held("h", ALL),
        held("w2", w2),
        held("y", ALL),
        read("y", ALL),
    )
    expected = {
        "mm1": (("[[]]", ALL), ALL),
        "sigmoid": ((ALL,), ALL),
        "mm2": (("[[]]", ALL), ALL),
    }
    # Fewest bytes: autoshard keeps w1 as held and reads x as [[], [], [0]] (the design's 2-D
    # weight-stationary program), reduce-scattering h into its annotation; upstream gathers x
    # and reshards w1. From h on, both follow h's and y's annotations.
    kept = {"mm1": (("[[], [], [0]]", w1), "[[], [], [1, 2]]")}
    return mlp(w1, w2, True, annotations, expected, kept)


def duplicated_chain():
    """z = sigmoid(sigmoid(x)) on 2x4, z produced replicated: so is everything."""
    return Case(
        mesh="2x4",
        inputs={"x": [8, 16]},
        ops=(
            Op(n("Sigmoid", ["x"], ["y"], name="sigmoid1"), "tosa.sigmoid", 1),
            Op(n("Sigmoid", ["y"], ["z"], name="sigmoid2"), "tosa.sigmoid", 1),
        ),
        outputs=("z",),
        annotations=(held("z", "[[]]"),),
        expected={"sigmoid1": (("[[]]",), "[[]]"), "sigmoid2": (("[[]]",), "[[]]")},
        upstream=f"""
shard.grid @grid(shape = 2x4)
func.func @f(%x: {T}) -> {T} {{
  %y = tosa.sigmoid %x : ({T}) -> {T}
  %z = tosa.sigmoid %y : ({T}) -> {T}
  %s = shard.sharding @grid split_axes = [[]] : !shard.sharding
  %z_ = shard.shard %z to %s : {T}
  return %z_ : {T}
}}""",
    )


EW = ((SPLIT_2D,), SPLIT_2D)
CASES = {
    "element_wise_empty_sharding_info": sigmoid_case((), (("[[]]",), "[[]]")),
    "element_wise_on_def": sigmoid_case((held("y", SPLIT_2D),), EW, epilogue=SHARD_Y.format("")),
    "element_wise_on_use": sigmoid_case(
        (read("x", SPLIT_2D),), EW, prologue=SHARD_X.format(FOR_USERS)
    ),
    "element_wise_on_graph_output": sigmoid_case(
        (read("y", SPLIT_2D),), EW, epilogue=SHARD_Y.format(FOR_USERS)
    ),
    "element_wise_on_graph_input": sigmoid_case(
        (held("x", SPLIT_2D),), EW, prologue=SHARD_X.format("")
    ),
    "arrow_structure": arrow(),
    "matmul_on_def_shard_batch_and_m": batch_matmul(
        (held("y", SPLIT_2D),), ((SPLIT_2D, "[[0]]"), SPLIT_2D), shard_y=SPLIT_2D
    ),
    "matmul_on_def_shard_m_and_n": batch_matmul(
        (held("y", "[[], [0], [1]]"),),
        (("[[], [0]]", "[[], [], [1]]"), "[[], [0], [1]]"),
        shard_y="[[], [0], [1]]",
    ),
    "matmul_on_use_shard_m_and_k": batch_matmul(
        (held("a", "[[], [0], [1]]"),),
        (("[[], [0], [1]]", "[[], [1]]"), "[[], [0]]"),
        shard_a="[[], [0], [1]]",
    ),
    "matmul_on_use_shard_m_and_duplicted_k": batch_matmul(
        (read("a", "[[], [1], [0]]"), read("b", "[[], [0]]")),
        (("[[], [1], [0]]", "[[], [0]]"), "[[], [1]]"),
        shard_a="[[], [1], [0]]+",
        shard_b="[[], [0]]+",
    ),
    "resolve_conflicting_annotations": conflicting(),
    "mlp_1d_weight_stationary": mlp_1d(),
    "mlp_2d_weight_stationary": mlp_2d(),
    "elementwise_duplicated_chain": duplicated_chain(),
}
