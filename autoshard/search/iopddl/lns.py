"""Large-neighbourhood search from a posed IOPDDL problem's solution: most groups fixed where
the solution has them, a neighbourhood of them freed and solved by CP-SAT (`solve_cp_sat`,
the model the plans' memory-bound search builds, memory rows and all) in a small slice of
deterministic time; a better solution of the neighbourhood replaces the incumbent's.

The neighbourhood's problem (`Neighbourhood`) is over the freed groups F alone: a group's cost
per choice is its own plus its edges' to the fixed groups at their choices; the edges inside F
stay; a memory row per span of time points over which the set of F's live nodes stays the
same, its fixed term the most any point of the span holds of the others' usage (no other point
of the span binds first), kept where some choice of F may take it over the limit. A choice a
fixed neighbour forbids is left out. So its optimum is the best solution that changes F alone,
and its objective less the incumbent's there is the whole problem's change.

Neighbourhoods, in turn (`KINDS`): a region (the groups reached by edges from a random group,
breadth first); a peak (at a time point among the most used, groups holding usage there,
drawn by how much, and the groups next to them); costly groups (drawn by how far their cost
at the incumbent is above their least given their neighbours', and those next to them). The
size adapts: it grows where CP-SAT proved the neighbourhood's optimum within its slice, and
shrinks where it did not.

Deterministic given the seed: the draws are the seed's, each slice is CP-SAT's deterministic
time, and the search stops after `work` deterministic seconds. A wall-clock deadline that
passes first stops it where it is: how many neighbourhoods were solved by then depends on the
machine and its load, and so does the answer.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.deadline import NEVER, Deadline
from autoshard.search.iopddl import relaxed
from autoshard.search.iopddl.greedy import Held, Local, local_view
from autoshard.search.iopddl.pairs import pair_sweep
from autoshard.search.iopddl.pose import PENALTY, Posed, spread
from autoshard.search.memory.rows import NO_ROWS, MemoryRow, MemoryRows
from autoshard.search.problem import Problem
from autoshard.search.solver.cp_sat import solve_cp_sat
from autoshard.search.solver.outcome import Limit, NoPlan, OutOfTime, SolverStatus


@dataclass(frozen=True)
class LnsOptions:
    """The search's knobs, one line each."""

    seed: int = 0  # the draws' seed
    slice: float = 0.5  # deterministic seconds per neighbourhood's CP-SAT solve
    size: int = 4000  # CP-SAT variables freed at first (`_grown`)
    smallest: int = 500  # the size shrinks no further...
    largest: int = 100_000  # ...and grows no further
    grow: float = 1.25  # the size's factor after an optimum proven in the slice...
    shrink: float = 0.8  # ...and after none
    peak_rows: int = 32  # a peak neighbourhood's time point: one of this many most used
    least: float = 1e-3  # deterministic seconds a neighbourhood counts at least (CP-SAT's
    # solve of a tiny one counts none: the budget still ends)
    widest: int = 8  # choices a freed group keeps at most in every other neighbourhood
    # (`Neighbourhood.of_groups`; 0: all, always)


@dataclass(frozen=True)
class Searched:
    """The search's answer: a choice per group, its objective (the posed problem's), whether
    it is proven optimal (a neighbourhood held every group and CP-SAT proved its optimum),
    the neighbourhoods solved and improving, and the deterministic seconds spent."""

    choice: tuple[int, ...]
    objective: int
    optimal: bool
    tried: int
    improved: int
    work: float


def improved(
    posed: Posed,
    start: Sequence[int],
    work: float,
    deadline: Deadline = NEVER,
    options: LnsOptions = LnsOptions(),
    stop: Callable[[], bool] = lambda: False,
) -> Searched:
    """The large-neighbourhood search (the module's docstring) from `start`, a choice per group
    within the usage limit and no forbidden pair, for `work` deterministic seconds, or until
    `deadline` passes or `stop()` says so (checked between neighbourhoods)."""
    state = _State.of(posed, start)
    # The first sweeps over every edge: on the largest problems they may take long, and the
    # neighbourhoods do more with the time past half of what is left.
    state.polish(range(len(state.choice)), Deadline.start(deadline.left() / 2))
    rng = np.random.default_rng(options.seed)
    size, spent, tried, better, optimal = options.size, 0.0, 0, 0, False
    movable = state.movable
    while len(movable) and spent < work and not deadline.passed() and not stop():
        kind = KINDS[tried % len(KINDS)]
        whole = size >= state.variables
        # Every other neighbourhood narrowed (`widest`): wider in groups, fewer choices each.
        narrow = options if tried % 2 else dataclasses.replace(options, widest=0)
        free = movable if whole else np.unique(kind(state, rng, size, narrow))
        tried += 1
        sub = Neighbourhood.of_groups(state, free, 0 if whole else narrow.widest)
        choice, proven, used = _tiered(sub, min(options.slice, work - spent), work, deadline)
        spent += max(used, options.least)
        if choice is not None and sub.problem.objective(choice) < sub.problem.objective(sub.hint):
            state.polish(state.take(sub, choice), deadline)
            better += 1
        if proven and len(free) == len(movable) and not sub.narrowed():
            optimal = True  # every group free: the whole problem's optimum
            break
        grown = int(size * options.grow) if proven else int(size * options.shrink)
        size = min(options.largest, max(options.smallest, grown))
    choice = tuple(state.choice.tolist())
    return Searched(choice, posed.problem.objective(choice), optimal, tried, better, spent)


POLISH = 20
"""Sweeps of pair moves at most after a neighbourhood's solution is taken."""

ROWS_PER_SOLVE = 16
"""The rows most over the limit a neighbourhood's solve adds, besides the worst of each run."""


def _tiered(
    sub: Neighbourhood, seconds: float, of: float, deadline: Deadline
) -> tuple[tuple[int, ...] | None, bool, float]:
    """The neighbourhood by elimination (`relaxed.eliminated`) where that settles it, else by
    CP-SAT (`_solved`), as `_solved` answers."""
    quick = relaxed.eliminated(sub, sub.state.posed.usage.limit)
    if quick is not None and quick.settled:
        return quick.choice, quick.proven, quick.work
    choice, proven, used = _solved(sub, seconds, of, deadline)
    return choice, proven, used + (quick.work if quick is not None else 0.0)


def _solved(
    sub: Neighbourhood, seconds: float, of: float, deadline: Deadline
) -> tuple[tuple[int, ...] | None, bool, float]:
    """CP-SAT on the neighbourhood in `seconds` of deterministic time, its memory rows added
    as its solutions go over them (none at first; `Usage.over`): the solution (None: none
    better found that fits), whether CP-SAT proved it the neighbourhood's optimum, and the
    deterministic seconds spent."""
    usage = sub.state.posed.usage
    rows, work = np.zeros(0, np.int64), 0.0
    while True:
        problem = sub.with_rows(rows.tolist()) if len(rows) else sub.problem
        limit = Limit(seconds - work, of, "neighbourhood", deadline)
        try:
            found, _ = solve_cp_sat(problem, limit, True, sub.hint, probing=False)
        except NoPlan as none:  # (the incumbent fits: only where the deadline cut it short)
            return None, False, work + none.work
        except OutOfTime:
            return None, False, seconds
        work += found.work
        over = usage.over(sub.live(found.choice), ROWS_PER_SOLVE)
        if not len(over):
            return found.choice, found.status is SolverStatus.OPTIMAL, work
        if work >= seconds or deadline.passed():
            return None, False, work
        rows = np.union1d(rows, over)


@dataclass(eq=False)
class _State:
    """The incumbent (a choice per group, changed in place), each memory row's usage under it,
    and each group's regret (its cost given its neighbours' choices, less its least)."""

    posed: Posed
    local: Local
    held: Held
    choice: np.ndarray
    live: np.ndarray
    regret: np.ndarray

    @staticmethod
    def of(posed: Posed, start: Sequence[int]) -> _State:
        local = local_view(posed)
        choice = np.array(start, np.int64)
        state = _State(posed, local, Held.of(posed.usage), choice,
                       posed.usage.profile(choice.tolist()), np.zeros(len(choice)))  # fmt: skip
        state.rescore(range(len(choice)))
        return state

    def rescore(self, groups: Sequence[int] | range) -> None:
        for g in groups:
            vector = self.local.vector(g, self.choice)
            self.regret[g] = float(vector[self.choice[g]] - vector.min())

    @functools.cached_property
    def movable(self) -> np.ndarray:
        """The groups of more than one choice."""
        return np.flatnonzero(np.array(self.posed.problem.sizes) > 1)

    @functools.cached_property
    def variables(self) -> int:
        """The variables of the whole problem (as `_grown` counts them)."""
        problem = self.posed.problem
        return sum(problem.sizes) + sum(len(m) * len(m[0]) for _, _, m in problem.edges)

    def neighbours(self, g: int) -> list[int]:
        return [h for h, _ in self.local.edges[g]]

    def take(self, sub: Neighbourhood, choice: Sequence[int]) -> list[int]:
        """The neighbourhood's solution `choice` (its numbering) made the incumbent's: the
        groups moved."""
        moved = []
        for g, kept, k in zip(sub.free.tolist(), sub.kept, choice, strict=True):
            to = int(kept[k])
            if to != self.choice[g]:
                self.held.move(g, int(self.choice[g]), to, self.live)
                self.choice[g] = to
                moved.append(g)
        self.rescore(sorted({h for g in moved for h in self.neighbours(g)} | set(moved)))
        return moved

    def polish(self, around: Sequence[int] | range, deadline: Deadline) -> None:
        """Pair moves (`pairs.pair_sweep`) over the edges of the groups `around`, then of
        those each sweep moved, until one moves none (at most `POLISH` sweeps) or `deadline`
        passes."""
        for _ in range(POLISH):
            if not len(around) or deadline.passed():
                return
            around = pair_sweep(self.held, self.local, self.choice, self.live,
                                self.posed.usage.limit, around, deadline)  # fmt: skip
            self.rescore(sorted({h for g in around for h in self.neighbours(g)} | set(around)))


# ---- neighbourhoods ------------------------------------------------------------------------


def _grown(
    state: _State, seeds: Sequence[int], size: int, rng: np.random.Generator, widest: int = 0
) -> list[int]:
    """Of `seeds` (in order), those that fit half of `size` variables; then the groups reached
    from them by edges, breadth first (each group's neighbours in a random order), while they
    fit `size`. A group's variables: its choices, and a pair per two choices of an edge to a
    group taken before (what CP-SAT's model holds at most)."""
    sizes = state.posed.problem.sizes
    if widest:
        sizes = tuple(min(n, widest) for n in sizes)
    taken: dict[int, None] = {}
    used = 0

    def take(g: int, share: float) -> bool:
        nonlocal used
        more = sizes[g] + sum(sizes[g] * sizes[h] for h in state.neighbours(g) if h in taken)
        if g in taken or sizes[g] < 2 or (taken and used + more > size * share):
            return False
        taken[g] = None
        used += more
        return True

    for g in seeds:
        if used >= size / 2:
            break
        take(g, 0.5)
    queue, at = list(taken), 0
    while at < len(queue) and used < size:
        around = state.neighbours(queue[at])
        at += 1
        for i in rng.permutation(len(around)).tolist():
            if take(around[i], 1.0):
                queue.append(around[i])
    return list(taken)


def region(state: _State, rng: np.random.Generator, size: int, options: LnsOptions) -> list[int]:
    """The groups reached from one random group."""
    return _grown(state, [int(rng.choice(state.movable))], size, rng, options.widest)


def peak(state: _State, rng: np.random.Generator, size: int, options: LnsOptions) -> list[int]:
    """At one of the most used time points, groups drawn among those holding usage there (by
    how much), and the groups next to them."""
    usage, live = state.posed.usage, state.live
    if not len(live):
        return region(state, rng, size, options)
    top = np.argsort(-live, kind="stable")[: options.peak_rows]
    row = int(top[rng.integers(len(top))])
    nodes = np.flatnonzero((usage.first <= row) & (row < usage.last))
    held = np.array([usage.extra[n][state.choice[usage.group_of[n]]] for n in nodes.tolist()])
    groups, where = np.unique(usage.group_of[nodes], return_inverse=True)
    weight = np.bincount(where, held.astype(np.float64), len(groups)) + 1.0
    weight[np.array(state.posed.problem.sizes)[groups] < 2] = 0.0
    if not weight.any():
        return region(state, rng, size, options)
    count = min(SEEDS, int(np.count_nonzero(weight)))
    seeds = rng.choice(groups, count, replace=False, p=weight / weight.sum())
    return _grown(state, seeds.tolist(), size, rng, options.widest)


def costly(state: _State, rng: np.random.Generator, size: int, options: LnsOptions) -> list[int]:
    """Groups drawn among those of some regret (by how much), and the groups next to them."""
    weight = state.regret
    if not weight.any():
        return region(state, rng, size, options)
    count = min(SEEDS, int(np.count_nonzero(weight)))
    seeds = rng.choice(len(weight), count, replace=False, p=weight / weight.sum())
    return _grown(state, seeds.tolist(), size, rng, options.widest)


KINDS = (region, peak, costly)

SEEDS = 64
"""The groups a peak or costly neighbourhood draws at most, to start from."""


# ---- a neighbourhood's problem --------------------------------------------------------------


def _cheapest(state: _State, g: int, keep: np.ndarray, widest: int) -> np.ndarray:
    """Of group g's choices `keep`, the `widest` of the least cost given its neighbours'
    incumbent choices (ties: the lowest), its incumbent one among them; ascending."""
    vector = state.local.vector(g, state.choice)[keep]
    now = int(state.choice[g])
    order = keep[np.argsort(vector, kind="stable")]
    chosen = order[order != now][: widest - 1]
    return np.sort(np.append(chosen, now))


@dataclass(frozen=True, eq=False)
class Neighbourhood:
    """The problem over the freed groups `free` (ascending), the rest fixed (the module's
    docstring): its group i is `free[i]` over the choices `kept[i]`; `hint` the incumbent's;
    `problem` holds no memory rows (`with_rows` adds them). The freed groups' nodes live at
    some time point are `nodes`, of group `of[n]` (its number here)."""

    free: np.ndarray
    kept: tuple[np.ndarray, ...]
    problem: Problem
    hint: tuple[int, ...]
    state: _State
    nodes: np.ndarray
    of: np.ndarray

    def narrowed(self) -> bool:
        """Whether some freed group keeps fewer choices than it has."""
        sizes = self.state.posed.problem.sizes
        return any(len(k) < sizes[g] for g, k in zip(self.free.tolist(), self.kept, strict=True))

    @staticmethod
    def of_groups(state: _State, free: np.ndarray, widest: int = 0) -> Neighbourhood:
        """`widest` (0: all): a freed group keeps at most that many choices, those of the
        least cost given every neighbour's incumbent choice, and its own incumbent one."""
        at = np.full(len(state.choice), -1, np.int64)
        at[free] = np.arange(len(free))
        costs, kept, edges = [], [], []
        for g in free.tolist():
            total = state.local.costs[g].copy()
            for h, matrix in state.local.edges[g]:
                if at[h] < 0:
                    total += matrix[:, state.choice[h]]
            keep = np.flatnonzero(total < PENALTY)
            if 0 < widest < len(keep):
                keep = _cheapest(state, g, keep, widest)
            costs.append(tuple(total[keep].tolist()))
            kept.append(keep)
        now = state.choice[free].tolist()
        hint = tuple(int(np.searchsorted(k, c)) for k, c in zip(kept, now, strict=True))
        inside = [(i, int(at[h]), matrix[np.ix_(kept[i], kept[at[h]])])
                  for i, g in enumerate(free.tolist()) for h, matrix in state.local.edges[g]
                  if at[h] > i]  # fmt: skip
        # A forbidden pair costs more than the incumbent's whole neighbourhood: no better
        # solution takes one, and CP-SAT's relaxation is not swamped by the penalty's size.
        worth = sum(c[k] for c, k in zip(costs, hint, strict=True)) + sum(
            int(m[hint[a], hint[b]]) for a, b, m in inside
        )
        for a, b, cells in inside:
            cells = np.where(cells >= PENALTY, worth + 1, cells)
            edges.append((a, b, tuple(map(tuple, cells.tolist()))))
        problem = Problem(
            sizes=tuple(map(len, kept)), node_costs=tuple(costs), edges=tuple(edges),
            memory=NO_ROWS, budget=state.posed.usage.budget, unit=state.posed.problem.unit,
        )  # fmt: skip
        usage = state.posed.usage
        nodes = np.concatenate([state.held.nodes[g] for g in free.tolist()])
        nodes = nodes[usage.first[nodes] < usage.last[nodes]]
        return Neighbourhood(free, tuple(kept), problem, hint, state, nodes,
                             at[usage.group_of[nodes]])  # fmt: skip

    def live(self, choice: Sequence[int]) -> np.ndarray:
        """Each memory row's usage (of all the problem's) under `choice` here, the rest as
        the incumbent has it."""
        usage, state = self.state.posed.usage, self.state
        to = np.array([self.kept[i][k] for i, k in enumerate(choice)], np.int64)[self.of]
        now = state.choice[self.free][self.of]
        change = [usage.extra[n][b] - usage.extra[n][a]
                  for n, a, b in zip(self.nodes.tolist(), now.tolist(), to.tolist(),
                                     strict=True)]  # fmt: skip
        first, last = usage.first[self.nodes], usage.last[self.nodes]
        return state.live + spread(first, last, np.array(change, np.int64), len(state.live))

    def with_rows(self, rows: Sequence[int]) -> Problem:
        """The problem holding the memory rows `rows` (of all the problem's): the others'
        usage there fixed, each freed group's live nodes' a run over its choices."""
        usage, state = self.state.posed.usage, self.state
        first, last = usage.first[self.nodes], usage.last[self.nodes]
        now = state.choice[self.free][self.of]
        mine = np.array([usage.extra[n][k] for n, k in zip(self.nodes.tolist(), now.tolist(),
                                                            strict=True)], np.int64)  # fmt: skip
        written = []
        for r in rows:
            there = np.flatnonzero((first <= r) & (r < last))
            held = int(mine[there].sum())
            amounts: dict[int, np.ndarray] = {}
            for n, i in zip(self.nodes[there].tolist(), self.of[there].tolist(), strict=True):
                more = usage.extra[n][self.kept[i]]
                amounts[i] = amounts[i] + more if i in amounts else more
            terms = tuple((i, k, int(b)) for i, more in sorted(amounts.items())
                          for k, b in enumerate(more.tolist()) if b)  # fmt: skip
            written.append(MemoryRow(int(state.live[r]) - held, terms, ()))
        return dataclasses.replace(self.problem, memory=MemoryRows.of(written))

    def held_at(self, rows: np.ndarray) -> list[np.ndarray]:
        """Per freed group, per choice it keeps: the usage past their least its nodes hold,
        summed over the rows marked in `rows` (0 or 1 each) that they are live at."""
        usage = self.state.posed.usage
        marked = np.concatenate([[0], np.cumsum(rows)])
        count = marked[usage.last[self.nodes]] - marked[usage.first[self.nodes]]
        held = [np.zeros(len(k), np.float64) for k in self.kept]
        for n, i, times in zip(self.nodes.tolist(), self.of.tolist(), count.tolist(),
                               strict=True):  # fmt: skip
            if times:
                held[i] += times * usage.extra[n][self.kept[i]]
        return held
