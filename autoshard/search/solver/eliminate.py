"""The optimum with memory aside: exact min-sum elimination (`factors`), or, where its tables
would be too large, CP-SAT on what is left once the groups of degree <= 2 are eliminated
(`eliminate`, whose argmins give the eliminated groups' choices back, `_expand`)."""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.progress import Tracker
from autoshard.search.memory.rows import NO_ROWS
from autoshard.search.problem import Problem
from autoshard.search.solver.factors import minimize, problem_factors, undominated
from autoshard.search.solver.outcome import (
    Improvements,
    Limit,
    OutOfTime,
    Solution,
    SolverStatus,
    in_whole,
)


def memory_aside(problem: Problem, limit: Limit, tracker: Tracker | None, unit: str) -> Solution:
    """The optimum with memory aside: exact elimination (`factors.minimize`) where its tables
    stay under its cap, of the choices that are no dead end (`factors.undominated`) where
    those of all do not; else CP-SAT on what is left once the groups of degree <= 2 are
    eliminated, of the choices no dead end where some are (fewer choices, a faster proof).
    The choices left may hold dead ends again (a neighbour lost its own): narrowed in a loop,
    not a call per round, since the rounds may follow a chain of layers. `OutOfTime` where
    the deadline passes first (a round is not stopped within)."""
    started = time.perf_counter()
    narrowings: list[list[list[int]]] = []  # the choices kept in each round, in order
    while True:
        if limit.deadline.passed():
            raise OutOfTime(limit.out_of_time("UNKNOWN"))
        if tracker is not None:
            tracker.detail(f"exact elimination of {len(problem.sizes)} groups, memory aside")
        exact = minimize(problem.sizes, problem_factors(problem))
        if exact is not None:
            objective = problem.objective(exact.choice)
            found = Solution(
                choice=exact.choice, status=SolverStatus.OPTIMAL, objective=objective,
                bound=objective, wall_s=time.perf_counter() - started, variables=0,
                constraints=0,
            )  # fmt: skip
            break
        alive = undominated(problem)
        if sum(map(len, alive)) >= problem.variables:
            found = _reduced_cp_sat(problem, limit, tracker, unit)
            break
        narrowed = problem.restricted(alive)
        if tracker is not None:
            tracker.detail(f"{narrowed.variables} of {problem.variables} choices no dead end, "
                           "memory aside")  # fmt: skip
        narrowings.append(alive)
        problem = narrowed
    if not narrowings:
        return found
    for alive in reversed(narrowings):
        found = dataclasses.replace(found, choice=in_whole(found.choice, alive))
    return dataclasses.replace(found, wall_s=time.perf_counter() - started)


def _reduced_cp_sat(problem: Problem, limit: Limit, tracker: Tracker | None, unit: str) -> Solution:
    """CP-SAT, memory aside, on what is left once the groups of degree <= 2 are eliminated.
    OR-Tools is imported here, where CP-SAT is called: a plan elimination answers never
    loads it."""
    from autoshard.search.solver.cp_sat import solve_cp_sat

    reduced, kept, order = eliminate(problem)
    # Elimination folds the groups it removes into the rest but for a constant: the costs of
    # those left with no neighbour. Any choice of the rest tells it.
    zeros = [0] * len(kept)
    offset = problem.objective(_expand(zeros, kept, order, len(problem.sizes)))
    offset -= reduced.objective(zeros)
    watch = None
    if tracker is not None:
        tracker.detail(f"CP-SAT on {len(reduced.sizes)} of {len(problem.sizes)} groups "
                       "(the rest eliminated), memory aside")  # fmt: skip
        watch = Improvements(tracker, problem.unit, unit, offset)
    relaxed, _ = solve_cp_sat(reduced, limit, memory=False, watch=watch)
    choice = _expand(relaxed.choice, kept, order, len(problem.sizes))
    objective = problem.objective(choice)
    proven = relaxed.status is SolverStatus.OPTIMAL
    bound = objective if proven else relaxed.bound + offset
    return dataclasses.replace(relaxed, choice=choice, objective=objective, bound=bound)


@dataclass(frozen=True)
class _Eliminated:
    """Group g, removed given its neighbours' choices: `best[k1][k2]` (or `best[k1]`, or
    `best[0]`) is its optimal choice for neighbour choices k1 (k2)."""

    group: int
    neighbours: tuple[int, ...]
    best: np.ndarray


def eliminate(problem: Problem) -> tuple[Problem, list[int], list[_Eliminated]]:
    """Remove groups of degree <= 2 by exact min-sum elimination (variable elimination on the
    pairwise cost graph): a leaf g of neighbour h adds min_kg (node_g + M[kh][kg]) to h; a
    chain link g between h1 and h2 adds min_kg (node_g + M1[k1][kg] + M2[kg][k2]) as an edge
    (h1, h2); a group with one choice adds its edges to its neighbours, whatever its degree.
    The optimum of the rest, plus the recorded argmins, is the optimum of the whole. Only valid
    without memory rows (they couple groups beyond the edges). Returns the reduced problem, the
    original group of each of its groups, and the eliminations in order."""
    node = [np.array(c, dtype=np.int64) for c in problem.node_costs]
    edges: dict[tuple[int, int], np.ndarray] = {}
    near: list[set[int]] = [set() for _ in node]  # each group's neighbours

    def add(a: int, b: int, m: np.ndarray) -> None:
        if a > b:
            a, b, m = b, a, m.T
        edges[(a, b)] = edges[(a, b)] + m if (a, b) in edges else m.copy()
        near[a].add(b)
        near[b].add(a)

    for a, b, m in problem.edges:
        if a == b:  # pragma: no cover - the builder folds these into node costs
            node[a] += np.diag(np.array(m))
        else:
            add(a, b, np.array(m, dtype=np.int64))
    alive = set(range(len(node)))
    order: list[_Eliminated] = []

    def matrix(g: int, h: int) -> np.ndarray:  # rows: h's choices, columns: g's
        return edges[(h, g)] if (h, g) in edges else edges[(g, h)].T

    def removable(g: int) -> bool:
        return len(node[g]) == 1 or len(near[g]) <= 2

    # The least removable group first, as a scan from the first group after each removal
    # would find it: a removal never adds to a neighbour's degree (a chain link's two
    # neighbours trade it for each other), so a group once removable stays so.
    ready = [g for g in range(len(node)) if removable(g)]
    heapq.heapify(ready)
    while ready:
        g = heapq.heappop(ready)
        if g not in alive:
            continue
        around = sorted(near[g])
        kept_near: list[int] = []
        if len(node[g]) == 1:  # no choice: its edges are costs of its neighbours' choices
            for h in around:
                node[h] = node[h] + matrix(g, h)[:, 0]
            best = np.zeros(1, dtype=np.int64)
        elif not around:
            best = np.array([int(np.argmin(node[g]))])
        elif len(around) == 1:
            (h,) = kept_near = around
            total = matrix(g, h) + node[g][None, :]
            best = np.argmin(total, axis=1)
            node[h] = node[h] + total[np.arange(len(best)), best]
        else:
            h1, h2 = kept_near = around
            total = (
                matrix(g, h1)[:, :, None] + node[g][None, :, None] + matrix(g, h2).T[None]
            )  # [k1, kg, k2]
            best = np.argmin(total, axis=1)
            add(h1, h2, np.take_along_axis(total, best[:, None, :], axis=1)[:, 0, :])
        for h in around:
            del edges[(min(g, h), max(g, h))]
            near[h].discard(g)
            if removable(h):
                heapq.heappush(ready, h)
        near[g].clear()
        alive.discard(g)
        order.append(_Eliminated(g, tuple(kept_near), best))
    kept = sorted(alive)
    return _reduced(problem, node, edges, kept), kept, order


def _reduced(
    problem: Problem, node: list[np.ndarray], edges: dict[tuple[int, int], np.ndarray],
    kept: list[int],
) -> Problem:  # fmt: skip
    """The problem of the groups `kept`, with the costs and edges elimination left them."""
    index = {g: i for i, g in enumerate(kept)}
    return Problem(
        tuple(len(node[g]) for g in kept),
        tuple(tuple(int(c) for c in node[g]) for g in kept),
        tuple(
            (index[a], index[b], tuple(tuple(int(c) for c in row) for row in m))
            for (a, b), m in sorted(edges.items())
        ),
        NO_ROWS,
        problem.budget,
        problem.unit,
    )


def _expand(choice_of_kept: Sequence[int], kept: Sequence[int], order: Sequence[_Eliminated],
            groups: int) -> tuple[int, ...]:  # fmt: skip
    """Choices of every group: the kept ones as solved, the eliminated ones from their
    recorded argmins, in reverse elimination order."""
    choice = [-1] * groups
    for g, k in zip(kept, choice_of_kept, strict=True):
        choice[g] = k
    for step in reversed(order):
        picks = [choice[h] for h in step.neighbours]
        choice[step.group] = int(step.best[tuple(picks)] if picks else step.best[0])
    return tuple(choice)
