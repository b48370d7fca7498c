"""An IOPDDL problem posed as our search `Problem`.

A group per set of nodes that forbidden pairs tie one-to-one (`ties`: most are one node), over
the choices of finite cost that no neighbour's every choice forbids; an edge matrix per pair of
groups joined, their edges summed (an edge to a group of one choice adds to the other's costs).
A node's usage is a term of its group's choice, so a memory row may hold several runs of one
group (their sum is the row's usage, as the solver sums it). Costs
are divided by `step`, rounding down, so that the largest is at most `SCALE` and a bound of
the scaled problem times `step` is a bound of the contest's costs.

The memory rows are the usage at the time points where the set of live nodes is largest (a
point whose nodes are a subset of another's never binds): a node's least usage is a fixed term
of its rows, what a strategy uses past it a run. They are many (tens of thousands, each of
thousands of nodes, on the contest's problems), so the problem holds only the rows asked for
(`Posed.problem_with`), and `Usage.profile` checks a solution against all.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from autoshard.search.iopddl.format import FORBIDDEN, IopddlError, IopddlProblem
from autoshard.search.iopddl.ties import Groups, Pairs, grouped
from autoshard.search.memory.rows import MemoryRows, RunTable
from autoshard.search.problem import Problem

SCALE = 10**9
"""The largest finite cost after scaling (the plans' `problem.SCALE`): CP-SAT stays exact."""

PENALTY = 1000 * SCALE
"""A forbidden pair's scaled cost: past any finite term, within CP-SAT's int64 sums."""

_ONE = np.ones(1, np.int64)


@dataclass(frozen=True, eq=False)
class Usage:
    """The memory rows, all of them: row r is time point `times[r]`; node n, of group
    `group_of[n]`, is live in rows `first[n]` to `last[n] - 1`, holding its least usage there
    (summed in `fixed`) and, under its group's choice k, `extra[n][k]` more (run `run_of[n]`
    of `runs`, -1 where it has none)."""

    times: np.ndarray
    first: np.ndarray
    last: np.ndarray
    fixed: np.ndarray
    most: np.ndarray  # each row's largest usage under any choice
    extra: tuple[np.ndarray, ...]
    run_of: np.ndarray
    group_of: np.ndarray
    runs: MemoryRows  # no rows: the runs' arrays only
    limit: int | None
    forbids: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))

    @property
    def budget(self) -> int:
        return self.limit or 0

    def may_bind(self) -> np.ndarray:
        """The rows some choice takes over the limit."""
        return np.flatnonzero(self.most > self.budget)

    def profile(self, choice: Sequence[int]) -> np.ndarray:
        """Each row's usage under one choice per group."""
        at = np.asarray(choice, np.int64)[self.group_of].tolist()
        chosen = np.array([e[k] for e, k in zip(self.extra, at, strict=True)], np.int64)
        return self.fixed + spread(self.first, self.last, chosen, len(self.times))

    def over(self, live: np.ndarray, most: int) -> np.ndarray:
        """The rows to add to a solve whose solution's rows hold `live` (none where it fits):
        of each run of consecutive rows over the limit the one most over, and the `most` most
        over of all."""
        if self.limit is None:
            return np.zeros(0, np.int64)
        over = np.flatnonzero(live > self.limit)
        if not len(over):
            return over
        runs = np.split(over, np.flatnonzero(np.diff(over) > 1) + 1)
        worst = [run[np.argmax(live[run])] for run in runs]
        top = over[np.argsort(-live[over], kind="stable")[:most]]
        return np.union1d(np.array(worst, np.int64), top)

    def rows(self, among: np.ndarray) -> MemoryRows:
        """The memory rows `among` (ascending), then a row per forbidding pair of runs
        (`forbids`): the budget less one, and one unit per run whose choice is taken, so that
        no plan fitting the rows takes both."""
        nodes = np.flatnonzero(self.run_of >= 0)
        lo = np.searchsorted(among, self.first[nodes])
        hi = np.searchsorted(among, self.last[nodes])
        counts = hi - lo
        row = np.repeat(lo - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
        order = np.argsort(row, kind="stable")
        runs = np.repeat(self.run_of[nodes], counts)[order]
        per_row = np.concatenate(
            [np.bincount(row, minlength=len(among)), np.full(len(self.forbids), 2)]
        )
        fixed = np.full(len(self.forbids), self.budget - 1, np.int64)
        return dataclasses.replace(
            self.runs, fixed=np.concatenate([self.fixed[among], fixed]),
            starts=np.concatenate([[0], np.cumsum(per_row)]).astype(np.int64),
            runs=np.concatenate([runs, self.forbids.ravel()]).astype(np.int64),
            indicated_starts=np.zeros(len(per_row) + 1, np.int64),
        )  # fmt: skip


@dataclass(frozen=True, eq=False)
class Posed:
    """The contest's problem as ours: group g decides the nodes `groups.nodes[g]`
    (`ties.Groups`); a scaled cost times `step` is at most the contest's; `problem` holds no
    memory rows."""

    problem: Problem
    groups: Groups
    step: int
    usage: Usage

    def solution(self, choice: Sequence[int]) -> list[int]:
        """A choice per group as the contest's strategy per node."""
        strategy = np.zeros(len(self.usage.group_of), np.int64)
        for nodes, strategies, k in zip(
            self.groups.nodes, self.groups.strategies, choice, strict=True
        ):
            strategy[nodes] = strategies[:, k]
        return strategy.tolist()

    def cost_bound(self, bound: int) -> int:
        """A bound of the scaled problem as a bound of the contest's costs."""
        return bound * self.step

    def problem_with(self, rows: np.ndarray) -> Problem:
        """The problem holding the memory rows `rows` (ascending) of all."""
        return dataclasses.replace(self.problem, memory=self.usage.rows(rows))


def pose(iop: IopddlProblem) -> Posed:
    """The problem as our search `Problem` (the module's docstring says how)."""
    groups = grouped([_int64(c) for c in iop.costs], _pair_costs(iop))
    costs = list(groups.costs)
    edges: Pairs = {}
    for (a, b), (finite, forbidden) in groups.pairs.items():
        if len(costs[b]) == 1:  # a group of one choice: the edge is a cost of the other's
            costs[a] = costs[a] + finite[:, 0]
        elif len(costs[a]) == 1:
            costs[b] = costs[b] + finite[0]
        else:
            edges[(a, b)] = (finite, forbidden)
    largest = max([1] + [int(c.max()) for c in costs] + [int(m.max()) for m, _ in edges.values()])
    step = -(-largest // SCALE)  # costs divided by it, rounding down: a bound stays one
    matrices = tuple(
        (a, b, tuple(map(tuple, np.where(forbidden, PENALTY, finite // step).tolist())))
        for (a, b), (finite, forbidden) in sorted(edges.items())
    )
    usage = _usage(iop, groups, edges)
    problem = Problem(
        sizes=tuple(len(c) for c in costs),
        node_costs=tuple(tuple((c // step).tolist()) for c in costs),
        edges=matrices, memory=usage.rows(np.zeros(0, np.int64)), budget=usage.budget,
        unit=float(step),
    )  # fmt: skip
    return Posed(problem, groups, step, usage)


def _pair_costs(iop: IopddlProblem) -> Pairs:
    """Each pair of nodes joined (a < b; an edge of a node to itself goes on the diagonal of
    its own pair): the finite costs of its edges summed, and where any edge forbids. The
    edges' costs are converted and compared at once, each edge's matrices views of them."""
    sizes = [len(c) for c in iop.costs]
    shapes = [(sizes[a], sizes[b]) for a, b in iop.edges.tolist()]
    lengths = [m * n for m, n in shapes]
    flat = _int64_flat(iop.edge_costs, sum(lengths))
    forbidden_flat = flat >= FORBIDDEN
    finite_flat = np.where(forbidden_flat, 0, flat)
    starts = itertools.accumulate(lengths, initial=0)
    pairs: Pairs = {}
    for (a, b), shape, at in zip(iop.edges.tolist(), shapes, starts, strict=False):
        forbidden = forbidden_flat[at : at + shape[0] * shape[1]].reshape(shape)
        finite = finite_flat[at : at + shape[0] * shape[1]].reshape(shape)
        if a > b:
            a, b, finite, forbidden = b, a, finite.T, forbidden.T
        if a == b:  # both ends take the same strategy: only the diagonal counts
            forbidden = np.diag(np.diagonal(forbidden))
        if (a, b) in pairs:
            old_finite, old_forbidden = pairs[(a, b)]
            finite, forbidden = old_finite + finite, old_forbidden | forbidden
        pairs[(a, b)] = (finite, forbidden)
    return pairs


def _int64_flat(lists: Sequence[Sequence[int]], count: int) -> np.ndarray:
    """The lists' values one after another as int64 (`_int64`: those past it `FORBIDDEN`)."""
    try:
        return np.fromiter(itertools.chain.from_iterable(lists), np.int64, count)
    except OverflowError:
        return np.concatenate([np.zeros(0, np.int64)] + [_int64(v) for v in lists])


def _int64(values: Sequence[int]) -> np.ndarray:
    """Costs as int64, those past it (forbidden anyway) as `FORBIDDEN`."""
    try:
        return np.asarray(values, np.int64)
    except OverflowError:
        return np.array([max(-FORBIDDEN, min(v, FORBIDDEN)) for v in values], np.int64)


def _usage(iop: IopddlProblem, groups: Groups, edges: Pairs) -> Usage:
    """The memory rows of the groups' choices (`Usage`), and for each choice of a group
    that some of a neighbour's forbid, a row that keeps them apart; `IopddlError` where the
    least usages alone pass the limit at some point."""
    group_of = np.zeros(len(iop.usages), np.int64)
    usages: list[np.ndarray] = [np.zeros(0, np.int64)] * len(iop.usages)
    for g, (nodes, strategies) in enumerate(zip(groups.nodes, groups.strategies, strict=True)):
        group_of[nodes] = g
        for n, chosen in zip(nodes.tolist(), strategies, strict=True):
            usages[n] = np.array(iop.usages[n], np.int64)[chosen]
    least = np.array([u.min() for u in usages], np.int64)
    extra = tuple(u - low for u, low in zip(usages, least, strict=True))
    times = largest_sets(iop.intervals)
    first = np.searchsorted(times, iop.intervals[:, 0])
    last = np.searchsorted(times, iop.intervals[:, 1])
    fixed = spread(first, last, least, len(times))
    most = fixed + spread(first, last, np.array([e.max() for e in extra], np.int64), len(times))
    limit = iop.usage_limit
    if limit is not None and len(times) and fixed.max() > limit:
        at = int(np.argmax(fixed))
        raise IopddlError(  # each node's least usage makes every row's fixed terms alone
            f"no solution fits the usage limit {limit}: the least usage found is "
            f"{int(fixed[at])}, at time {int(times[at])} (the least any solution reaches)"
        )
    table, run_of = RunTable(), np.full(len(usages), -1, np.int64)
    for n, more in enumerate(extra):
        if more.any():
            choices = np.flatnonzero(more).astype(np.int64)
            run_of[n] = table.add(int(group_of[n]), choices, more[choices])
    forbids = [
        (table.add(a, np.array([k], np.int64), _ONE), table.add(b, others, np.ones_like(others)))
        for (a, b), (_, forbidden) in sorted(edges.items())
        for k in np.flatnonzero(forbidden.any(axis=1)).tolist()
        if len(others := np.flatnonzero(forbidden[k]).astype(np.int64))
    ]
    runs = table.rows([], [], [])
    pairs = np.array(forbids, np.int64).reshape(-1, 2)
    return Usage(times, first, last, fixed, most, extra, run_of, group_of, runs, limit, pairs)


def largest_sets(intervals: np.ndarray) -> np.ndarray:
    """The time points whose live nodes are no subset of another point's: each last point
    before an interval ends that some interval started at or after the last such point.
    Between two ends the live nodes only grow; across an end with no start since, shrink."""
    live = intervals[intervals[:, 1] > intervals[:, 0]]
    if not len(live):
        return np.zeros(0, np.int64)
    ends = np.unique(live[:, 1]) - 1
    started = np.searchsorted(np.sort(live[:, 0]), ends, side="right")  # starts <= each
    fresh = np.diff(np.concatenate([[0], started])) > 0
    return ends[fresh]


def spread(first: np.ndarray, last: np.ndarray, amounts: np.ndarray, rows: int) -> np.ndarray:
    """Each row's sum of `amounts[n]` over the nodes n live in it (rows first[n]..last[n]-1)."""
    change = np.zeros(rows + 1, np.int64)
    np.add.at(change, first, amounts)
    np.add.at(change, last, -amounts)
    return np.cumsum(change[:-1])
