"""autoshard against upstream MLIR (LLVM 22's `mlir-opt-22`, whose `shard` dialect is the 2025
rename of the `mesh` dialect).

a. Printed programs (shard spelling) parse and verify upstream, and survive a round trip
   through it: mlir-opt renumbers every SSA value, so the program read back proves that the
   names, shardings and collectives live in the text's types, ops and locations.
b. Propagation: equivalent chains written in upstream IR (linalg.matmul, tosa elementwise ops,
   linalg.reduce) with the same `shard.shard` annotations, completed by upstream's
   `sharding-propagation` pass and read back with our parser, against `propagate` on the ONNX
   graph (MatMul, Add/Relu/Max, ReduceSum). Every operand and result sharding is compared.

Where they differ, `DIFFERENCES` states both sides exactly; there are two reasons.

1. Partial results. Where a reduction loop is split (a matmul over its contracted dim, a
   ReduceSum over a split dim) autoshard's result is `partial = sum[axes]`; upstream's has the
   same split axes and no partial axes. LLVM 22 removed partial axes from `shard.sharding`: its
   partition all-reduces a reduction's result inside the op's own partition (`shard-partition`
   emits `shard.all_reduce` right after the op, checked below), so upstream's annotation
   describes the value after that all-reduce. autoshard keeps the result partial, as
   docs/design/lowering.md does (`partial = sum[0]` on the MLP's output), so that materialization
   chooses the reduction (a reduce_scatter into the next sharding, or none before a linear op).
2. Which operand decides. On mesh 2x2 with x batch-split ([[0]]), w1 column-split and w2
   row-split over axis 1 for their users (data + tensor parallel), upstream completes the
   second matmul from w2's for-users annotation alone: it reads h as [[], [1]], dropping the
   batch split h is produced with, so its partition all-gathers h over axis 0 (checked below)
   and y comes out replicated. autoshard merges h's [[0], [1]] with w2's [[1]] (no conflict:
   m on axis 0, k on axis 1), so h needs no communication and y is [[0]] partial = sum[1].
"""
# ruff: noqa: E501 (the upstream IR below is written as mlir-opt prints it, one op a line)

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from autoshard.annotations import Annotation
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.mlir import parse_module, print_program
from autoshard.passes.materialize import materialize
from autoshard.propagate import propagate
from autoshard.sharding import Sharding
from tests.unit.test_propagate_order import ADD_ANNOTATIONS, MLP_ANNOTATIONS

from .seed_models import write_seed_mlp
from .test_seed_004 import ANNOTATIONS as SEED_004_ANNOTATIONS

MLIR_OPT = shutil.which("mlir-opt-22")
pytestmark = pytest.mark.skipif(MLIR_OPT is None, reason="mlir-opt-22 (mlir-22-tools) absent")
MODELS = Path(__file__).resolve().parents[2] / "models"
S = Sharding.parse


def mlir_opt(text: str, *args: str) -> str:
    result = subprocess.run(
        [str(MLIR_OPT), "--allow-unregistered-dialect", *args],
        input=text,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[:3000]
    return result.stdout


# ---- a. printed programs verify upstream --------------------------------------------------


def seed_program(tmp_path, which):
    graph = import_onnx(write_seed_mlp(tmp_path / "mlp.onnx"))
    if which == "001":
        mesh, annotations = (
            Mesh((2,)),
            [
                Annotation("x", S("[[], [], [0]]")),
                Annotation("y", S("[[]] partial = sum[0]")),
                Annotation("y", S("[[], [], [0]]"), for_users=True),
            ],
        )
    else:
        mesh, annotations = Mesh((2, 2, 2)), SEED_004_ANNOTATIONS
    return materialize(graph, propagate(graph, mesh, annotations))


def model_program(name, dims, mesh, first_input):
    graph = import_onnx(MODELS / f"{name}.onnx", dims)
    plan = propagate(graph, Mesh.parse(mesh), [Annotation(first_input, S("[[0]]"))])
    return materialize(graph, plan)


PROGRAMS = {
    "seed_001": lambda tmp: seed_program(tmp, "001"),
    "seed_004": lambda tmp: seed_program(tmp, "004"),
    "mlp_dp": lambda tmp: model_program("mlp", {"batch": 8}, "2x4", "x"),
    # 6 rows on 4 devices: shards 2, 2, 2, 0, so `?` types, offsets and casts.
    "mlp_uneven": lambda tmp: model_program("mlp", {"batch": 6}, "4", "x"),
    "gpt2_dp": lambda tmp: model_program("gpt2", {"batch": 8, "seq": 16}, "2x4", "input_ids"),
}


@pytest.mark.parametrize("name", PROGRAMS)
def test_printed_program_verifies_and_round_trips(name, tmp_path):
    program = PROGRAMS[name](tmp_path)
    text = print_program(program, "shard")
    mlir_opt(text)  # parses and verifies (mlir-opt verifies every op it reads)
    upstream = mlir_opt(text, "--mlir-print-debuginfo", "--mlir-print-local-scope")
    assert "%sharding_annotated" in upstream  # upstream's own SSA names: ours are gone
    back = parse_module(upstream).to_program()
    assert dict(back.tensors) == dict(program.tensors)
    assert back.steps == program.steps
    assert (back.inputs, back.outputs, back.mesh) == (program.inputs, program.outputs, program.mesh)
    assert all(np.array_equal(back.constants[k], v) for k, v in program.constants.items())
    assert print_program(back, "shard") == text


def test_upstream_checks_our_local_types(tmp_path):
    # The verifier does check what we print: on a 3-device mesh, gathering 4-wide shards does
    # not give 8, so the passing tests above are not vacuous.
    text = print_program(seed_program(tmp_path, "001"), "shard")
    bad = text.replace("shard.grid @mesh0(shape = 2)", "shard.grid @mesh0(shape = 3)")
    assert bad != text
    result = subprocess.run(
        [str(MLIR_OPT), "--allow-unregistered-dialect"], input=bad, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "Dimension size mismatch for result axis 2. Expected 12, but got 8." in result.stderr


# ---- b. propagation against upstream's sharding-propagation -------------------------------


@dataclass(frozen=True)
class Case:
    """An ONNX chain and its upstream twin: `ops` pairs our op names with upstream op names in
    order; `operands` is how many leading operands of each correspond (linalg's `outs` and
    ReduceSum's axes do not)."""

    upstream: str
    nodes: tuple
    inputs: dict
    annotations: tuple
    ops: tuple


def matmul_chain(mesh, x, w1, w2):
    """x 4x8 @ w1 8x32 @ w2 32x8; w1 column-split and w2 row-split for their users."""
    return Case(
        f"""
shard.grid @grid0(shape = {mesh})
func.func @chain(%x: tensor<4x8xf32>, %w1: tensor<8x32xf32>, %w2: tensor<32x8xf32>) -> tensor<4x8xf32> {{
  %sx = shard.sharding @grid0 split_axes = {x} : !shard.sharding
  %x_ = shard.shard %x to %sx : tensor<4x8xf32>
  %s1 = shard.sharding @grid0 split_axes = {w1} : !shard.sharding
  %w1_ = shard.shard %w1 to %s1 annotate_for_users : tensor<8x32xf32>
  %s2 = shard.sharding @grid0 split_axes = {w2} : !shard.sharding
  %w2_ = shard.shard %w2 to %s2 annotate_for_users : tensor<32x8xf32>
  %e1 = tensor.empty() : tensor<4x32xf32>
  %h = linalg.matmul ins(%x_, %w1_ : tensor<4x8xf32>, tensor<8x32xf32>) outs(%e1 : tensor<4x32xf32>) -> tensor<4x32xf32>
  %e2 = tensor.empty() : tensor<4x8xf32>
  %y = linalg.matmul ins(%h, %w2_ : tensor<4x32xf32>, tensor<32x8xf32>) outs(%e2 : tensor<4x8xf32>) -> tensor<4x8xf32>
  return %y : tensor<4x8xf32>
}}""",
        (
            helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
            helper.make_node("MatMul", ["h", "w2"], ["y"], name="mm2"),
        ),
        {"x": [4, 8], "w1": [8, 32], "w2": [32, 8]},
        (
            Annotation("x", S(x)),
            Annotation("w1", S(w1), for_users=True),
            Annotation("w2", S(w2), for_users=True),
        ),
        (("mm1", "linalg.matmul", 2), ("mm2", "linalg.matmul", 2)),
    )


def elementwise_chain(mesh, a, last=None):
    """c = a + b, d = relu(c), e = max(d, b); `a` annotated as produced, or (backward) only the
    last result `e`."""
    annotate_a = (
        f"""
  %sa = shard.sharding @grid0 split_axes = {a} : !shard.sharding
  %a_ = shard.shard %a to %sa : tensor<4x8xf32>"""
        if last is None
        else ""
    )
    annotate_e = (
        f"""
  %se = shard.sharding @grid0 split_axes = {last} : !shard.sharding
  %e_ = shard.shard %e to %se : tensor<4x8xf32>
  return %e_ : tensor<4x8xf32>"""
        if last
        else "\n  return %e : tensor<4x8xf32>"
    )
    a_ref = "%a_" if last is None else "%a"
    annotations = (Annotation("a", S(a)),) if last is None else (Annotation("e", S(last)),)
    return Case(
        f"""
shard.grid @grid0(shape = {mesh})
func.func @ew(%a: tensor<4x8xf32>, %b: tensor<4x8xf32>) -> tensor<4x8xf32> {{{annotate_a}
  %c = tosa.add {a_ref}, %b : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %d = tosa.clamp %c {{min_val = 0.0 : f32, max_val = 3.4028235e38 : f32}} : (tensor<4x8xf32>) -> tensor<4x8xf32>
  %e = tosa.maximum %d, %b : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>{annotate_e}
}}""",
        (
            helper.make_node("Add", ["a", "b"], ["c"], name="add"),
            helper.make_node("Relu", ["c"], ["d"], name="relu"),
            helper.make_node("Max", ["d", "b"], ["e"], name="max"),
        ),
        {"a": [4, 8], "b": [4, 8]},
        annotations,
        (("add", "tosa.add", 2), ("relu", "tosa.clamp", 1), ("max", "tosa.maximum", 2)),
    )


def reduction(mesh, a):
    """r[i] = sum_j a[i, j] with a's dim 1 split: the reduction loop is split."""
    return Case(
        f"""
shard.grid @grid0(shape = {mesh})
func.func @red(%a: tensor<4x8xf32>) -> tensor<4xf32> {{
  %sa = shard.sharding @grid0 split_axes = {a} : !shard.sharding
  %a_ = shard.shard %a to %sa : tensor<4x8xf32>
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<4xf32>
  %init = linalg.fill ins(%zero : f32) outs(%e : tensor<4xf32>) -> tensor<4xf32>
  %r = linalg.reduce ins(%a_ : tensor<4x8xf32>) outs(%init : tensor<4xf32>) dimensions = [1]
    (%in: f32, %acc: f32) {{
      %s = arith.addf %in, %acc : f32
      linalg.yield %s : f32
    }}
  return %r : tensor<4xf32>
}}""",
        (helper.make_node("ReduceSum", ["a", "axes"], ["r"], name="sum", keepdims=0),),
        {"a": [4, 8]},
        (Annotation("a", S(a)),),
        (("sum", "linalg.reduce", 1),),
    )


def conflicting_add():
    """y = x + z with x and z held on different axes (issue 47): upstream follows x, the first
    operand, and reshards z."""
    return Case(
        """
shard.grid @grid0(shape = 2x4)
func.func @add(%x: tensor<8xf32>, %z: tensor<8xf32>) -> tensor<8xf32> {
  %sx = shard.sharding @grid0 split_axes = [[0]] : !shard.sharding
  %x_ = shard.shard %x to %sx : tensor<8xf32>
  %sz = shard.sharding @grid0 split_axes = [[1]] : !shard.sharding
  %z_ = shard.shard %z to %sz : tensor<8xf32>
  %y = tosa.add %x_, %z_ : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
  return %y : tensor<8xf32>
}""",
        (helper.make_node("Add", ["x", "z"], ["y"], name="add"),),
        {"x": [8], "z": [8]},
        ADD_ANNOTATIONS,
        (("add", "tosa.add", 2),),
    )


def returned_mlp():
    """The weight-stationary MLP with its returned y annotated for its users (issue 47):
    upstream produces y as the users read it."""
    return Case(
        """
shard.grid @grid0(shape = 2x2x2)
func.func @mlp(%x: tensor<8x16xf32>, %w1: tensor<16x32xf32>, %w2: tensor<32x16xf32>) -> tensor<8x16xf32> {
  %sx = shard.sharding @grid0 split_axes = [[], [0, 1, 2]] : !shard.sharding
  %x_ = shard.shard %x to %sx : tensor<8x16xf32>
  %s1 = shard.sharding @grid0 split_axes = [[0], [1, 2]] : !shard.sharding
  %w1_ = shard.shard %w1 to %s1 : tensor<16x32xf32>
  %s2 = shard.sharding @grid0 split_axes = [[1, 2], [0]] : !shard.sharding
  %w2_ = shard.shard %w2 to %s2 : tensor<32x16xf32>
  %e1 = tensor.empty() : tensor<8x32xf32>
  %h = linalg.matmul ins(%x_, %w1_ : tensor<8x16xf32>, tensor<16x32xf32>) outs(%e1 : tensor<8x32xf32>) -> tensor<8x32xf32>
  %a = tosa.sigmoid %h : (tensor<8x32xf32>) -> tensor<8x32xf32>
  %e2 = tensor.empty() : tensor<8x16xf32>
  %y = linalg.matmul ins(%a, %w2_ : tensor<8x32xf32>, tensor<32x16xf32>) outs(%e2 : tensor<8x16xf32>) -> tensor<8x16xf32>
  %sy = shard.sharding @grid0 split_axes = [[], [0, 1, 2]] : !shard.sharding
  %y_ = shard.shard %y to %sy annotate_for_users : tensor<8x16xf32>
  return %y_ : tensor<8x16xf32>
}""",
        (
            helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
            helper.make_node("Sigmoid", ["h"], ["a"], name="sig"),
            helper.make_node("MatMul", ["a", "w2"], ["y"], name="mm2"),
        ),
        {"x": [8, 16], "w1": [16, 32], "w2": [32, 16]},
        MLP_ANNOTATIONS,
        (("mm1", "linalg.matmul", 2), ("sig", "tosa.sigmoid", 1), ("mm2", "linalg.matmul", 2)),
    )


CASES = {
    "matmul_1d": matmul_chain("2", "[[]]", "[[], [0]]", "[[0]]"),
    "matmul_2x2": matmul_chain("2x2", "[[0]]", "[[], [1]]", "[[1]]"),
    "elementwise_1d": elementwise_chain("2", "[[0]]"),
    "elementwise_2x2": elementwise_chain("2x2", "[[0], [1]]"),
    "elementwise_2x2_backward": elementwise_chain("2x2", "[[1], [0]]", last="[[1], [0]]"),
    "reduction_1d": reduction("2", "[[], [0]]"),
    "reduction_2x2": reduction("2x2", "[[0], [1]]"),
    "conflicting_add_2x4": conflicting_add(),
    "returned_mlp_2x2x2": returned_mlp(),
}

# (case, op) -> (autoshard, upstream), each (operand shardings, result sharding), where they
# differ (see the module docstring for why); every other op must complete identically.
DIFFERENCES = {
    ("matmul_1d", "mm2"): (
        (("[[], [0]]", "[[0]]"), "[[]] partial = sum[0]"),
        (("[[], [0]]", "[[0]]"), "[[]]"),
    ),
    ("matmul_2x2", "mm2"): (
        (("[[0], [1]]", "[[1]]"), "[[0]] partial = sum[1]"),
        (("[[], [1]]", "[[1]]"), "[[]]"),
    ),
    ("reduction_1d", "sum"): ((("[[], [0]]",), "[[]] partial = sum[0]"), (("[[], [0]]",), "[[]]")),
    ("reduction_2x2", "sum"): (
        (("[[0], [1]]",), "[[0]] partial = sum[1]"),
        (("[[0], [1]]",), "[[0]]"),
    ),
    ("returned_mlp_2x2x2", "mm1"): (
        (("[[], [0, 1, 2]]", "[[0, 1, 2]]"), "[[]] partial = sum[0, 1, 2]"),
        (("[[], [0, 1, 2]]", "[[0, 1, 2]]"), "[[]]"),
    ),
}


def shardings(texts):
    operands, result = texts
    return tuple(S(t) for t in operands), S(result)


def write_case(case, tmp_path):
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in case.inputs.items()
    ]
    last = case.nodes[-1].output[0]
    output = helper.make_tensor_value_info(last, TensorProto.FLOAT, None)
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])  # ReduceSum's
    graph = helper.make_graph(list(case.nodes), "case", inputs, [output], [axes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "case.onnx")
    return tmp_path / "case.onnx"


def ours(case, tmp_path, mesh):
    graph = import_onnx(write_case(case, tmp_path))
    plan = propagate(graph, mesh, list(case.annotations))
    table = {}
    for name, _, count in case.ops:
        op = graph.op_by_name[name]
        table[name] = (
            tuple(plan.needs[(name, i)] for i in range(count)),
            plan.produced[op.outputs[0]],
        )
    return table


def upstreams(case, mesh_text):
    module = parse_module(
        mlir_opt(
            case.upstream.replace("{mesh}", mesh_text),
            "--pass-pipeline=builtin.module(func.func(sharding-propagation))",
        )
    )
    table, found = {}, [op for op in module.ops if op.name in {u for _, u, _ in case.ops}]
    assert [op.name for op in found] == [u for _, u, _ in case.ops]
    for (name, _, count), op in zip(case.ops, found, strict=True):
        operands = tuple(module.sharding(ssa) for ssa in op.operands[:count])
        (result,) = [
            u
            for u in module.users(op.results[0])
            if u.kind == "shard" and not u.attrs["annotate_for_users"]
        ]
        table[name] = (operands, module.sharding(result.results[0]))
    return table


@pytest.mark.parametrize("name", CASES)
def test_propagation_matches_upstream(name, tmp_path):
    case = CASES[name]
    mesh_text = case.upstream.split("shape = ", 1)[1].split(")", 1)[0]
    mesh = Mesh.parse(mesh_text, "grid0")
    mine, theirs = ours(case, tmp_path, mesh), upstreams(case, mesh_text)
    assert mine.keys() == theirs.keys()
    for op in mine:
        if (name, op) in DIFFERENCES:
            want_mine, want_theirs = DIFFERENCES[(name, op)]
            assert (mine[op], theirs[op]) == (shardings(want_mine), shardings(want_theirs)), op
        else:
            assert mine[op] == theirs[op], op


def test_upstream_partition_all_reduces_a_split_reduction():
    """Difference 1: upstream's annotation has no partial axes as its partition reduces."""
    case = CASES["reduction_1d"]
    text = mlir_opt(
        case.upstream.replace("{mesh}", "2"),
        "--pass-pipeline=builtin.module(func.func(sharding-propagation,shard-partition))",
    )
    lines = text.splitlines()
    reduce_at = next(i for i, line in enumerate(lines) if "linalg.reduce" in line)
    after = [line.strip() for line in lines[reduce_at:] if "shard." in line]
    assert after[0].startswith("%all_reduce = shard.all_reduce %reduced on @grid0 grid_axes = [0]")


def test_upstream_partition_gathers_the_batch_split_tensor_parallel_drops(tmp_path):
    """Difference 2: upstream gathers h over axis 0 before the second matmul; autoshard's
    materialized program moves nothing before it (y's reduction is left to its users)."""
    case = CASES["matmul_2x2"]
    text = mlir_opt(
        case.upstream.replace("{mesh}", "2x2"),
        "--pass-pipeline=builtin.module(func.func(sharding-propagation,shard-partition))",
    )
    gathers = [line.split("= ", 1)[1] for line in text.splitlines() if "shard.all_gather" in line]
    assert gathers == [
        "shard.all_gather %1 on @grid0 grid_axes = [0] gather_axis = 0 "
        ": tensor<2x16xf32> -> tensor<4x16xf32>"
    ]
    graph = import_onnx(write_case(case, tmp_path))
    program = materialize(graph, propagate(graph, Mesh((2, 2)), list(case.annotations)))
    assert [str(s.collective) for s in program.communications] == [
        "all_reduce mesh_axes = [1] reduction = sum"  # y for the graph output only
    ]
