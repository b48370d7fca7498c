"""The ILP as OR-Tools CP-SAT models, written and run: one candidate per group, minimum total
cost (or least peak, `least_peak_model`).

    variables   x[g][k] in {0, 1}, sum_k x[g][k] = 1             one choice per group
                y[a,b][r][c] in {0, 1}                            edge (a, b) in cell (r, c)
    edges       sum_c y[r][c] = sum_{ka in row class r} x[a][ka]
                sum_r y[r][c] = sum_{kb in column class c} x[b][kb]
    memory      sum (bytes * x[g][k]) over a liveness row <= budget
    objective   min sum_g sum_k node[g][k] x[g][k] + sum M[r][c] y[a,b][r][c]

An edge's matrix has few distinct rows and columns (choices of a that hold the value alike,
choices of b that read it alike), so the pair variables are over those classes: few, and their
linear relaxation is tight (a transportation polytope), which is what lets CP-SAT prove
optimality fast. Deterministic: one worker, a fixed seed and a deterministic time limit. A
model holds the memory rows that bind the relaxation, and those its plan goes over next (row
generation, `solve_cp_sat`): a training step's rows are thousands, each of hundreds of terms.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
from ortools.sat.python import cp_model

from autoshard.search.memory.rows import Chosen, Indicator, MemoryRows
from autoshard.search.problem import Problem
from autoshard.search.solver.outcome import (
    Improvements,
    Limit,
    NoPlan,
    OutOfTime,
    Solution,
    SolverStatus,
)


def ilp_model(
    problem: Problem,
    memory: bool,
    hint: Sequence[int] = (),
    among: np.ndarray | None = None,
) -> tuple[cp_model.CpModel, list[list[cp_model.IntVar]]]:
    """The ILP of the module's docstring as a CP-SAT model (the memory rows too where
    `memory`: those in `among`, or all), and its one-hot variables x[g][k]: what `solve_cp_sat`
    solves, and what `bench/relaxation_gap.py` relaxes to an LP."""
    model = cp_model.CpModel()
    x = _one_hot(model, problem)
    _hint(model, x, hint)
    objective = [
        cost * var
        for costs, row in zip(problem.node_costs, x, strict=True)
        for cost, var in zip(costs, row, strict=True)
        if cost
    ]
    for a, b, matrix in problem.edges:
        rows, row_of = _classes(matrix)
        columns, column_of = _classes(list(zip(*matrix, strict=True)))
        if all(c == 0 for row in rows for c in row):
            continue
        y = [[model.new_bool_var(f"y{a}_{b}_{r}_{c}") for c in range(len(columns))]
             for r in range(len(rows))]  # fmt: skip
        for r, cells in enumerate(y):
            members = [x[a][k] for k, cls in enumerate(row_of) if cls == r]
            model.add(sum(cells) == sum(members))
        for c in range(len(columns)):
            members = [x[b][k] for k, cls in enumerate(column_of) if cls == c]
            model.add(sum(y[r][c] for r in range(len(rows))) == sum(members))
        objective += [
            rows[r][column_members[0]] * y[r][c]
            for c, column_members in enumerate(_members(column_of, len(columns)))
            for r in range(len(rows))
            if rows[r][column_members[0]]
        ]
    if memory:
        for bytes_live in _memory_rows(model, problem, x, problem.budget, among):
            model.add(bytes_live <= problem.budget)
    model.minimize(sum(objective))
    return model, x


def least_peak_model(
    problem: Problem,
    hint: Sequence[int] = (),
    at_least: int = 0,
    among: np.ndarray | None = None,
) -> tuple[cp_model.CpModel, list[list[cp_model.IntVar]]]:
    """The least peak as a CP-SAT model: each row (of those `among`, or all) that may hold
    more than `at_least` at most the peak, minimized; and its one-hot variables x[g][k]. A
    `hint` is given whole: its peak, and each indicator and group's bytes as the plan sets
    them: of its choices alone, CP-SAT sets the others to a plan of a higher peak and
    searches its way back."""
    model = cp_model.CpModel()
    x = _one_hot(model, problem)
    _hint(model, x, hint)
    top = int(problem.most().max(initial=problem.memory_base.most()[0]))
    low, high = min(at_least, max(top, 1)), max(top, 1)
    peak = model.new_int_var(low, high, "peak")
    if hint:
        model.add_hint(peak, min(max(problem.peak(hint), low), high))
    for bytes_live in _memory_rows(model, problem, x, low, among, hint):
        model.add(bytes_live <= peak)
    model.minimize(peak)
    return model, x


def _one_hot(model: cp_model.CpModel, problem: Problem) -> list[list[cp_model.IntVar]]:
    """x[g][k]: group g takes choice k; exactly one per group."""
    x = [[model.new_bool_var(f"x{g}_{k}") for k in range(n)] for g, n in enumerate(problem.sizes)]
    for one_hot in x:
        model.add_exactly_one(one_hot)
    return x


def _hint(model: cp_model.CpModel, x: list[list[cp_model.IntVar]], hint: Sequence[int]) -> None:
    """Start CP-SAT's search from a choice per group (none: no hint)."""
    for row, k in zip(x, hint, strict=False):
        for j, var in enumerate(row):
            model.add_hint(var, j == k)


def _memory_rows(
    model: cp_model.CpModel,
    problem: Problem,
    x: list[list[cp_model.IntVar]],
    above: int,
    among: np.ndarray | None = None,
    hint: Sequence[int] = (),
) -> list[cp_model.LinearExpr]:
    """The bytes of each memory row (of those `among`, or all) that may hold more than
    `above` as a linear expression (the others cannot bind: a narrowed problem's choices
    leave most rows of a training step under the budget, and each row is hundreds of terms),
    with a variable for each indicator those rows use. An indicator is a variable bounded
    on one side only: where rows add its bytes (bounded from above by the budget), from below
    (an AND by the sum of its literals less their number plus one, an OR by each literal);
    where they take bytes off (`search.memory`'s savings), from above (an AND by each literal,
    an OR by their sum). Either way any plan that fits can set it to its true value, and a
    solver setting it otherwise only makes its rows larger (`search.memory`). The literals of
    an indicator are bounded as it is (ANDs and ORs are monotone). Given a `hint` (a plan),
    each variable is hinted its value under it."""
    which = rows_over(problem, above)
    if among is not None:
        which = np.intersect1d(which, among)
    if not len(which):
        return []
    made = _indicators(model, problem, x, which, hint)
    runs = _Runs(model, x, hint)
    (base,) = runs.bytes_of(problem.memory_base, [0], made)
    return [base + row for row in runs.bytes_of(problem.memory, which.tolist(), made)]


def _indicators(
    model: cp_model.CpModel,
    problem: Problem,
    x: list[list[cp_model.IntVar]],
    which: np.ndarray,
    hint: Sequence[int],
) -> dict[int, cp_model.IntVar]:
    """A variable for each indicator the rows `which` (or the base row) use, bounded on the
    side those rows need (`_memory_rows`), by indicator."""
    made: dict[int, cp_model.IntVar] = {}

    def literal(lit: Chosen | int) -> cp_model.LinearExprT:
        if isinstance(lit, Chosen):
            return cp_model.LinearExpr.sum([x[lit.group][k] for k in sorted(lit.choices)])
        return made[lit]

    adds, takes = _polarity(problem, which)
    values = problem.indicator_table.values(hint) if hint else np.zeros(0, bool)
    for i, ind in enumerate(problem.indicators):
        if not (adds[i] or takes[i]):  # in none of these rows
            continue
        var = model.new_bool_var(f"m{i}")
        if hint:
            model.add_hint(var, bool(values[i]))
        terms = [literal(lit) for lit in ind.literals]
        if adds[i]:
            if ind.every:
                model.add(var >= sum(terms) - (len(terms) - 1))
            else:
                for term in terms:
                    model.add(var >= term)
        if takes[i]:
            if ind.every:
                for term in terms:
                    model.add(var <= term)
            else:
                model.add(var <= sum(terms))
        made[i] = var
    # Savings of one thing under exclusive choices (ANDs of one literal on one group, its
    # choices disjoint, with the same rest: the home tensor held in shardings of each size,
    # dead) hold one at a time, and only where the rest does: their sum is at most it.
    for rest, members in _exclusive_ands(problem.indicators, takes):
        model.add(sum(made[i] for i in members) <= literal(rest))
    return made


class _Runs:
    """A group's bytes in a row (a run: the values of that group live there) as one variable,
    shared by every row holding the same: rows of a term per group, not per choice."""

    def __init__(
        self, model: cp_model.CpModel, x: list[list[cp_model.IntVar]], hint: Sequence[int]
    ) -> None:
        self.model, self.x, self.hint = model, x, hint
        self.held: dict[tuple[int, bytes, bytes], cp_model.IntVar] = {}

    def run_bytes(self, rows: MemoryRows, run: int) -> cp_model.IntVar:
        """The variable of a run's bytes, made where no run alike made one."""
        group = int(rows.run_group[run])
        first, last = rows.run_starts[run], rows.run_starts[run + 1]
        choices, amounts = rows.choices[first:last], rows.amounts[first:last]
        key = (group, choices.tobytes(), amounts.tobytes())
        if key not in self.held:
            low, high = int(amounts.min(initial=0)), int(amounts.max(initial=0))
            var = self.model.new_int_var(low, high, f"g{group}_{len(self.held)}")
            terms = list(zip(choices.tolist(), amounts.tolist(), strict=True))
            self.model.add(var == sum(b * self.x[group][k] for k, b in terms))
            if self.hint:
                self.model.add_hint(var, sum(b for k, b in terms if k == self.hint[group]))
            self.held[key] = var
        return self.held[key]

    def bytes_of(
        self, rows: MemoryRows, which: Sequence[int], made: dict[int, cp_model.IntVar]
    ) -> list[cp_model.LinearExpr]:
        """The bytes of the rows `which` of `rows`, the indicators' variables `made`."""
        made_runs: dict[int, cp_model.IntVar] = {}
        runs, starts = rows.runs.tolist(), rows.starts.tolist()
        marks, indices = rows.indicated_starts.tolist(), rows.indicated.tolist()
        amounts = rows.indicated_amounts.tolist()
        found = []
        for r in which:
            groups = []
            for u in runs[starts[r] : starts[r + 1]]:
                if u not in made_runs:
                    made_runs[u] = self.run_bytes(rows, u)
                groups.append(made_runs[u])
            indicated = [made[i] for i in indices[marks[r] : marks[r + 1]]]
            weights = [1] * len(groups) + amounts[marks[r] : marks[r + 1]]
            expr = cp_model.LinearExpr.weighted_sum(groups + indicated, weights)
            found.append(expr + int(rows.fixed[r]))
        return found


def rows_over(problem: Problem, above: int) -> np.ndarray:
    """The memory rows that may hold more than `above` under some choice: those CP-SAT's
    model constrains (`_memory_rows`), in order."""
    return np.flatnonzero(problem.most() > above)


def _exclusive_ands(
    indicators: Sequence[Indicator], takes: Sequence[bool]
) -> list[tuple[int, list[int]]]:
    """Indicators bounded from above that hold one at a time, and only where another does:
    ANDs of a `Chosen` and an indicator `rest`, two or more with the same rest and disjoint
    choices of one group; as (rest, the ANDs)."""
    found: dict[tuple[int, int], list[int]] = {}
    for i, ind in enumerate(indicators):
        if takes[i] and ind.every and len(ind.literals) == 2:
            chosen, rest = ind.literals
            if isinstance(chosen, Chosen) and not isinstance(rest, Chosen):
                found.setdefault((rest, chosen.group), []).append(i)
    sums = []
    for (rest, _), members in found.items():
        choices = [
            lit.choices for i in members if isinstance(lit := indicators[i].literals[0], Chosen)
        ]
        if len(members) > 1 and sum(map(len, choices)) == len(frozenset().union(*choices)):
            sums.append((rest, members))
    return sums


def _polarity(problem: Problem, which: np.ndarray) -> tuple[list[bool], list[bool]]:
    """For each indicator, whether the base row or a row of `which` adds bytes when it holds,
    and whether one takes bytes off, directly or through an indicator it is a literal of
    (neither: those rows do not use it)."""
    count = len(problem.indicators)
    adding, taking = np.zeros(count, bool), np.zeros(count, bool)
    for rows, selected in ((problem.memory_base, np.zeros(1, np.int64)), (problem.memory, which)):
        marks, selected = rows.marks, np.sort(selected)
        # A span's term is used where a row selected lies within it.
        within = np.searchsorted(selected, marks.last, "right")
        used = within > np.searchsorted(selected, marks.first)
        indicated, amounts = marks.key[used], marks.amount[used]
        adding[indicated[amounts > 0]] = True
        taking[indicated[amounts < 0]] = True
    adds, takes = adding.tolist(), taking.tolist()
    for i in reversed(range(len(problem.indicators))):  # users come after their literals
        for lit in problem.indicators[i].literals:
            if not isinstance(lit, Chosen):
                adds[lit] |= adds[i]
                takes[lit] |= takes[i]
    return adds, takes


def _classes(rows: Sequence[Sequence[int]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """The distinct rows, and the class of each row."""
    index: dict[tuple[int, ...], int] = {}
    of = [index.setdefault(tuple(row), len(index)) for row in rows]
    return list(index), of


def _members(of: Sequence[int], count: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(count)]
    for k, cls in enumerate(of):
        out[cls].append(k)
    return out


def deterministic_solver(
    time_limit: float, wall: float = math.inf, probing: bool = True
) -> cp_model.CpSolver:
    """Deterministic settings. Probing in presolve only (level 1), the LP the full
    linearization (its bound is what proves optimality here). Probing's deterministic time
    is charged above its wall time, the search's below, and level 1 swings less than the
    default level 2 for the same speed. `wall`: the seconds left to the command's deadline,
    a second limit that decides only where it binds first (a single worker's search takes the
    same path whatever its wall-clock limit, up to where that limit stops it). `probing`
    False: neither probing nor symmetry in presolve, for many small solves in short slices
    (`iopddl.lns`'s neighbourhoods), where probing their pair variables would take the slice."""
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_deterministic_time = time_limit
    if math.isfinite(wall):
        solver.parameters.max_time_in_seconds = wall
    solver.parameters.cp_model_probing_level = 1 if probing else 0
    if not probing:
        solver.parameters.symmetry_level = 0
    solver.parameters.linearization_level = 2
    # Ctrl-C is Python's (`run_solver`): CP-SAT's own catch would end the solve as if out of
    # time, and leave SIGINT at its default (a silent kill) once the solve returns.
    solver.parameters.catch_sigint_signal = False
    return solver


def run_solver(
    solver: cp_model.CpSolver, model: cp_model.CpModel, watch: Improvements | None
) -> cp_model.CpSolverStatus:
    """CP-SAT's solve, which Ctrl-C stops at once: in the main thread, the solve runs in a
    thread of its own while the main thread waits, free to take the KeyboardInterrupt that
    Python raises only between bytecodes (never inside C++); it stops the search and is
    raised on. In another thread, where Python delivers no signal, the solve runs in place."""
    told = None
    if watch is not None:
        solver.best_bound_callback = watch.bound
        told = _Told(watch)
    if threading.current_thread() is not threading.main_thread():
        return solver.solve(model, told)
    # An Event, not Thread.join: a KeyboardInterrupt inside join() may leave the thread marked
    # ended while CP-SAT still runs in it, and exiting then aborts the process.
    done = threading.Event()
    result: list[cp_model.CpSolverStatus | BaseException] = []

    def solve() -> None:
        try:
            result.append(solver.solve(model, told))
        except BaseException as error:  # raised on in the main thread
            result.append(error)
        finally:
            done.set()

    solving = threading.Thread(target=solve, name="cp-sat", daemon=True)
    try:
        solving.start()
        while not done.wait(0.1):  # (a signal taken by the solving thread is seen in 0.1 s)
            pass
    except KeyboardInterrupt:
        while solving.is_alive() and not done.wait(0.05):
            solver.stop_search()  # again until it ends: a stop asked before the solve began is lost
        raise
    (outcome,) = result
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


class _Told(cp_model.CpSolverSolutionCallback):
    """CP-SAT's solution callback: each plan found, handed to `watch`."""

    def __init__(self, watch: Improvements) -> None:
        super().__init__()
        self.watch = watch

    def on_solution_callback(self) -> None:
        self.watch.solution(self)


def solve_cp_sat(
    problem: Problem,
    limit: Limit,
    memory: bool,
    hint: Sequence[int] = (),
    watch: Improvements | None = None,
    rows: np.ndarray | None = None,
    probing: bool = True,
) -> tuple[Solution, np.ndarray | None]:
    """CP-SAT on `problem`, its memory rows too where `memory`; and the rows its last model
    held (None: all). Given `rows` (those that bind the relaxation, or that a solve before
    held), the model holds those alone at first, and the rows its plan goes over join it for
    the next solve, until the plan fits them all (row generation: a model of fewer rows has no
    higher optimum, so a plan of it that fits every row and that it proves optimal is the
    optimum, and its bound holds for the whole). A training step has thousands of rows of
    hundreds of terms each, and few bind: the whole model is slow to write out.

    A bound proven elsewhere is not written into the model (the objective at least it):
    OR-Tools 9.15's presolve, given one, can cut the optimum off (or-tools#5293, in
    `ProcessAtMostOneAndLinear`; `test_a_narrowed_solve_finds_its_optimum`). `probing`:
    `deterministic_solver`'s."""
    among = rows if memory else None
    started, work, bound = time.perf_counter(), 0.0, -math.inf
    while True:
        given = dataclasses.replace(limit, seconds=limit.seconds - work)
        if limit.deadline.passed():  # (a large model takes seconds to write out)
            raise OutOfTime(given.out_of_time("FEASIBLE" if work else "UNKNOWN"))
        model, x = ilp_model(problem, memory, hint, among)
        solver = deterministic_solver(max(given.seconds, 0.0), limit.deadline.left(), probing)
        if watch is not None:
            watch.fits = None if among is None else fitting_plans(problem, x, problem.budget)
        status = run_solver(solver, model, watch)
        work += solver.response_proto.deterministic_time
        if status == cp_model.INFEASIBLE:
            raise NoPlan(work)
        choice = chosen_plan(solver, status, x, given)
        bound = max(bound, solver.best_objective_bound)
        if among is None:  # every row in the model
            break
        over = np.flatnonzero(problem.live(choice) > problem.budget)
        if not len(over):
            break
        if watch is not None:  # the next solve's bound starts lower
            watch.floor = max(watch.floor, bound)
        if work >= limit.seconds:
            raise OutOfTime(given.out_of_time("FEASIBLE"))
        among = np.union1d(among, over)
    optimal = status == cp_model.OPTIMAL
    proto = model.proto
    solved = Solution(
        choice=choice,
        status=SolverStatus.OPTIMAL if optimal else SolverStatus.FEASIBLE,
        objective=problem.objective(choice),
        bound=bound,
        wall_s=time.perf_counter() - started,
        variables=len(proto.variables),
        constraints=len(proto.constraints),
        work=work,
    )
    return solved, among


def fitting_plans(
    problem: Problem, x: list[list[cp_model.IntVar]], budget: int | None
) -> Callable[[cp_model.CpSolverSolutionCallback], bool]:
    """Whether the plan a solve of fewer memory rows found holds at most `budget` in them all
    (None: its objective, the least peak's peak)."""

    def fits(solution: cp_model.CpSolverSolutionCallback) -> bool:
        most = solution.objective_value if budget is None else budget
        return problem.peak(_read(solution.value, x)) <= most

    return fits


def chosen_plan(
    solver: cp_model.CpSolver,
    status: cp_model.CpSolverStatus,
    x: list[list[cp_model.IntVar]],
    limit: Limit,
) -> tuple[int, ...]:
    """The choice per group of a solve that found a plan."""
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise OutOfTime(limit.out_of_time(solver.status_name(status)))
    return _read(solver.value, x)


def _read(
    value: Callable[[cp_model.IntVar], int], x: list[list[cp_model.IntVar]]
) -> tuple[int, ...]:
    """The choice per group of a solution, from the value of each one-hot variable."""
    return tuple(next(k for k, v in enumerate(row) if value(v)) for row in x)
