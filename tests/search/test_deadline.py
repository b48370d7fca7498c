"""`--time-limit` as a wall-clock deadline shared by every phase of `autoshard plan`.

No test here reads the machine's clock to decide what it asserts: each deadline runs on a
clock the test moves (`Clock`), made to pass at a point of the test's choosing (after so many
looks at it, or as a given step of the search begins), so that a loaded machine changes no
answer. Where it passes, the answer is the documented one: the best plan so far, FEASIBLE
with the bound proven so far (checked against brute force), or one line naming the phase.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import pickle
import re
from pathlib import Path

import pytest

from autoshard.cli.main import main
from autoshard.cost.cluster import make_cluster
from autoshard.deadline import NEVER, Deadline, TimeUp
from autoshard.ir.onnx_import import import_onnx
from autoshard.pipeline import PlanRequest, plan_request
from autoshard.progress import Progress, Tracker
from autoshard.search import budget
from autoshard.search.budget import auto_plan
from autoshard.search.problem import build_search
from autoshard.search.solver import cp_sat, lowest
from autoshard.search.solver import solve as ilp
from autoshard.search.solver.outcome import InfeasibleError, OutOfTime, SolverStatus
from autoshard.search.solver.solve import solve
from autoshard.sharding import Sharding
from tests.search.test_ilp import brute_force, random_problem

MODELS = Path(__file__).resolve().parents[2] / "models"


class Clock:
    """A clock the test moves: `step` seconds per reading (0: it stands), or past any deadline
    once `expire` is called."""

    def __init__(self, step: float = 0.0) -> None:
        self.now, self.step, self.readings = 0.0, step, 0

    def __call__(self) -> float:
        now = self.now
        self.now += self.step
        self.readings += 1
        return now

    def expire(self) -> None:
        self.now = math.inf


def expiring(module: object, name: str, clock: Clock, after: bool = False) -> None:
    """Wrap `module.name` (a real step of the search) so that the clock expires as it begins
    (or, `after`, as it returns)."""
    real = getattr(module, name)

    @functools.wraps(real)
    def step(*args, **kwargs):
        if not after:
            clock.expire()
        result = real(*args, **kwargs)
        if after:
            clock.expire()
        return result

    return step


def test_a_deadline_passes_after_its_seconds_of_its_clock():
    clock = Clock(step=1.0)
    deadline = Deadline.start(2.5, clock)
    assert [deadline.left() for _ in range(4)] == [1.5, 0.5, 0.0, 0.0]
    assert NEVER.left() == math.inf and not NEVER.passed()
    with pytest.raises(TimeUp) as error:
        deadline.check("building the problem", "3 of 7 ops priced")
    assert str(error.value) == (
        "the time limit (2.5 s of wall clock) ran out while building the problem (3 of 7 ops "
        "priced); raise --time-limit"
    )


def _progress(error: TimeUp) -> tuple[str, int, int]:
    """(what, done, of) of a `building the problem` message."""
    found = re.search(
        r"while building the problem \((?:(memory): )?(\d+) of (\d+) (\w+)", str(error)
    )
    assert found is not None, str(error)
    what = found.group(1) or found.group(4)
    return what, int(found.group(2)), int(found.group(3))


def test_building_the_problem_stops_where_the_deadline_passes_and_says_how_far_it_got():
    """The builder looks at the deadline once per op priced, per read priced and per value
    of the memory rows, in that order: a deadline passing at its k-th look stops it there,
    and the message counts what was done; one look more and the problem is built, equal to
    the one built without a deadline."""
    graph = import_onnx(MODELS / "mlp.onnx", {"batch": 8})
    cluster = make_cluster(mesh="2x2", memory="100KB")
    counting = Clock(step=1.0)
    whole = build_search(graph, cluster, deadline=Deadline.start(1e9, counting))
    looks = counting.readings - 1  # (the first reading starts the deadline)
    ops, values = len(graph.ops), len(graph.values)
    reads = looks - ops - values
    assert reads > 0
    expected = {
        1: ("ops", 0, ops), ops: ("ops", ops - 1, ops), ops + 1: ("reads", 0, reads),
        ops + reads + 1: ("memory", 0, values), looks: ("memory", values - 1, values),
    }  # fmt: skip
    for k, progress in expected.items():
        with pytest.raises(TimeUp) as error:
            build_search(graph, cluster, deadline=Deadline.start(k - 0.5, Clock(step=1.0)))
        assert _progress(error.value) == progress, k
    built = build_search(graph, cluster, deadline=Deadline.start(looks + 0.5, Clock(step=1.0)))
    alike = {pickle.dumps(s.problem) for s in (built, whole, build_search(graph, cluster))}
    assert len(alike) == 1


def _expired() -> Deadline:
    clock = Clock()
    deadline = Deadline.start(1.0, clock)
    clock.expire()
    return deadline


@pytest.mark.parametrize("seed", range(8))
def test_out_of_time_before_any_step_the_replicated_plan_or_the_hint_answers(seed):
    """The deadline passed before the memory-aside solve: every group's first choice (the
    replicated plan) answers where it fits, or the hint where it fits and costs less; FEASIBLE,
    its bound what was proven before (here: nothing, 0)."""
    problem = random_problem(seed)  # no memory rows: every plan fits
    zeros = (0,) * len(problem.sizes)
    solved = solve(problem, deadline=_expired())
    assert (solved.choice, solved.objective, solved.bound) == (zeros, problem.objective(zeros), 0)
    assert solved.status == ("OPTIMAL" if solved.objective == 0 else "FEASIBLE")
    plans = list(itertools.product(*map(range, problem.sizes)))
    hint = min(plans, key=problem.objective)
    hinted = solve(problem, hint=hint, deadline=_expired())
    assert hinted.objective == min(problem.objective(hint), problem.objective(zeros))


def test_out_of_time_with_no_plan_that_fits_names_the_phase():
    """Where neither the replicated plan nor a hint fits the budget, no plan: the message
    names the phase the time ran out in."""
    seeds = (s for s in range(100) if _replicated_does_not_fit(s))
    problem = random_problem(next(seeds), memory=True)
    with pytest.raises(OutOfTime, match=(
        r"^the time limit \(1 s of wall clock\) ran out in the memory-aside solve, before any "
        r"plan that fits was found; raise --time-limit$"
    )):  # fmt: skip
        solve(problem, deadline=_expired())


def _replicated_does_not_fit(seed: int) -> bool:
    problem = random_problem(seed, memory=True)
    return problem.peak((0,) * len(problem.sizes)) > problem.budget


# (module, step, whether the clock expires as it returns rather than as it begins)
PHASES = {
    "after-the-memory-aside-solve": (ilp, "memory_aside", True),
    "in-the-relaxation": (ilp, "dual", False),
    "before-the-least-peak": (lowest, "any_fits", False),
    "in-cp-sat": (cp_sat, "solve_cp_sat", False),
}


@pytest.mark.parametrize("phase", PHASES)
def test_out_of_time_in_a_phase_of_the_search_answers_with_the_best_plan_so_far(phase, monkeypatch):
    """Random problems with memory rows, the deadline passing as a step of the search begins
    (or ends): each answer is a plan that fits, its objective at least the optimum and its
    bound at most it (brute force), OPTIMAL only where they meet; or no plan, only where
    neither the search so far nor the replicated plan had one, the message naming the phase
    (where no plan fits, the time may run out before that is proven); or InfeasibleError,
    only where no plan fits."""
    module, name, after = PHASES[phase]
    answers = []
    for seed in range(40):
        problem = random_problem(seed, memory=True)
        clock = Clock()
        monkeypatch.setattr(module, name, expiring(module, name, clock, after))
        optimum = brute_force(problem)
        try:
            solved = solve(problem, deadline=Deadline.start(1.0, clock))
        except OutOfTime as error:
            assert _replicated_does_not_fit(seed)  # (and the search had none)
            said = str(error)
            assert said.startswith("the time limit (1 s of wall clock) ran out in the "), said
            answers.append("no plan")
            continue
        except InfeasibleError:
            assert optimum is None
            answers.append("infeasible")
            continue
        finally:
            monkeypatch.undo()
        assert problem.peak(solved.choice) <= problem.budget
        assert solved.bound <= optimum <= solved.objective == problem.objective(solved.choice)
        assert (solved.status is SolverStatus.OPTIMAL) == (solved.bound == solved.objective)
        answers.append(str(solved.status))
    assert "FEASIBLE" in answers or phase == "before-the-least-peak", answers


@pytest.mark.parametrize("seed", range(20))
def test_a_generous_deadline_changes_nothing(seed):
    """A deadline that does not pass leaves every solve as it is without one."""
    problem = random_problem(seed, memory=True)
    answers = []
    for deadline in (NEVER, Deadline.start(1e6)):
        try:
            answers.append(dataclasses.replace(solve(problem, deadline=deadline), wall_s=0.0))
        except InfeasibleError as error:
            answers.append(str(error))
    assert answers[0] == answers[1]


def test_cp_sat_is_given_the_seconds_left_beside_its_deterministic_limit():
    solver = cp_sat.deterministic_solver(5.0, 2.5)
    assert (solver.parameters.max_deterministic_time, solver.parameters.max_time_in_seconds) == (
        5.0, 2.5,
    )  # fmt: skip
    assert cp_sat.deterministic_solver(5.0).parameters.max_time_in_seconds == math.inf


MLP_100KB = PlanRequest(
    model_path=MODELS / "mlp.onnx", cluster=make_cluster(mesh="2x2", memory="100KB"),
    dims={"batch": 8},
)  # fmt: skip


def _without_timing(document: dict) -> dict:
    return {k: v for k, v in document.items() if k != "timing"}


def test_a_generous_limit_gives_the_plan_no_limit_gives():
    """The memory-bound MLP (the relaxation and CP-SAT's tries run): the plan document under
    the request's own limit, started now, is the one under no deadline at all."""
    limited = plan_request(MLP_100KB).document.to_json()
    unlimited = plan_request(MLP_100KB, deadline=NEVER).document.to_json()
    assert json.dumps(_without_timing(limited)) == json.dumps(_without_timing(unlimited))


def test_out_of_time_while_importing_says_so():
    with pytest.raises(
        TimeUp, match=r"^the time limit \(1 s of wall clock\) ran out while importing the model; "
    ):
        plan_request(MLP_100KB, deadline=_expired())


def test_out_of_time_as_the_search_starts_plans_the_replicated_model(monkeypatch):
    """No budget binds the MLP on 4x8: the deadline passing as the search's solve begins
    leaves the replicated plan (every group's first choice), FEASIBLE, lowered and priced;
    the progress says so."""
    clock = Clock()
    monkeypatch.setattr(budget, "solve", expiring(budget, "solve", clock))
    graph = import_onnx(MODELS / "mlp.onnx", {"batch": 8})
    cluster = make_cluster(mesh="4x8")
    shown: list[Progress] = []
    planned = auto_plan(graph, cluster, tracker=Tracker(shown.append),
                        deadline=Deadline.start(1.0, clock))  # fmt: skip
    said = "out of time before a plan of its own: the replicated plan, which fits"
    assert said in [progress.detail for progress in shown]
    assert planned.solution.status is SolverStatus.FEASIBLE
    assert set(planned.solution.choice) == {0} and planned.solution.gap == 1.0
    assert set(planned.plan.values.values()) == {Sharding()}
    assert planned.cost.compute_time_s > 0 and planned.cost.comm_bytes_per_device == 0


def test_the_cli_with_a_tiny_limit_answers_at_once_with_one_line(capsys):
    """`--time-limit 0.01` on the 32-layer decoder: the time runs out before a plan, and the
    answer is one line naming the phase (no traceback), or, on a machine fast enough, a
    FEASIBLE plan."""
    code = main([
        "plan", str(MODELS / "decoder_32l_shape_only.onnx"), "--mesh", "4x8", "--dim",
        "batch=8", "--dim", "seq=2048", "--time-limit", "0.01", "-q",
    ])  # fmt: skip
    out, err = capsys.readouterr()
    if code == 0:
        assert "solver FEASIBLE" in out
        return
    assert code == 2 and "Traceback" not in err
    assert re.fullmatch(
        r"autoshard: error: the time limit \(0\.01 s of wall clock\) ran out (while|in the) "
        r"[^\n]*; raise --time-limit\n",
        err,
    ), err
