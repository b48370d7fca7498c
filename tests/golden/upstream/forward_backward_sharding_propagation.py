"""Upstream's `mlir/test/Dialect/Shard/forward-backward-sharding-propagation.mlir` (LLVM 22): a
filled tensor produced split on its rows over one axis, added to an uninitialized tensor, and
the sum produced split on its rows over another axis; upstream's pass runs with
`traversal=forward-backward`. The sum's own annotation wins: the add reads both operands as
it produces its result, and the filled tensor is resharded.

Translation: the `linalg.fill` (annotated through its `tensor.empty` init) becomes a graph input
`f` produced split, the uninitialized `tensor.empty` read as an input operand a graph input `e`,
the `linalg.generic` Add. Upstream names mesh axes 0 and 1 on a grid of shape 1, which has one
axis (its verifier does not check split axes against the grid); both sides run on 2x2, where
the annotations are valid and upstream gives the same CHECK lines.
"""
# ruff: noqa: E501 (the upstream IR below is one op a line, as mlir-opt prints it)

from onnx import helper

from .harness import Case, Op, held

n = helper.make_node
M = "tensor<6x6xf32>"

CASES = {
    "test_forward": Case(
        mesh="2x2",
        inputs={"e": [6, 6], "f": [6, 6]},
        ops=(Op(n("Add", ["e", "f"], ["g"], name="add"), "linalg.generic", 2),),
        outputs=("g",),
        annotations=(held("f", "[[0]]"), held("g", "[[1]]")),
        expected={"add": (("[[1]]", "[[1]]"), "[[1]]")},
        traversal="forward-backward",
        aliases={"e0": "f"},
        upstream=f"""
#id = affine_map<(i, j) -> (i, j)>
shard.grid @grid(shape = 2x2)
func.func @f() -> {M} {{
  %one = arith.constant 1.0 : f32
  %e0 = tensor.empty() : {M}
  %rows = shard.sharding @grid split_axes = [[0]] : !shard.sharding
  %e0_ = shard.shard %e0 to %rows : {M}
  %f = linalg.fill ins(%one : f32) outs(%e0_ : {M}) -> {M}
  %e = tensor.empty() : {M}
  %g = linalg.generic {{indexing_maps = [#id, #id, #id], iterator_types = ["parallel", "parallel"]}} ins(%e, %f : {M}, {M}) outs(%e : {M}) {{
  ^bb0(%p: f32, %q: f32, %acc: f32):
    %sum = arith.addf %p, %q : f32
    linalg.yield %sum : f32
  }} -> {M}
  %other = shard.sharding @grid split_axes = [[1]] : !shard.sharding
  %g_ = shard.shard %g to %other : {M}
  return %g_ : {M}
}}""",
    ),
}
