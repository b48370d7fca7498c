"""The order of the stages, in one place: import -> (propagate | search) -> materialize -> CCL
passes -> partition. The faces (CLI, service) call these; each stage stays a pure function.

The plan document (`autoshard plan --json`, plan.json, the REST API's `plan`) is assembled
here too, from the stages' values, with a versioned schema:

    {"schema": "autoshard.plan/1", "model": {...}, "mesh": "4x8", "cluster": {...},
     "values": {name: {"sharding", "partial"}}, "ops": {name: {"type", "sharding_option"}},
     "unruled": [...], "collectives": [...], "cost": {...}, "solver": {...} | null,
     "search": {...} | null}
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoshard.annotations import Annotation, check_annotations
from autoshard.cost.cluster import Cluster, make_cluster
from autoshard.cost.model import Cost, Memory, memory, price
from autoshard.errors import AutoshardError
from autoshard.ir.graph import Graph
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.passes.ccl import optimize_collectives
from autoshard.passes.materialize import materialize
from autoshard.plan import Plan, ShardingOption, describe
from autoshard.program import Program
from autoshard.rules import rule_for
from autoshard.search.ilp import InfeasibleError, Solution, lowest_budget, solve, time_left
from autoshard.search.problem import Search, build_search, plan_from_options
from autoshard.sharding import Sharding

SCHEMA = "autoshard.plan/1"


def lower(graph: Graph, plan: Plan) -> Program:
    """The sharded program of a plan: reshards inserted and lowered to collectives, then the
    CCL passes."""
    return optimize_collectives(materialize(graph, plan), graph)


@dataclass(frozen=True)
class Planned:
    """A plan found by search, with its program, its cost and how the solver did."""

    plan: Plan
    program: Program
    cost: Cost
    solution: Solution
    search: Search
    build_s: float


def auto_plan(
    graph: Graph,
    cluster: Cluster,
    annotations: Sequence[Annotation] = (),
    objective: str = "time",
    time_limit: float = 60.0,
    progress: Callable[[str], None] | None = None,
) -> Planned:
    """Search the cheapest plan (CP-SAT), then lower and price it."""
    started = time.perf_counter()
    say = progress or (lambda _: None)
    search = build_search(graph, cluster, annotations, objective)
    built = time.perf_counter() - started
    problem = search.problem
    say(
        f"search problem: {len(problem.sizes)} groups, {problem.variables} choices, "
        f"{len(problem.edges)} edges, {len(problem.memory)} memory rows ({built:.1f} s)"
    )
    # The ILP counts each value once; the program also holds reshard buffers (the result of
    # an all_reduce next to its partial input). When those push the program over the budget,
    # the ILP's budget is lowered by the excess and it solves again. The first solve stays the
    # bound: the ILP undercounts memory, so every plan that really fits is feasible for it.
    budget, bound, spent = cluster.memory, None, 0.0
    hint: tuple[int, ...] = ()
    for _ in range(_BUDGET_ROUNDS):
        try:
            left = time_left(time_limit, spent)
            solution = solve(dataclasses.replace(problem, budget=budget), left, hint)
        except InfeasibleError:
            break
        spent += solution.work
        bound = bound if bound is not None else solution.bound
        plan = search.plan(graph, cluster, solution.choice)
        program = lower(graph, plan)
        peak = memory(program).peak
        if peak <= cluster.memory:
            if solution.objective > bound:  # proven for the lowered budget only
                solution = dataclasses.replace(solution, status="FEASIBLE", bound=bound)
            say(f"solved: {solution.status}, gap {solution.gap:.2%} ({solution.wall_s:.1f} s)")
            return Planned(plan, program, price(program, graph, cluster), solution, search, built)
        # Below what this plan's values take, by what its buffers add: the next plan differs.
        budget = min(budget, problem.peak(solution.choice)) - (peak - cluster.memory)
        hint = solution.choice
        say(f"the program needs {peak} bytes with its reshard buffers; solving again")
    # The rounds found nothing that fits: the plans of least memory decide.
    usage, choice = _least_memory(graph, cluster, search, time_limit)
    if usage.peak > cluster.memory:
        biggest = ", ".join(f"{name} ({size} B)" for name, size in usage.live[:5])
        raise InfeasibleError(
            f"no plan fits {cluster.memory} bytes per device; the lowest feasible budget is "
            f"{usage.peak} bytes (--memory {usage.peak}); the largest tensors live at its "
            f"peak: {biggest}"
        )
    plan = search.plan(graph, cluster, choice)
    program = lower(graph, plan)
    solution = Solution(choice, "FEASIBLE", problem.objective(choice), bound or 0.0, 0.0, 0, 0)
    say(f"solved: {solution.status}, gap {solution.gap:.2%} (the plan of least memory)")
    return Planned(plan, program, price(program, graph, cluster), solution, search, built)


_BUDGET_ROUNDS = 5
_BUDGET_PROBES = 6


def _least_memory(
    graph: Graph, cluster: Cluster, search: Search, time_limit: float
) -> tuple[Memory, tuple[int, ...]]:
    """When the budget rounds fail: the ILP's own least-memory plan and the plans it finds
    under a few budgets between that plan's ILP peak and its real peak (reshard buffers
    included). Of those that fit the budget, the cheapest; if none fits, the least memory."""
    problem = search.problem
    lowest, choice = lowest_budget(problem, time_limit)
    found = [(memory(lower(graph, search.plan(graph, cluster, choice))), choice)]
    top, spent = found[0][0].peak, 0.0
    for step in range(1, _BUDGET_PROBES + 1):
        budget = lowest + (top - lowest) * step // (_BUDGET_PROBES + 1)
        try:
            left = time_left(time_limit, spent)
            solution = solve(dataclasses.replace(problem, budget=budget), left, choice)
        except InfeasibleError:
            continue
        spent += solution.work
        choice = solution.choice
        found.append((memory(lower(graph, search.plan(graph, cluster, choice))), choice))
    fitting = [f for f in found if f[0].peak <= cluster.memory]
    if fitting:
        return min(fitting, key=lambda f: (problem.objective(f[1]), f[1]))
    return min(found, key=lambda f: (f[0].peak, f[1]))


def plan_document(
    graph: Graph,
    cluster: Cluster,
    plan: Plan,
    program: Program,
    cost: Cost,
    model: Mapping[str, object],
    planned: Planned | None = None,
) -> dict[str, Any]:
    """The plan JSON; `planned` adds the solver's and the search problem's figures."""
    solver = search = None
    if planned is not None:
        s, problem = planned.solution, planned.search.problem
        solver = {
            "status": s.status,
            "objective": s.objective * problem.unit,
            "bound": s.bound * problem.unit,
            "gap": s.gap,
            "wall_s": round(s.wall_s, 3),
            "variables": s.variables,
            "constraints": s.constraints,
        }
        repeats = planned.search.repeats
        search = {
            "groups": len(problem.sizes),
            "choices": problem.variables,
            "edges": len(problem.edges),
            "memory_rows": len(problem.memory),
            "repeated_layers": {
                "first_op": repeats.start,
                "ops_per_layer": repeats.period,
                "layers": repeats.count,
            },  # fmt: skip
            "build_s": round(planned.build_s, 3),
        }
    return {
        "schema": SCHEMA,
        "model": dict(model),
        "mesh": str(cluster.mesh),
        "cluster": cluster.to_json(),
        **describe(plan, graph),
        "collectives": program.collectives_json(),
        "cost": cost.to_json(),
        "solver": solver,
        "search": search,
    }


def model_info(path: str | Path, graph: Graph, dims: Mapping[str, int]) -> dict[str, object]:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"name": graph.name or Path(path).stem, "file": Path(path).name,
            "sha256": digest.hexdigest(), "dims": dict(sorted(dims.items()))}  # fmt: skip


@dataclass(frozen=True)
class RequestedPlan:
    """The answer to a plan request: the plan document, the search's result, and the graph
    and cluster it was found for (to partition or print the program, to summarize)."""

    document: dict[str, Any]
    planned: Planned
    graph: Graph
    cluster: Cluster


@dataclass(frozen=True)
class PlanRequest:
    """What `autoshard plan` is asked, flag by flag: built by the CLI from its flags and by
    the REST service from its form (`service.options.PlanOptions.request`)."""

    model_path: str | Path
    mesh: str | None
    dims: Mapping[str, int]
    device: str | None = None
    bandwidth: str | Sequence[str] | None = None
    latency: str | Sequence[str] | None = None
    memory: str | None = None
    cluster_file: str | Path | None = None
    annotations: Sequence[Annotation] = ()
    objective: str = "time"
    time_limit: float = 60.0


def plan_inputs(request: PlanRequest) -> tuple[Graph, Cluster]:
    """The checked inputs of a plan request: the cluster, the imported model, and annotations
    that name values of the model and fit it. Every bad input raises its one-line
    AutoshardError here, before any search: the service calls this to answer 4xx at once."""
    cluster = make_cluster(
        request.mesh, request.device, request.bandwidth, request.latency, request.memory,
        request.cluster_file,
    )  # fmt: skip
    graph = import_onnx(request.model_path, request.dims)
    shapes = {name: value.shape for name, value in graph.values.items()}
    check_annotations(request.annotations, shapes, cluster.mesh)
    return graph, cluster


def plan_request(
    request: PlanRequest, progress: Callable[[str], None] | None = None
) -> RequestedPlan:
    """`autoshard plan` from start to end, shared by the CLI and the REST service so that the
    service's plan is, by construction, what `autoshard plan --json` prints (timings aside)."""
    graph, cluster = plan_inputs(request)
    planned = auto_plan(
        graph, cluster, request.annotations, request.objective, request.time_limit, progress
    )
    document = plan_document(
        graph, cluster, planned.plan, planned.program, planned.cost,
        model_info(request.model_path, graph, request.dims), planned,
    )  # fmt: skip
    return RequestedPlan(document, planned, graph, cluster)


def load_plan(path: str | Path, graph: Graph, mesh: Mesh) -> Plan:
    """A plan from a plan JSON file (`autoshard plan -o`), checked against the graph."""
    return plan_from_document(read_plan_document(path, mesh), graph, mesh, str(path))


def read_plan_document(path: str | Path, mesh: Mesh) -> dict[str, Any]:
    """What decides a plan in a plan JSON file: its `ops` and `values`."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise AutoshardError(f"cannot read plan {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise AutoshardError(f"plan {path} is not JSON: {error}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise AutoshardError(f"{path} is not an autoshard plan (schema {SCHEMA})")
    if data.get("mesh") != str(mesh):
        raise AutoshardError(f"plan {path} is for mesh {data.get('mesh')}, not {mesh}")
    return {"ops": data.get("ops", {}), "values": data.get("values", {})}


def plan_from_document(
    data: Mapping[str, Any], graph: Graph, mesh: Mesh, source: str = "plan"
) -> Plan:
    """The plan of a plan document's `ops` (sharding options) and `values` (how inputs and
    weights are held): the rest follows from the rules."""
    ops, values = data.get("ops", {}), data.get("values", {})
    options: dict[str, ShardingOption | None] = {}
    try:
        for op in graph.ops:
            entry = ops.get(op.name)
            if entry is None:
                raise AutoshardError(f"{source} has no op {op.name!r}: is it for this model?")
            rule = rule_for(op, graph)
            text = entry.get("sharding_option")
            options[op.name] = (
                ShardingOption.parse(text, len(rule.loops)) if rule and text is not None else None
            )
        held = {
            name: Sharding.parse(
                v["sharding"] + (f" partial = {v['partial']}" if v.get("partial") else "")
            ).check(mesh, graph.values[name].shape)
            for name, v in values.items()
            if name in graph.values and graph.producer(name) is None
        }
    except (AttributeError, KeyError, TypeError) as error:
        raise AutoshardError(f"{source} is malformed: {error!r}") from None
    return plan_from_options(graph, mesh, options, held)
