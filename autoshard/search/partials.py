"""Partial values added before they are reduced: the options of ops that commute with a reduction
(`OpRule.partial`: Add, Sub and Sum read partial sums and write their partial sum), so that
the search, not a pass after it, decides to add two partial gradients and reduce once.

A partial option reads every data operand as partial values. It is a candidate only where
every data operand may be held so (`partial_kinds`, in graph order): written partial by its
producer, an op splitting a reduction loop of that kind or a partial option itself. Graph
inputs and weights are never partial. Worked example: SwiGLU's gate and up projections read
one normalized value h; in the backward, dh = dG·Wgᵀ + dU·Wuᵀ, both products partial sums
over the axis splitting the hidden features. The Sum adding them may read both partial
(`[[]] partial = sum[1]`) and be reduced once after it, instead of reducing each.

A read of a value held otherwise than the reader needs it partial (held whole, read as
partial sums) is made by no reshard (`reshard.reachable`): its price is `UNREADABLE`, and the
problem forbids the cells so priced (`unreadable`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.ir.graph import Graph, Op
from autoshard.reshard import ReshardPrices, reachable
from autoshard.rules import IteratorType, OpRule
from autoshard.rules.gradient import computed_with
from autoshard.search.reads import PricedReads
from autoshard.sharding import ReductionKind, Sharding, ShardingOption

UNREADABLE = 1e30
"""The price of a read no reshard makes: above any plan's cost, in seconds or in bytes, and
finite, so that the reads' sums and masks (times 0 where not read) keep it exact."""

Kinds = Mapping[str, frozenset[ReductionKind]]
"""The reductions each value may be held partial in."""


def partial_kinds(graph: Graph, rules: Mapping[str, OpRule | None]) -> Kinds:
    """The reductions each value may be held partial in under some plan (a superset)."""
    kinds: dict[str, frozenset[ReductionKind]] = {}
    for op in graph.ops:
        rule = rules.get(op.name)
        if rule is None:
            continue
        made = {loop.reduction for loop in rule.loops if loop.kind is IteratorType.REDUCTION}
        data = _data(op, rule)
        made |= {k for k in rule.partial if data and all(k in kinds.get(n, ()) for n in data)}
        kinds |= {out: frozenset(k for k in made if k is not None) for out in op.outputs if out}
    return kinds


def may_take(op: Op, rule: OpRule, option: ShardingOption, kinds: Kinds, along: Along = ()) -> bool:
    """Whether `option` may be taken: it reads nothing partial, or every data operand may be
    held partial in its reduction, of `op` and of the ops computed with its option (`along`:
    a gradient reads its result's gradient partial where the op reads its operands so; where
    that gradient is never held partial, no reshard makes the read, and the option is dead)."""
    if not option.partial_axes:
        return True
    return all(_partial_data(o, r, option, kinds) for o, r in ((op, rule), *along))


Along = Sequence[tuple[Op, OpRule]]
"""The ops computed with another's option (`rules.gradient.computed_with`), with their rules."""


def computed_along(graph: Graph, rules: Mapping[str, OpRule | None]) -> dict[str, Along]:
    """Each op's `Along`: its gradients and recomputed copies that have a rule."""
    along: dict[str, list[tuple[Op, OpRule]]] = {}
    for op in graph.ops:
        rule = rules.get(op.name)
        if (forward := computed_with(op)) and rule is not None:
            along.setdefault(forward, []).append((op, rule))
    return dict(along)


@dataclass(frozen=True)
class Partials:
    """What `may_take` asks of a graph, worked out once per problem: the reductions each value
    may be held partial in, and the ops computed with each op's option."""

    kinds: Kinds
    along: Mapping[str, Along]

    @staticmethod
    def of(graph: Graph, rules: Mapping[str, OpRule | None]) -> Partials:
        return Partials(partial_kinds(graph, rules), computed_along(graph, rules))

    def may_take(self, op: Op, rule: OpRule, option: ShardingOption) -> bool:
        return may_take(op, rule, option, self.kinds, self.along.get(op.name, ()))


def _partial_data(op: Op, rule: OpRule, option: ShardingOption, kinds: Kinds) -> bool:
    data = _data(op, rule)
    return bool(data) and all(option.partial_type in kinds.get(n, ()) for n in data)


def _data(op: Op, rule: OpRule) -> list[str]:
    """The data operands of `op` (those its rule maps)."""
    return [n for n, m in zip(op.inputs, rule.operands, strict=False) if n and m is not None]


def readable_matrix(
    prices: ReshardPrices,
    held: Sequence[Sharding],
    need: Sequence[Sharding],
    shape: Sequence[int],
    itemsize: int,
) -> np.ndarray:
    """`prices.matrix`, `UNREADABLE` where no reshard takes the held sharding to the need."""
    if not any(n.partial_axes for n in need):
        return prices.matrix(held, need, shape, itemsize)
    out = np.full((len(held), len(need)), UNREADABLE)
    for j, n in enumerate(need):
        rows = [i for i, h in enumerate(held) if reachable(h, n)]
        if rows:
            out[rows, j] = prices.matrix([held[i] for i in rows], (n,), shape, itemsize)[:, 0]
    return out


def unreadable(priced: PricedReads) -> list[np.ndarray]:
    """Move the `UNREADABLE` cells of the edges into their `forbidden` cells, and return, per
    group, the choices a read of their own makes impossible; both zeroed in the costs."""
    for key, matrix in priced.edges.items():
        cells = matrix >= UNREADABLE
        if cells.any():
            matrix[cells] = 0.0
            priced.forbidden[key] = priced.forbidden.get(key, np.zeros(cells.shape, bool)) | cells
    barred = []
    for node in priced.node:
        cells = node >= UNREADABLE
        node[cells] = 0.0
        barred.append(cells)
    return barred


def bar(node_costs: list[list[int]], barred: Sequence[np.ndarray], forbid: int) -> None:
    """Price the choices `unreadable` found impossible at `forbid`, above any plan's cost."""
    for g, cells in enumerate(barred):
        for k in np.flatnonzero(cells):
            node_costs[g][k] = forbid
