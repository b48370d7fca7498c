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

import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoshard.annotations import Annotation
from autoshard.cost.cluster import Cluster
from autoshard.cost.model import Cost, memory, price
from autoshard.errors import AutoshardError
from autoshard.ir.graph import Graph
from autoshard.passes.ccl import optimize_collectives
from autoshard.passes.materialize import materialize
from autoshard.plan import Plan, ShardingOption, describe
from autoshard.program import Program
from autoshard.rules import rule_for
from autoshard.search.ilp import InfeasibleError, Solution, lowest_budget, solve
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
    try:
        solution = solve(problem, time_limit)
    except InfeasibleError:
        peak, choice = lowest_budget(problem, time_limit)
        program = lower(graph, search.plan(graph, cluster, choice))
        live = memory(program).live[:5]
        biggest = ", ".join(f"{name} ({size} B)" for name, size in live)
        raise InfeasibleError(
            f"no plan fits {cluster.memory} bytes per device; the lowest feasible budget is "
            f"about {peak} bytes (--memory {-(-peak // 2**20)}MiB); largest tensors live at "
            f"its peak: {biggest}"
        ) from None
    say(f"solved: {solution.status}, gap {solution.gap:.2%} ({solution.wall_s:.1f} s)")
    plan = search.plan(graph, cluster, solution.choice)
    program = lower(graph, plan)
    return Planned(plan, program, price(program, graph, cluster), solution, search, built)


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
            "repeated_layers": {"first_op": repeats.start, "ops_per_layer": repeats.period,
                                "layers": repeats.count},  # fmt: skip
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


def load_plan(path: str | Path, graph: Graph, cluster: Cluster) -> Plan:
    """A plan from a plan JSON file (`autoshard plan -o`), checked against the graph."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise AutoshardError(f"cannot read plan {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise AutoshardError(f"plan {path} is not JSON: {error}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise AutoshardError(f"{path} is not an autoshard plan (schema {SCHEMA})")
    if data.get("mesh") != str(cluster.mesh):
        raise AutoshardError(f"plan {path} is for mesh {data.get('mesh')}, not {cluster.mesh}")
    ops = data.get("ops", {})
    options: dict[str, ShardingOption | None] = {}
    for op in graph.ops:
        entry = ops.get(op.name)
        if entry is None:
            raise AutoshardError(f"plan {path} has no op {op.name!r}: is it for this model?")
        rule = rule_for(op, graph)
        text = entry.get("sharding_option")
        options[op.name] = (
            ShardingOption.parse(text, len(rule.loops)) if rule and text is not None else None
        )
    held = {
        name: Sharding.parse(v["sharding"] + (f" partial = {v['partial']}" if v["partial"] else ""))
        for name, v in data.get("values", {}).items()
        if name in graph.values and graph.producer(name) is None
    }
    return plan_from_options(graph, cluster, options, held)
