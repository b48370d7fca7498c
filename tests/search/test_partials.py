"""Options reading and writing partial sums (`ShardingOption.partial_axes`, `OpRule.partial`,
`search.partials`): their text, the shardings they read and write, the candidates that carry
them, where the search keeps them, and the reads no reshard makes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from autoshard.annotations import Annotation
from autoshard.cost.cluster import make_cluster
from autoshard.cost.price import price
from autoshard.errors import ShardingError
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.mlir import parse_module, print_program
from autoshard.passes.lower import lower
from autoshard.passes.materialize import materialize
from autoshard.propagate import propagate
from autoshard.reshard import ReshardPrices
from autoshard.rules import rule_for
from autoshard.search.budget import auto_plan
from autoshard.search.candidates import candidates
from autoshard.search.partials import (
    UNREADABLE,
    Partials,
    may_take,
    partial_kinds,
    readable_matrix,
)
from autoshard.sharding import ReductionKind, Sharding, ShardingOption
from autoshard.training import Training, training_graph
from tests.e2e.test_partial_sums import write_moves, write_products
from tests.unit.test_mlir import assert_same_program

S = Sharding.parse
MODELS = Path(__file__).resolve().parents[2] / "models"


@pytest.mark.parametrize(
    "text, loops, partial, kind",
    [
        ("[[0]] partial = sum[1]", ((0,), ()), (1,), ReductionKind.SUM),
        ("[[], [1]] partial = max[0, 2]", ((), (1,)), (0, 2), ReductionKind.MAX),
        ("[[0, 1]]", ((0, 1), ()), (), ReductionKind.SUM),
    ],
)
def test_an_options_text_reads_back(text, loops, partial, kind):
    option = ShardingOption.parse(text, 2)
    assert (option.loops, option.partial_axes, option.partial_type) == (loops, partial, kind)
    assert str(option) == text
    assert ShardingOption.parse(str(option), 2) == option


def test_a_partial_axis_may_not_split_a_loop():
    with pytest.raises(ShardingError, match=r"sharding option \[\[0\]\] partial = sum\[0\]"):
        ShardingOption(((0,), ()), (0,))


@pytest.fixture(scope="module")
def products(tmp_path_factory):
    return import_onnx(write_products(tmp_path_factory.mktemp("products") / "p.onnx"))


def test_a_partial_option_reads_and_writes_partial_sums(products):
    rule = rule_for(products.op_by_name["add"], products)  # [4, 8] + [8] -> [4, 8]
    assert rule is not None and rule.partial == (ReductionKind.SUM,)
    option = ShardingOption(((0,), ()), (1,))
    assert rule.operand_sharding(option, 0) == S("[[0]] partial = sum[1]")
    assert rule.operand_sharding(option, 1) == S("[] partial = sum[1]")  # the broadcast bias
    assert rule.result_sharding(option, 0) == S("[[0]] partial = sum[1]")


def test_only_ops_commuting_with_a_sum_have_partial_candidates(products):
    mesh = Mesh((2, 2))
    add = rule_for(products.op_by_name["add"], products)
    matmul = rule_for(products.op_by_name["mma"], products)
    assert add is not None and matmul is not None
    found = candidates(add, mesh)
    plain = [c for c in found if not c.partial_axes]
    # Loops (4, 8); axes 0 and 1 each on no loop, d0 or d1 (9), and both on one loop in the
    # other order too (2 more): 11. Partial over the axes an option leaves unused: the one
    # option using none 3 times ([0], [1], [0, 1]), the 4 using one axis once each: 7 more.
    assert len(plain) == 11 and len(found) == 11 + 7
    assert found[: len(plain)] == tuple(plain)  # the plain options first, in their old order
    assert ShardingOption(((), ()), (0, 1)) in found
    assert not any(c.partial_axes for c in candidates(matmul, mesh))
    # An axis of one device is never partial.
    assert {c.partial_axes for c in candidates(add, Mesh((1, 2)))} == {(), (1,)}


@pytest.fixture(scope="module")
def moves(tmp_path_factory):
    return import_onnx(write_moves(tmp_path_factory.mktemp("moves") / "m.onnx"))


def test_ops_that_only_move_elements_have_partial_candidates(moves):
    mesh = Mesh((2, 2))
    reshape = rule_for(moves.op_by_name["reshape"], moves)  # [4, 8] -> [4, 2, 4]
    concat = rule_for(moves.op_by_name["concat"], moves)  # 2 x [1, 4, 4] -> [1, 4, 8] on dim 2
    assert reshape is not None and concat is not None
    # Reshape: loops (4, 2) (8 -> [2, 4] carries gcd(8, 2)). Axes 0 and 1 each on no loop, d0
    # or d1: 9 placements; both on d1 (4 devices, 2 rows) is none, both on d0 is two orders: 9.
    # Partial over the unused axes: the option using none 3 times, the 4 using one axis once
    # each: 7 more.
    found = candidates(reshape, mesh)
    assert len([c for c in found if not c.partial_axes]) == 9 and len(found) == 9 + 7
    # Concat: loops (1, 4, 8 invalid): each axis on no loop or d1, both in either order (5);
    # partial: 3 for the option using none, 1 for each of the 2 using one axis: 5 more.
    found = candidates(concat, mesh)
    assert len([c for c in found if not c.partial_axes]) == 5 and len(found) == 5 + 5
    kinds = partial_kinds(moves, {op.name: rule_for(op, moves) for op in moves.ops})
    moved = ("p", "r", "t", "h0", "h1", "c", "s", "q", "u", "out")
    assert all(kinds[n] == frozenset({ReductionKind.SUM}) for n in moved)


def test_partial_options_are_kept_where_every_operand_may_be_partial(products):
    kinds = partial_kinds(products, {op.name: rule_for(op, products) for op in products.ops})
    sums = frozenset({ReductionKind.SUM})
    assert kinds["pa"] == sums and kinds["s"] == sums and kinds["out"] == sums
    assert "x" not in kinds  # a graph input is never partial
    partial = ShardingOption(((), ()), (0,))
    add = products.op_by_name["add"]
    rule = rule_for(add, products)
    assert rule is not None and may_take(add, rule, partial, kinds)
    # Without the products' reductions, nothing upstream of the Sum is ever partial.
    plain = {op.name: rule_for(op, products) for op in products.ops if op.type != "MatMul"}
    assert not may_take(add, rule, partial, partial_kinds(products, plain))


def test_a_read_no_reshard_makes_is_unreadable():
    prices = ReshardPrices(Mesh((2, 2)), lambda c: float(c.bytes_per_device))
    held = (S("[[]] partial = sum[0, 1]"), S("[[0]]"), S("[[]] partial = max[0]"))
    need = (S("[[]] partial = sum[0]"), S("[[0]]"))
    matrix = readable_matrix(prices, held, need, (4, 8), 4)
    assert (matrix >= UNREADABLE).tolist() == [[False, False], [True, False], [True, False]]
    # sum over [0, 1] -> sum over [0]: the all_reduce over axis 1 of 4x8 floats on 2 devices.
    assert matrix[0, 0] == 128.0
    assert np.array_equal(matrix[:, 1], prices.matrix(held, need[1:], (4, 8), 4)[:, 0])


@pytest.mark.parametrize("dialect", ["mesh", "shard"])
def test_a_partial_option_round_trips_through_mlir(products, dialect):
    fixed = {f"mm{n}": ShardingOption(((), (), (0,))) for n in "abcd"}
    fixed |= {"mme": ShardingOption(((0,), (), ())), "rows": ShardingOption(((0,), ()))}
    fixed |= {n: ShardingOption(((), ()), (0,)) for n in ("sum", "neg", "sub", "add")}
    program = lower(products, propagate(products, Mesh((2,)), (), fixed))
    text = print_program(program, dialect)
    assert 'sharding = "[[], []] partial = sum[0]"' in text
    back = parse_module(text).to_program()
    assert_same_program(back, program)
    assert print_program(back, dialect) == text


def test_an_option_whose_gradient_never_reads_partial_sums_is_not_taken(tmp_path):
    # Trained, each move's gradient computes with its option: it reads the gradient of the
    # move's result partial where the move reads its operand so. The loss's gradient of the
    # output is never partial (no reduction makes it), so Expand's partial options are dead
    # (no reshard makes their gradient's read); the others' gradients read partial-able sums.
    graph = training_graph(import_onnx(write_moves(tmp_path / "m.onnx")), Training())
    rules = {op.name: rule_for(op, graph) for op in graph.ops}
    partials = Partials.of(graph, rules)
    assert [o.name for o, _ in partials.along["concat"]] == ["concat@grad0", "concat@grad1"]
    taken = {}
    for name in ("reshape", "transpose", "split", "concat", "slice", "squeeze", "expand"):
        rule = rules[name]
        assert rule is not None
        option = ShardingOption(((),) * len(rule.loops), (0,))
        taken[name] = partials.may_take(graph.op_by_name[name], rule, option)
        assert may_take(graph.op_by_name[name], rule, option, partials.kinds)  # the op alone
    assert [n for n, ok in taken.items() if not ok] == ["expand"]


def test_partial_sums_through_a_reshape_are_priced_as_the_program_makes_them():
    # GPT-2's dynamo export reshapes its output projections [8, 64] to [2, 4, 64] before the
    # residual Add; required to hold them partial after the Reshape, the search reduces them
    # after it, and its objective is the materialized and the lowered program's cost.
    graph = import_onnx(MODELS / "gpt2_dynamo.onnx", {"batch": 2, "seq": 4})
    partial = S("[[], [], []] partial = sum[0]")
    required = [Annotation(f"view_{n}", partial) for n in (8, 12)]
    cluster = make_cluster(mesh="2")
    planned = auto_plan(graph, cluster, required)
    for n in (8, 12):
        assert planned.plan.options[f"node_view_{n}"] == ShardingOption(((), ()), (0,))
    searched = planned.search.priced.objective(planned.solution.choice)
    made = price(materialize(graph, planned.plan), graph, cluster)
    assert searched == pytest.approx(made.objective, rel=1e-12, abs=0)
    assert planned.cost.objective == pytest.approx(made.objective, rel=1e-12, abs=0)
