"""The ILP against exhaustive search: on problems small enough to enumerate, CP-SAT's optimum
(with the exact elimination of low-degree groups, and with memory rows) equals the best of all
choices."""

import dataclasses
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from ortools.sat.python import cp_model

from autoshard.analysis.repeats import find_repeats
from autoshard.cost.cluster import make_cluster
from autoshard.cost.liveness import memory
from autoshard.errors import AutoshardError
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.passes.lower import lower
from autoshard.rules import rule_for
from autoshard.search.candidates import candidates
from autoshard.search.memory.rows import NO_ROWS, Chosen, Indicator, MemoryRow, MemoryRows
from autoshard.search.problem import Problem, build_search
from autoshard.search.solver import cp_sat, lowest, outcome, tuning
from autoshard.search.solver import solve as ilp
from autoshard.search.solver.dual import dual
from autoshard.search.solver.eliminate import eliminate
from autoshard.search.solver.lowest import lowest_budget
from autoshard.search.solver.marginals import still_possible
from autoshard.search.solver.narrowing import Narrowing
from autoshard.search.solver.outcome import InfeasibleError
from autoshard.search.solver.solve import solve
from tests.golden.seed_models import write_seed_mlp

MODELS = Path(__file__).resolve().parents[2] / "models"


def brute_force(problem: Problem):
    """The least objective of every choice whose peak fits (None: none fits). The objective of
    every choice is summed at once, each node's and edge's costs broadcast over the grid of
    all choices; the peaks are then read in ascending objective, the first that fits the
    least (each choice's peak computed only until then)."""
    grid = np.indices(problem.sizes, sparse=True)
    totals = np.zeros(problem.sizes, dtype=object if _wide(problem) else np.int64)
    for g, costs in enumerate(problem.node_costs):
        totals = totals + np.asarray(costs, dtype=totals.dtype)[grid[g]]
    for a, b, matrix in problem.edges:
        totals = totals + np.asarray(matrix, dtype=totals.dtype)[grid[a], grid[b]]
    flat = totals.reshape(-1)
    for index in np.argsort(flat, kind="stable"):
        choice = tuple(int(k) for k in np.unravel_index(index, problem.sizes))
        if problem.peak(choice) <= problem.budget:
            return int(flat[index])
    return None


def _wide(problem: Problem) -> bool:
    """Whether some choice's objective may pass int64 (summed as Python integers then)."""
    most = sum(max(map(abs, costs), default=0) for costs in problem.node_costs)
    most += sum(max((abs(c) for row in m for c in row), default=0) for _, _, m in problem.edges)
    return most >= 2**62


def random_problem(seed, groups=5, memory=False):
    rng = np.random.default_rng(seed)
    sizes = tuple(int(n) for n in rng.integers(1, 5, groups))
    edges = []
    for a, b in itertools.combinations(range(groups), 2):
        if rng.random() < 0.5:
            m = rng.integers(0, 100, (sizes[a], sizes[b]))
            edges.append((a, b, tuple(tuple(int(c) for c in row) for row in m)))
    rows: tuple[MemoryRow, ...] = ()
    indicators: list[Indicator] = []
    if memory:
        # Indicators as the memory model makes them: ANDs and ORs of "group g chose one of K"
        # and of earlier indicators (reshard buffers live when held != s and read so), adding
        # bytes or taking them off (savings), some both.
        def literal():
            if indicators and rng.random() < 0.3:
                return int(rng.integers(0, len(indicators)))
            g = int(rng.integers(0, groups))
            ks = frozenset(int(k) for k in range(sizes[g]) if rng.random() < 0.5) or {0}
            return Chosen(g, frozenset(ks))

        for _ in range(4):
            indicators.append(Indicator(bool(rng.random() < 0.6), (literal(), literal())))
        rows = tuple(
            MemoryRow(
                int(rng.integers(0, 10)),
                tuple((g, k, int(rng.integers(1, 50))) for g in range(groups)
                      for k in range(sizes[g]) if rng.random() < 0.6),
                tuple((i, int(rng.integers(1, 30)) * (1 if rng.random() < 0.7 else -1))
                      for i in range(len(indicators)) if rng.random() < 0.5),
            )
            for _ in range(3)
        )  # fmt: skip
    node = tuple(tuple(int(c) for c in rng.integers(0, 100, n)) for n in sizes)
    return Problem(sizes, node, tuple(edges), MemoryRows.of(rows), 80, 1.0, tuple(indicators))


@pytest.mark.parametrize("seed", range(12))
def test_where_the_relaxation_finds_no_plan_that_fits_the_least_peak_says_whether_any_does(
    seed, monkeypatch
):
    """The relaxation turned off (it finds no plan): below the least peak, the error carries
    the lowest budget, proven, and no try of the cost was made; at the least peak, the
    optimum, from the least peak's plan."""
    monkeypatch.setattr(ilp, "dual", lambda problem, **_: None)
    problem = random_problem(seed, memory=True)
    least = min(problem.peak(c) for c in itertools.product(*map(range, problem.sizes)))
    below = dataclasses.replace(problem, budget=least - 1)
    narrowed = []
    monkeypatch.setattr(cp_sat, "solve_cp_sat", lambda *a, **_: narrowed.append(a))
    with pytest.raises(InfeasibleError) as error:
        solve(below)
    assert error.value.lowest is not None and not narrowed
    assert (error.value.lowest.peak, error.value.lowest.status) == (least, "OPTIMAL")
    monkeypatch.undo()
    monkeypatch.setattr(ilp, "dual", lambda problem, **_: None)
    at = dataclasses.replace(problem, budget=least)
    assert solve(at).objective == brute_force(at)


@pytest.mark.parametrize("seed", range(30))
def test_random_problems_without_memory(seed):
    problem = random_problem(seed)
    assert solve(problem).objective == brute_force(problem)


@pytest.mark.parametrize("seed", range(30))
def test_random_problems_with_memory(seed):
    problem = random_problem(seed, memory=True)
    expected = brute_force(problem)
    if expected is None:
        with pytest.raises(InfeasibleError):
            solve(problem)
    else:
        solution = solve(problem)
        assert solution.objective == expected
        assert problem.peak(solution.choice) <= problem.budget


def test_rows_join_the_model_as_its_plans_go_over_them(monkeypatch):
    """CP-SAT from none of the memory rows (row generation, `cp_sat.solve_cp_sat` given
    `rows`): each plan that goes over rows left out brings them in, and the plan returned is
    the optimum of all of them, as exhaustive search finds it. The rows its last model held,
    returned, start a solve again in one model (`solve`'s next narrowed try)."""
    limit, none = outcome.Limit(60.0, 60.0, "test"), np.zeros(0, np.int64)
    solves = []
    run = cp_sat.run_solver
    monkeypatch.setattr(cp_sat, "run_solver", lambda *args: solves.append(1) or run(*args))
    binding = 0
    for seed in range(30):
        problem = random_problem(seed, memory=True)
        expected = brute_force(problem)
        if expected is None:
            continue
        free = brute_force(dataclasses.replace(problem, budget=10**9))
        binding += free < expected  # the first solve's plan went over some row
        solution, rows = cp_sat.solve_cp_sat(problem, limit, True, rows=none)
        assert (solution.objective, solution.status) == (expected, "OPTIMAL")
        assert problem.peak(solution.choice) <= problem.budget
        solves.clear()
        again, held = cp_sat.solve_cp_sat(problem, limit, True, rows=rows)
        assert (again.objective, len(solves)) == (expected, 1)
        assert rows is not None and np.array_equal(held, rows)
    assert binding >= 5


def test_a_bound_proven_before_spares_the_proof(monkeypatch):
    """`solve(floor=...)`: a bound proven on rows counting less (`budget.auto_plan`'s rounds)
    holds for these. Where the relaxation's best plan is the optimum but the search needs
    CP-SAT (turned off here) to prove it, the floor proves it."""

    def no_cp_sat(*_, **__):
        raise AssertionError("CP-SAT was asked")

    monkeypatch.setattr(cp_sat, "solve_cp_sat", no_cp_sat)  # (its callers import it at the call)
    spared = 0
    for seed in range(60):
        problem = random_problem(seed, groups=6, memory=True)
        expected = brute_force(problem)
        found = dual(problem)
        if expected is None or found is None or found.best is None:
            continue
        if found.best.objective != expected:
            continue
        try:
            solve(problem)
            continue  # proven without CP-SAT (a second relaxation, within the choices that fit)
        except AssertionError:
            pass
        solution = solve(problem, floor=expected)
        assert (solution.objective, solution.bound, solution.status) == (
            expected, expected, "OPTIMAL",
        )  # fmt: skip
        spared += 1
    assert spared >= 3


@pytest.mark.parametrize("seed", range(30))
def test_lowest_budget_is_the_least_peak(seed):
    problem = random_problem(seed, memory=True)
    least = min(
        problem.peak(choice) for choice in itertools.product(*(range(n) for n in problem.sizes))
    )
    lowest = lowest_budget(problem)
    assert (lowest.peak, lowest.bound, lowest.status) == (least, least, "OPTIMAL")
    assert problem.peak(lowest.choice) == least


@pytest.mark.parametrize("model, mesh", [("gpt2.onnx", "2x4"), ("bert.onnx", "4x8")])
def test_the_least_peaks_model_is_hinted_a_whole_plan(model, mesh):
    """Every variable of the least peak's model hinted, and the hint one solution: CP-SAT with
    each variable fixed to its hint finds it feasible, its peak the plan's (a random plan of
    each of the real problems, whose indicators add bytes and take them off; from no bound,
    and from a bound above the plan's peak, which the peak variable's domain keeps)."""
    graph = import_onnx(MODELS / model, {"batch": 8, "seq": 128})
    problem = build_search(graph, make_cluster(mesh=mesh)).problem
    rng = np.random.default_rng(0)
    plan = tuple(int(rng.integers(n)) for n in problem.sizes)
    for at_least in (0, problem.peak(plan) + 1):
        model, _ = cp_sat.least_peak_model(problem, plan, at_least)
        assert len(model.proto.solution_hint.vars) == len(model.proto.variables)
        solver = cp_sat.deterministic_solver(10.0)
        solver.parameters.fix_variables_to_their_hinted_value = True
        assert solver.solve(model) == cp_model.OPTIMAL
        assert solver.objective_value == max(problem.peak(plan), at_least)


def test_the_least_peaks_rows_join_its_model_as_its_plans_go_over_them(monkeypatch):
    """From the plan of the greatest peak, bounded by the least (the tightest bound there is),
    the model holds at first the rows that plan holds the bound in; where the plan CP-SAT
    finds goes over the others, they join it and it is solved again, to the least peak,
    proven (exhaustive search), on every problem, a quarter of them in several solves."""
    solves = []
    run = lowest.run_solver
    monkeypatch.setattr(lowest, "run_solver", lambda *args: solves.append(1) or run(*args))
    again = 0
    for seed in range(30):
        problem = random_problem(seed, groups=6, memory=True)
        plans = list(itertools.product(*(range(n) for n in problem.sizes)))
        least = min(map(problem.peak, plans))
        solves.clear()
        limit = outcome.Limit(10.0, 10.0, "lowest-budget")
        got, _ = lowest._least_peak(problem, limit, None, max(plans, key=problem.peak), least)
        assert (got.value, got.bound, got.optimal) == (least, least, True)
        assert problem.peak(got.choice) == least
        again += len(solves) > 1
    assert again >= 5


def test_elimination_is_exact_on_a_cycle_with_tails():
    """A 4-cycle with a 2-group tail on each node: elimination removes the tails and one cycle
    node, and the optimum is unchanged."""
    rng = np.random.default_rng(7)
    sizes = (3,) * 12
    pairs = [(0, 1), (1, 2), (2, 3), (0, 3)] + [(i, 4 + 2 * i) for i in range(4)] + [
        (4 + 2 * i, 5 + 2 * i) for i in range(4)]  # fmt: skip
    edges = tuple(
        (a, b, tuple(tuple(int(c) for c in row) for row in rng.integers(0, 50, (3, 3))))
        for a, b in pairs
    )
    node = tuple(tuple(int(c) for c in rng.integers(0, 50, 3)) for _ in sizes)
    problem = Problem(sizes, node, edges, NO_ROWS, 0, 1.0)
    reduced, kept, _ = eliminate(problem)
    assert len(kept) < 4
    assert solve(problem).objective == brute_force(problem)


def test_a_group_without_choice_is_eliminated_whatever_its_degree():
    """A one-choice hub joined to a 4-cycle (as the decoder's shape constant is read by every
    head reshape): its edges become costs of the others' choices, the cycle then goes link by
    link, and nothing is left for CP-SAT."""
    rng = np.random.default_rng(3)
    sizes = (1, 3, 3, 3, 3)
    pairs = [(0, 1), (0, 2), (0, 3), (0, 4), (1, 2), (2, 3), (3, 4), (1, 4)]
    edges = tuple(
        (
            a,
            b,
            tuple(tuple(int(c) for c in row) for row in rng.integers(0, 50, (sizes[a], sizes[b]))),
        )
        for a, b in pairs
    )
    node = tuple(tuple(int(c) for c in rng.integers(0, 50, n)) for n in sizes)
    problem = Problem(sizes, node, edges, NO_ROWS, 0, 1.0)
    assert eliminate(problem)[1] == []
    assert solve(problem).objective == brute_force(problem)


@pytest.mark.parametrize("mesh, coarsen", [("2", False), ("2", True), ("4", True)])
def test_real_graph_equals_exhaustive_search(tmp_path, mesh, coarsen):
    """The MLP of docs/design/propagation.md (dot, max, dot) priced on a real cluster, x and
    the weights held as the search likes (split further than read included): every
    combination of candidates enumerated, with no budget, at the least memory any plan needs,
    and between the two; the ILP's peak is the lowered program's."""
    graph = import_onnx(write_seed_mlp(tmp_path / "mlp.onnx"))
    cluster = make_cluster(mesh=mesh)
    search = build_search(graph, cluster, coarsen=coarsen)
    free = search.problem
    assert 1 < np.prod(free.sizes) < 5_000
    top, least = free.peak(solve(free).choice), lowest_budget(free).peak
    assert least < top
    for budget in (top, (top + least) // 2, least):
        problem = dataclasses.replace(free, budget=budget)
        solution = solve(problem)
        assert solution.objective == brute_force(problem)
        program = lower(graph, search.plan(graph, cluster, solution.choice))
        assert problem.peak(solution.choice) == memory(program).peak <= budget


def test_candidates_of_a_matmul_on_2x2():
    """MatMul [8, 16] x [16, 32]: each of 2 axes on none or one of 3 loops (16), plus the
    reversed order of both axes on one loop (3): 19."""
    graph = import_onnx(MODELS / "mlp.onnx", {"batch": 8})
    matmul = next(op for op in graph.ops if op.type in ("MatMul", "Gemm"))
    rule = rule_for(matmul, graph)
    sizes = [loop.size for loop in rule.loops]
    options = candidates(rule, Mesh((2, 2)))
    splittable = sum(1 for s in sizes if s % 2 == 0)
    both = sum(1 for s in sizes if s % 4 == 0)
    assert len(options) == (splittable + 1) ** 2 + both
    assert len(set(options)) == len(options)
    assert str(options[0]) == "[[]]"


def test_repeated_layers_of_the_32_layer_decoder():
    graph = import_onnx(MODELS / "decoder_32l_shape_only.onnx", {"batch": 2, "seq": 64})
    repeats = find_repeats(graph)
    assert (repeats.period, repeats.count) == (37, 32)
    assert repeats.start + repeats.ops <= len(graph.ops)


def _written(row):
    return MemoryRow(row["fixed"], tuple(map(tuple, row["terms"])),
                     tuple(map(tuple, row["indicated"])))  # fmt: skip


def test_the_most_a_row_holds_takes_one_choice_per_group():
    """5 fixed; group 0's choices 0 and 1 hold 3 and 7, group 1's choice 0 holds 2; two
    indicated terms, +4 and -6: at most 5 + 7 + 2 + 4 = 18. Keeping only group 0's choice 0
    and group 1's choice 1 (group 1's run empties): 5 + 3 + 0 + 4 = 12."""
    rows = MemoryRows.of((MemoryRow(5, ((0, 0, 3), (0, 1, 7), (1, 0, 2)), ((0, 4), (1, -6))),))
    assert rows.most().tolist() == [18]
    assert rows.restricted([[0, -1], [-1, 0]]).most().tolist() == [12]


def test_memory_rows_as_arrays_are_the_rows_of_tuples():
    """The MLP on 2x4 (storage decisions, reshard buffers as indicators, savings of a home
    tensor as negative ones): the rows built as arrays are, term for term, the rows saved
    (as `MemoryRow`s: first from the tuple builder, since as the slots per operand and the
    savings per size came), and summing them under any choice gives each row's bytes."""
    saved = json.loads((Path(__file__).parent / "memory_rows_mlp_2x4.json").read_text())
    graph = import_onnx(MODELS / "mlp.onnx", {"batch": 8})
    problem = build_search(graph, make_cluster(mesh="2x4")).problem
    rows = [_written(row) for row in saved["rows"]]
    assert [problem.memory[r] for r in range(len(problem.memory))] == rows
    assert problem.memory_base[0] == _written(saved["base"])
    assert len(problem.indicators) == 59 and sum(len(row.indicated) for row in rows) == 186
    assert sum(b < 0 for row in rows for _, b in row.indicated) == 12
    rng = np.random.default_rng(0)
    for _ in range(20):
        choice = [int(rng.integers(0, n)) for n in problem.sizes]
        held = problem.indicator_table.values(choice)
        by_hand = [
            row.fixed
            + sum(b for g, k, b in row.terms if choice[g] == k)
            + sum(b for i, b in row.indicated if held[i])
            for row in rows
        ]
        assert problem.memory.bytes(choice, held).tolist() == by_hand
        assert MemoryRows.of(rows).bytes(choice, held).tolist() == by_hand
    # A group takes one choice: at most its largest term, with every indicated term that adds.
    assert problem.memory.most().tolist() == [
        row.fixed
        + sum(max(0, *(b for h, _, b in row.terms if h == g)) for g in {g for g, _, _ in row.terms})
        + sum(max(b, 0) for _, b in row.indicated)
        for row in rows
    ]


def test_a_solve_out_of_time_names_the_users_limit_and_its_share(monkeypatch):
    """--time-limit is shared by the solves of a search: when the memory-bound solve, given
    a share of it, finds nothing, the error names the user's limit and that share (not the
    share alone, as if the user had asked for it). The memory-aside optimum, found by exact
    elimination, spends none of the limit; the memory-bound solve's CP-SAT gets all of it
    (the relaxation and the least peak turned off here: their plans would answer)."""
    monkeypatch.setattr(ilp, "dual", lambda problem, **_: None)
    monkeypatch.setattr(lowest, "any_fits", lambda *_: ([], 0.0))
    graph = import_onnx(MODELS / "decoder_32l_shape_only.onnx", {"batch": 8, "seq": 256})
    problem = build_search(graph, make_cluster(mesh="2x4", memory="6GiB")).problem
    share = r"\(0\.05 s left for the memory-bound solve, UNKNOWN\); raise --time-limit$"
    with pytest.raises(AutoshardError, match=r"within --time-limit 1 s " + share):
        solve(problem, 0.05, limit=1.0)
    with pytest.raises(AutoshardError, match=r"within --time-limit 0\.05 s \(UNKNOWN\)"):
        solve(problem, 0.05)


def test_a_threshold_keeps_at_most_its_share_of_the_choices():
    """Min-marginals 10, 20, 30, 40 and 15, 25, 35, 45: the highest threshold keeping a
    quarter (2 of 8) is 20 (10 and 15 are below it), half is 30, all is any (None)."""
    problem = Problem((4, 4), ((0,) * 4, (0,) * 4), (), NO_ROWS, 0, 1.0)
    marginals = [np.array([10.0, 20, 30, 40]), np.array([15.0, 25, 35, 45])]
    narrowing = Narrowing(problem, marginals, lambda *_: None, None, "the cost", 0.5)
    thresholds = [narrowing.keeping(share) for share in (1 / 4, 1 / 2, 1)]
    assert thresholds == [20, 30, None]
    kept = [still_possible(marginals, t) for t in (20, 30, 47)]
    assert kept == [[[0], [0]], [[0, 1], [0, 1]], [[0, 1, 2, 3], [0, 1, 2, 3]]]


def test_a_narrowed_solve_finds_its_optimum():
    """A problem `solve` handed CP-SAT (gpt2_dynamo on 4x8 at its lowest budget, narrowed to
    162 of its 612 choices, from the 24 memory rows that bind its relaxation): CP-SAT proves
    the optimum that CP-SAT without presolve finds with every row. With the bound `solve` had
    proven written into the model (the objective at least 2,949,322,513, as it was), OR-Tools
    9.15's presolve cut the optimum off (or-tools#5293). What this guards: anything written
    into `solve_cp_sat`'s model, or a CP-SAT release, that loses it."""
    saved = json.loads((Path(__file__).parent / "narrowed_gpt2_dynamo_4x8.json").read_text())
    graph = import_onnx(MODELS.parent / saved["model"], saved["dims"])
    cluster = make_cluster(mesh=saved["mesh"], memory=str(saved["budget"]))
    problem = build_search(graph, cluster).problem
    # The shared reshard groups (`search.reads`), appended since the problem was saved: whole.
    shared = problem.sizes[len(saved["kept"]) :]
    narrowed = problem.restricted(saved["kept"] + [list(range(n)) for n in shared])
    limit = outcome.Limit(60.0, 60.0, "memory-bound")
    hint = saved["hint"] + [0] * len(shared)
    found, _ = cp_sat.solve_cp_sat(narrowed, limit, True, hint, rows=np.array(saved["rows"]))
    model, _ = cp_sat.ilp_model(narrowed, memory=True)
    solver = cp_sat.deterministic_solver(60.0)
    solver.parameters.cp_model_presolve = False
    assert solver.solve(model) == cp_model.OPTIMAL
    assert found.status is outcome.SolverStatus.OPTIMAL
    assert found.objective == solver.objective_value
    assert narrowed.peak(found.choice) <= saved["budget"]


def test_a_plan_above_the_threshold_whose_value_keeps_most_choices_is_not_the_next():
    """Min-marginals 100..115 in each of two groups. No plan below 102 (4 choices); below
    104 (8) a plan of 110 and none below. Sending CP-SAT next to 110 would keep 20 of the 32
    choices, most of them; halfway to it, below 107, keeps 14 (the doubled share's
    threshold, below 108, 16), where the next try finds the optimum, 106: a try that keeps
    most choices costs nearly the whole solve."""
    sizes, bound, best = _narrowed_tries([None, 110, 106])
    assert sizes == [4, 8, 14]
    assert (best.value, bound) == (106, 106)


def test_halfway_is_not_past_the_shares_next_threshold():
    """The first try (below 102: 4 choices) finds a plan of 110 and none below. Halfway to
    it, below 106, would keep 12 choices; the doubled share's threshold, below 104, keeps 8:
    that try is next, and finds the optimum, 105, which the best's value's try (10 choices)
    proves. A try of fewer choices may find a plan near the optimum where the best is far
    from it."""
    sizes, bound, best = _narrowed_tries([110, 105, 105])
    assert sizes == [4, 8, 10]
    assert (best.value, bound) == (105, 105)


def test_halfway_once_then_the_best_plans_value_narrowed():
    """As above, but the try halfway finds a plan of 108 and none below 107. Next, the best's
    value, though it keeps half the choices (16 of 32): halfway again would be one more solve;
    and narrowed, not the whole problem, as it keeps less than `WHOLE_SHARE`: most of the
    choices are proven faster than all of them."""
    sizes, bound, best = _narrowed_tries([None, 110, 108, 108])
    assert sizes == [4, 8, 14, 16]
    assert (best.value, bound) == (108, 108)


def test_a_halfway_that_keeps_too_many_to_narrow_leaves_the_thresholds_to_the_shares():
    """Flat min-marginals (22 of the 32 at 103): the first try (below 102, 4 choices) finds a
    plan of 125. Halfway to it, below 113, keeps 28 choices, too many to narrow
    (`WHOLE_SHARE`): not the next threshold, which the doubling share sets instead (below
    103: 6 choices; a plan of 124 there), then below 104, the whole problem: tries of fewer
    choices come before the whole problem, which may not be proven in its time."""
    marginals = np.array([100, 101, 102, *[103] * 11, 120, 130], dtype=np.float64)
    sizes, bound, best = _narrowed_tries([125, 124, 124], [marginals, marginals])
    assert sizes == [4, 6, 32]
    assert (best.value, bound) == (124, 124)


def test_no_plan_yet_narrows_up_to_the_whole_share():
    """No plan below 102 (4 choices), nor below 104 (8); below 108 keeps half the choices,
    narrowed still (`WHOLE_SHARE`), where a plan of 110 is found; then halfway to it, below
    109 (18 choices), though the doubled share's threshold is past it; then below 110, 20
    choices, where it is proven: a narrowed try may find and prove a plan where the whole
    problem, sent at once, runs out of time."""
    sizes, bound, best = _narrowed_tries([None, None, 110, 110, 110])
    assert sizes == [4, 8, 16, 18, 20]
    assert (best.value, bound) == (110, 110)


def test_a_try_proves_as_far_as_the_least_choice_it_left_out():
    """Min-marginals 100, 101, then 110 to 123 in each of two groups. The first try (below
    102: 4 choices) finds no plan; no plan below 110 takes another choice, so none is below
    110, and the next try is below the doubled share's threshold, 112 (8 choices); so on.
    Thresholds set by the doubling distance alone, 104 and 108, would keep the same 4
    choices: the same try twice more, for the same answer."""
    marginals = np.array([100, 101, *range(110, 124)], dtype=np.float64)
    sizes, bound, best = _narrowed_tries([None, None, 118, 118, 118], [marginals, marginals])
    assert sizes == [4, 8, 16, 18, 20]
    assert (best.value, bound) == (118, 118)


def test_what_a_try_proves_beyond_its_threshold_at_large_values():
    """Min-marginals of 1e10 and over (a large model's costs): the relaxation's rounding,
    relative, is 10 there. A try over the two choices below 1e10 + 100 proves no plan below
    the highest threshold that keeps only those two, 1e10 + 90, so the thresholds within the
    rounding of the least choice left out are not tried again."""
    problem = Problem((4,), ((0,) * 4,), (), NO_ROWS, 0, 1.0)
    marginals = [np.array([1e10, 1e10 + 1, 1e10 + 100, 1e10 + 200])]
    narrowing = Narrowing(problem, marginals, lambda *_: None, None, "the cost", 0.8)
    proven = narrowing.beyond([[0, 1]])
    assert proven == 10**10 + 90
    assert still_possible(marginals, 10**10 + 90) == [[0, 1]]
    assert still_possible(marginals, 10**10 + 91) == [[0, 1, 2]]


def test_the_tries_that_prove_a_plan_hold_fewer_choices():
    """As `test_a_plan_above_the_threshold_whose_value_keeps_most_choices_is_not_the_next`:
    no plan below 102 (4 choices), one of 110 below 104 (8), and the next try (halfway,
    below 107, 14 choices) finds the optimum, 106. The first two, at thresholds the shares
    set, hold all their choices; the third, halfway to the best's value, those `tighten`
    leaves it (here all but the highest of the first group's, 13), asked with its threshold
    and the best plan."""
    asked = []

    def tighten(possible, threshold, keep):
        asked.append((sum(map(len, possible)), threshold, keep))
        return [possible[0][:-1], possible[1]]

    sizes, bound, best = _narrowed_tries([None, 110, 106], tighten=tighten)
    assert sizes == [4, 8, 13]
    assert asked == [(14, 107, (0, 0))]
    assert (best.value, bound) == (106, 106)


def _narrowed_tries(
    answers: list[int | None], marginals: list[np.ndarray] | None = None, tighten=None
) -> tuple[list[int], int, outcome.Found]:
    """The cost's narrowing over two groups of 16 choices (min-marginals 100..115 unless
    given), each try answering the next of `answers` as its optimum: the choices each try
    kept, the bound and the best. `tighten`: the narrowing's."""
    marginals = marginals or [np.arange(100.0, 116), np.arange(100.0, 116)]
    problem = Problem((16, 16), ((0,) * 16, (0,) * 16), (), NO_ROWS, 0, 1.0)
    found = iter(answers)
    sizes = []

    def attempt(narrowed, hint, at_least, limit):
        sizes.append(narrowed.variables)
        value = next(found)
        if value is None:  # no plan fits
            return outcome.Attempt((), None, 0, True, 0.1)
        return outcome.Attempt((0, 0), value, value, True, 0.1)

    narrowing = Narrowing(
        problem, marginals, attempt, None, "the cost", tuning.WHOLE_SHARE, True, tighten
    )
    best, bound, _ = narrowing.run(None, 100, outcome.Limit(60.0, 60.0, "memory-bound"), (0, 0))
    assert best is not None
    return sizes, bound, best
