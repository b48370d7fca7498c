"""A fast solution of a posed IOPDDL problem, found without the exact solver: the answer
`autoshard solve` always has, and the hint it starts the solver from.

1. Per node the cheapest strategy by its own cost; and, a second start, node by node in
   order the cheapest given the nodes before (edges counted from the start).
2. Where that goes over the usage limit, repair: at the row most over it, the swap of one
   live node's strategy that takes the most usage off per cost added, until every row fits
   (or no swap takes usage off: no fitting solution found).
3. Sweeps of local improvement: each node in turn moves to the strategy of the least cost
   given its neighbours' (its own cost and its edges'), among those whose usage fits the
   headroom of its rows, until a sweep improves nothing or the deadline passes.

Of the two starts, the best that fits. Deterministic where the deadline does not pass (ties:
the lowest index).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoshard.deadline import NEVER, Deadline
from autoshard.search.iopddl.pose import PENALTY, Posed

SWEEPS = 50
"""Sweeps of local improvement at most."""

FREE_SWEEPS = 5
"""Sweeps with memory aside at most, before the repair."""


@dataclass(frozen=True)
class Greedy:
    """A choice per group of the posed problem, whether it fits (every memory row within
    the limit, no forbidden pair), and its scaled objective."""

    choice: tuple[int, ...]
    fits: bool
    objective: int


@dataclass(frozen=True, eq=False)
class _Local:
    """Per group its costs, and its edges as (other group, matrix: rows its own choices)."""

    costs: list[np.ndarray]
    edges: list[list[tuple[int, np.ndarray]]]

    def vector(self, g: int, choice: np.ndarray) -> np.ndarray:
        """Group g's cost per choice, its neighbours' choices given."""
        total = self.costs[g].copy()
        for h, matrix in self.edges[g]:
            total += matrix[:, choice[h]]
        return total


def greedy(posed: Posed, deadline: Deadline = NEVER) -> Greedy:
    """A solution by the module's steps, from each start (`_STARTS`): the best that fits
    (ties: the first), else the first."""
    local = _local(posed)
    found = [_improved(posed, local, start(local), deadline) for start in _STARTS]
    fitting = [f for f in found if f.fits]
    return min(fitting, key=lambda f: f.objective) if fitting else found[0]


def _cheapest(local: _Local) -> np.ndarray:
    """Per group the choice of the least own cost."""
    return np.array([int(np.argmin(c)) for c in local.costs], np.int64)


def _in_order(local: _Local) -> np.ndarray:
    """Group by group in order, the choice of the least cost given the groups before's
    choices (its own cost and its edges to them): edges count from the start."""
    choice = np.zeros(len(local.costs), np.int64)
    for g, costs in enumerate(local.costs):
        total = costs.copy()
        for h, matrix in local.edges[g]:
            if h < g:
                total += matrix[:, choice[h]]
        choice[g] = int(np.argmin(total))
    return choice


_STARTS = (_cheapest, _in_order)


def _improved(posed: Posed, local: _Local, choice: np.ndarray, deadline: Deadline) -> Greedy:
    """`choice` improved by sweeps with memory aside (`FREE_SWEEPS`: away from forbidden
    pairs), repaired where it goes over the limit, then improved by sweeps within it."""
    usage = posed.usage
    live = usage.profile(choice.tolist())
    limit = usage.limit
    for _ in range(FREE_SWEEPS):
        if not _sweep(posed, local, choice, live, free=True) or deadline.passed():
            break
    if limit is not None and len(live) and live.max() > limit:
        live = _repair(posed, local, choice, live)  # (past the deadline too: the answer)
    fits_now = limit is None or not len(live) or bool(live.max() <= limit)
    if fits_now:
        for _ in range(SWEEPS):
            if not _sweep(posed, local, choice, live) or deadline.passed():
                break
    plan = tuple(choice.tolist())
    objective = posed.problem.objective(plan)
    forbidden = any(int(m[plan[g], plan[h]]) >= PENALTY for g in range(len(plan))
                    for h, m in local.edges[g] if g < h)  # fmt: skip
    return Greedy(plan, fits_now and not forbidden, int(objective))


def _local(posed: Posed) -> _Local:
    problem = posed.problem
    costs = [np.array(c, np.int64) for c in problem.node_costs]
    edges: list[list[tuple[int, np.ndarray]]] = [[] for _ in costs]
    for a, b, rows in problem.edges:
        matrix = np.array(rows, np.int64)
        edges[a].append((b, matrix))
        edges[b].append((a, matrix.T))
    return _Local(costs, edges)


def _sweep(
    posed: Posed, local: _Local, choice: np.ndarray, live: np.ndarray, free: bool = False
) -> bool:
    """One sweep of local improvement (in place; `free`: memory aside); whether it improved
    anything."""
    usage = posed.usage
    limit = None if free else usage.limit
    improved = False
    for g in range(len(choice)):
        if len(local.costs[g]) < 2:
            continue
        vector = local.vector(g, choice)
        now = int(choice[g])
        extra = usage.extra[g]
        lo, hi = int(usage.first[g]), int(usage.last[g])
        if limit is not None and hi > lo:
            headroom = limit - int(live[lo:hi].max())
            vector = np.where(extra - extra[now] <= headroom, vector, np.iinfo(np.int64).max)
        best = int(np.argmin(vector))
        if vector[best] < vector[now]:
            live[lo:hi] += extra[best] - extra[now]
            choice[g] = best
            improved = True
    return improved


def _repair(posed: Posed, local: _Local, choice: np.ndarray, live: np.ndarray) -> np.ndarray:
    """Swaps at the row most over the limit, those of the most usage off per cost added (its
    own and its edges', the neighbours' choices given; a node once) until the row fits,
    until every row fits or no swap at the row takes usage off (each takes some off: it
    ends; in place; the rows' usage)."""
    usage = posed.usage
    limit = usage.limit
    assert limit is not None
    counts = [len(e) for e in usage.extra]
    owner = np.repeat(np.arange(len(choice)), counts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    extra = np.concatenate(usage.extra) if usage.extra else np.zeros(0, np.int64)
    vectors = [local.vector(g, choice) for g in range(len(choice))]
    cost = np.concatenate(vectors).astype(np.float64) if vectors else np.zeros(0)
    first, last = usage.first[owner], usage.last[owner]
    while True:
        row = int(np.argmax(live))
        if live[row] <= limit:
            return live
        taken = offsets[owner] + choice[owner]
        off = extra[taken] - extra
        at = np.flatnonzero((first <= row) & (row < last) & (off > 0))
        if not len(at):
            return live
        score = (cost[at] - cost[taken[at]]) / off[at]
        over, moved = int(live[row]) - limit, set()
        for flat in at[np.argsort(score, kind="stable")].tolist():  # the best, a node once
            g = int(owner[flat])
            if g in moved:
                continue
            moved.add(g)
            lo, hi = int(usage.first[g]), int(usage.last[g])
            live[lo:hi] -= off[flat]
            choice[g] = flat - offsets[g]
            over -= int(off[flat])
            if over <= 0:
                break
        for h in {h for g in moved for h, _ in local.edges[g]} | moved:
            cost[offsets[h] : offsets[h + 1]] = local.vector(h, choice)
