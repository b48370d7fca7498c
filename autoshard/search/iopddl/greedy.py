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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.deadline import NEVER, Deadline
from autoshard.search.iopddl.pose import PENALTY, Posed, Usage

SWEEPS = 50
"""Sweeps of local improvement at most."""

FREE_SWEEPS = 5
"""Sweeps with memory aside at most, before the repair."""

REPAIRS = 4
"""Rounds of the repair at most, per group."""


@dataclass(frozen=True)
class Greedy:
    """A choice per group of the posed problem, whether it fits (every memory row within
    the limit, no forbidden pair), and its scaled objective."""

    choice: tuple[int, ...]
    fits: bool
    objective: int


@dataclass(frozen=True, eq=False)
class Local:
    """Per group its costs, and its edges as (other group, matrix: rows its own choices)."""

    costs: list[np.ndarray]
    edges: list[list[tuple[int, np.ndarray]]]

    def vector(self, g: int, choice: np.ndarray) -> np.ndarray:
        """Group g's cost per choice, its neighbours' choices given."""
        total = self.costs[g].copy()
        for h, matrix in self.edges[g]:
            total += matrix[:, choice[h]]
        return total


def greedy(
    posed: Posed,
    deadline: Deadline = NEVER,
    more: Sequence[Sequence[int]] = (),
    own: bool = True,
) -> Greedy:
    """A solution by the module's steps, from each start (`_STARTS` unless not `own`, then
    those `more`, a choice per group each): the best that fits (ties: the first), else the
    first."""
    local = local_view(posed)
    starts = [start(local) for start in _STARTS] if own else []
    starts += [np.array(c, np.int64) for c in more]
    found = [_improved(posed, local, start, deadline) for start in starts]
    fitting = [f for f in found if f.fits]
    return min(fitting, key=lambda f: f.objective) if fitting else found[0]


def _cheapest(local: Local) -> np.ndarray:
    """Per group the choice of the least own cost."""
    return np.array([int(np.argmin(c)) for c in local.costs], np.int64)


def _in_order(local: Local) -> np.ndarray:
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


def _improved(posed: Posed, local: Local, choice: np.ndarray, deadline: Deadline) -> Greedy:
    """`choice` improved by sweeps with memory aside (`FREE_SWEEPS`: away from forbidden
    pairs), repaired where it goes over the limit, then improved by sweeps within it."""
    usage = posed.usage
    held = Held.of(usage)
    live = usage.profile(choice.tolist())
    limit = usage.limit
    for _ in range(FREE_SWEEPS):
        if not _sweep(held, local, choice, live, None) or deadline.passed():
            break
    if limit is not None and len(live) and live.max() > limit:
        live = _repair(held, local, choice, live, limit)  # (past the deadline too: the answer)
    fits_now = limit is None or not len(live) or bool(live.max() <= limit)
    if fits_now:
        for _ in range(SWEEPS):
            if not _sweep(held, local, choice, live, limit) or deadline.passed():
                break
    plan = tuple(choice.tolist())
    objective = posed.problem.objective(plan)
    forbidden = any(int(m[plan[g], plan[h]]) >= PENALTY for g in range(len(plan))
                    for h, m in local.edges[g] if g < h)  # fmt: skip
    return Greedy(plan, fits_now and not forbidden, int(objective))


def local_view(posed: Posed) -> Local:
    problem = posed.problem
    costs = [np.array(c, np.int64) for c in problem.node_costs]
    edges: list[list[tuple[int, np.ndarray]]] = [[] for _ in costs]
    for a, b, rows in problem.edges:
        matrix = np.array(rows, np.int64)
        edges[a].append((b, matrix))
        edges[b].append((a, matrix.T))
    return Local(costs, edges)


@dataclass(frozen=True, eq=False)
class Held:
    """Per group the nodes whose usage its choice decides (`Usage`'s rows), and how a move
    changes the rows' usage."""

    usage: Usage
    nodes: list[np.ndarray]

    @staticmethod
    def of(usage: Usage) -> Held:
        order = np.argsort(usage.group_of, kind="stable")
        cuts = np.searchsorted(usage.group_of[order], np.arange(1, usage.group_of.max() + 1))
        return Held(usage, np.split(order, cuts) if len(order) else [])

    def change(self, g: int, now: int) -> tuple[int, np.ndarray]:
        """The first row group g's nodes hold, and per choice the change of each row from
        there on were g to move from `now` to it (choices x rows)."""
        usage, nodes = self.usage, self.nodes[g]
        lo, hi = int(usage.first[nodes].min()), int(usage.last[nodes].max())
        steps = np.zeros((len(usage.extra[int(nodes[0])]), hi - lo + 1), np.int64)
        for n in nodes.tolist():
            more = usage.extra[n] - usage.extra[n][now]
            steps[:, usage.first[n] - lo] += more
            steps[:, usage.last[n] - lo] -= more
        return lo, np.cumsum(steps, axis=1)[:, :-1]

    def move(self, g: int, now: int, to: int, live: np.ndarray) -> None:
        """Group g moved from `now` to `to`: the rows' usage updated (in place)."""
        usage = self.usage
        for n in self.nodes[g].tolist():
            live[usage.first[n] : usage.last[n]] += usage.extra[n][to] - usage.extra[n][now]


def _sweep(
    held: Held, local: Local, choice: np.ndarray, live: np.ndarray, limit: int | None
) -> bool:
    """One sweep of local improvement (in place; `limit` None: memory aside); whether it
    improved anything."""
    usage = held.usage
    improved = False
    for g in range(len(choice)):
        if len(local.costs[g]) < 2:
            continue
        vector = local.vector(g, choice)
        now = int(choice[g])
        if limit is not None and len(held.nodes[g]) > 1:
            lo, change = held.change(g, now)
            if change.shape[1]:
                fits = (live[lo : lo + change.shape[1]] + change).max(axis=1) <= limit
                vector = np.where(fits, vector, np.iinfo(np.int64).max)
        elif limit is not None:
            n = int(held.nodes[g][0])
            lo, hi, extra = int(usage.first[n]), int(usage.last[n]), usage.extra[n]
            if hi > lo:
                headroom = limit - int(live[lo:hi].max())
                vector = np.where(extra - extra[now] <= headroom, vector, np.iinfo(np.int64).max)
        best = int(np.argmin(vector))
        if vector[best] < vector[now]:
            held.move(g, now, best, live)
            choice[g] = best
            improved = True
    return improved


def _repair(
    held: Held, local: Local, choice: np.ndarray, live: np.ndarray, limit: int
) -> np.ndarray:
    """Moves at the row most over the limit, those of the most usage off there per cost added
    (its own and its edges', the neighbours' choices given; a group once) until the row fits,
    until every row fits, no move at the row takes usage off, or `REPAIRS` per group are
    spent (a group of several nodes may add usage at other rows; in place; the rows' usage)."""
    usage = held.usage
    counts = np.array([len(e) for e in usage.extra], np.int64)
    node_of = np.repeat(np.arange(len(counts)), counts)  # per entry: its node...
    node_at = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    sizes = np.array([len(c) for c in local.costs], np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    entry_group = usage.group_of[node_of]
    slot = offsets[entry_group] + np.arange(len(node_of)) - node_at[node_of]  # ...its choice
    extra = np.concatenate(usage.extra) if usage.extra else np.zeros(0, np.int64)
    vectors = [local.vector(g, choice) for g in range(len(choice))]
    cost = np.concatenate(vectors).astype(np.float64) if vectors else np.zeros(0)
    owner = np.repeat(np.arange(len(sizes)), sizes)
    first, last = usage.first[node_of], usage.last[node_of]
    for _ in range(REPAIRS * len(choice)):
        row = int(np.argmax(live))
        if live[row] <= limit:
            break
        there = np.flatnonzero((first <= row) & (row < last))
        taken = node_at[node_of[there]] + choice[entry_group[there]]
        off = np.bincount(slot[there], extra[taken] - extra[there], minlength=len(owner))
        at = np.flatnonzero(off > 0)
        if not len(at):
            break
        score = (cost[at] - cost[offsets[owner[at]] + choice[owner[at]]]) / off[at]
        over, moved = int(live[row]) - limit, set()
        for flat in at[np.argsort(score, kind="stable")].tolist():  # the best, a group once
            g = int(owner[flat])
            if g in moved:
                continue
            moved.add(g)
            held.move(g, int(choice[g]), flat - int(offsets[g]), live)
            choice[g] = flat - offsets[g]
            over -= int(off[flat])
            if over <= 0:
                break
        for h in {h for g in moved for h, _ in local.edges[g]} | moved:
            cost[offsets[h] : offsets[h + 1]] = local.vector(h, choice)
    return live
