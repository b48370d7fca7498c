"""Upstream's `mlir/test/Dialect/Shard/forward-sharding-propagation.mlir` (LLVM 22): a filled
tensor produced row-split, added to itself, and summed over both dims to a scalar that its
users read replicated; upstream's pass runs with `traversal=forward`.

Translation: the `linalg.fill` becomes a graph input `f` (ONNX folds a fill of a constant into
a constant, and autoshard holds constants replicated); the elementwise `linalg.generic` is Add,
the `linalg.reduce` ReduceSum. Upstream's grid has one device, and autoshard drops an axis of one
device from every sharding (`Plan`), which would make the comparison vacuous: both sides run on
a grid of 2, where upstream gives the same CHECK lines. autoshard always walks backward, then
forward; here the backward walk finds nothing to say (the scalar's annotation splits nothing),
so the answers agree.
"""
# ruff: noqa: E501 (the upstream IR below is one op a line, as mlir-opt prints it)

from onnx import helper

from .harness import Case, Op, held, read

n = helper.make_node
M = "tensor<6x6xf32>"

CASES = {
    "test_forward": Case(
        mesh="2",
        inputs={"f": [6, 6], "axes": (0, 1)},
        ops=(
            Op(n("Add", ["f", "f"], ["g"], name="add"), "linalg.generic", 2),
            Op(n("ReduceSum", ["g", "axes"], ["r"], name="sum", keepdims=0), "linalg.reduce", 1),
        ),
        outputs=("f", "g", "r"),
        annotations=(held("f", "[[0]]"), read("r", "[]")),
        expected={"add": (("[[0]]", "[[0]]"), "[[0]]"), "sum": (("[[0]]",), "[]")},
        traversal="forward",
        upstream=f"""
#id = affine_map<(i, j) -> (i, j)>
shard.grid @grid(shape = 2)
func.func @f() -> ({M}, {M}, tensor<f32>) {{
  %one = arith.constant 1.0 : f32
  %e = tensor.empty() : {M}
  %f = linalg.fill ins(%one : f32) outs(%e : {M}) -> {M}
  %s = shard.sharding @grid split_axes = [[0]] : !shard.sharding
  %f_ = shard.shard %f to %s : {M}
  %o = tensor.empty() : {M}
  %g = linalg.generic {{indexing_maps = [#id, #id, #id], iterator_types = ["parallel", "parallel"]}} ins(%f_, %f_ : {M}, {M}) outs(%o : {M}) {{
  ^bb0(%p: f32, %q: f32, %acc: f32):
    %sum = arith.addf %p, %q : f32
    linalg.yield %sum : f32
  }} -> {M}
  %zero = arith.constant 0.0 : f32
  %r0 = tensor.empty() : tensor<f32>
  %init = linalg.fill ins(%zero : f32) outs(%r0 : tensor<f32>) -> tensor<f32>
  %r = linalg.reduce ins(%g : {M}) outs(%init : tensor<f32>) dimensions = [0, 1]
    (%in: f32, %acc: f32) {{
      %t = arith.addf %in, %acc : f32
      linalg.yield %t : f32
    }}
  %sr = shard.sharding @grid split_axes = [[]] : !shard.sharding
  %r_ = shard.shard %r to %sr annotate_for_users : tensor<f32>
  return %f_, %g, %r_ : {M}, {M}, tensor<f32>
}}""",
    ),
}
