"""One point of a sweep planned as `autoshard plan` plans it (the pipeline's `plan_request`,
from the same flag text through the same parsers), and its plan as a row of the table.

`plan_points` runs in a worker (a process of the local pool, or a Ray worker): it never
raises, so a point that fails records its error and the sweep goes on. A worker keeps the
graphs it imported (`GraphCache`) for the next point of the same model, dims and step, and
its searches (`search.shared`) for the next point that differs in its budget alone: a worker
is given such points together (`budget_groups`), the largest budget first, so that budgets
that do not bind, and those below a floor proven, are answered without a search.
"""

from __future__ import annotations

import hashlib
import json
import time
import traceback
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from autoshard.cost.cluster import make_cluster
from autoshard.cost.replay import recompute_ladder
from autoshard.errors import AutoshardError
from autoshard.pipeline import GraphCache, PlanRequest, RequestedPlan, plan_request
from autoshard.search.microbatch import GlobalBatch
from autoshard.search.options import Objective
from autoshard.search.pipelined import PIPELINE_AXIS, pipeline_ask
from autoshard.search.shared import SearchCache
from autoshard.search.solver.outcome import InfeasibleError
from autoshard.sweep.grid import Point
from autoshard.training import Training
from autoshard.training.options import requested


@dataclass(frozen=True, kw_only=True)
class Task:
    """What a worker is sent: the point, its key, and what every point is asked alike."""

    key: str
    point: Point
    model: str
    objective: str
    time_limit: float
    pipeline_axis: str | None = None
    schedule: str | None = None
    global_batch: str | None = None


class _Last(OrderedDict[Any, Any]):
    """The last `keep` entries set in this process (a sweep's points come grouped by import,
    and a point's budgets together)."""

    def __init__(self, keep: int) -> None:
        super().__init__()
        self.keep = keep

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        while len(self) > self.keep:
            self.popitem(last=False)


RUNGS = len(recompute_ladder(Training()))
"""The most training steps `--recompute auto` builds of one model and dims (its ladder, with
selective recomputation): a point whose budget binds builds each of them, so the caches
below keep every rung, or the next budget of the point would import the model and build
its problems again (each rung's graph a new one, which no kept search is for)."""
# Two ladders each: a worker's groups change dims, a global batch's counts each have one.
_GRAPHS: GraphCache = _Last(2 * RUNGS)
_SEARCHES: SearchCache = _Last(2 * RUNGS)


def budget_groups(tasks: Sequence[Task]) -> list[list[Task]]:
    """The tasks in groups of points that differ in their memory budget alone, each group in
    the order of the first task's place, its budgets largest first (a budget's bytes as the
    cluster makes them: the device's, less its reserve, where none is given). A point whose
    cluster cannot be made is a group of its own (its row says why)."""
    groups: dict[object, list[tuple[int, Task]]] = {}
    for task in tasks:
        try:
            budget = make_cluster(task.point.mesh, task.point.device, None, None,
                                  task.point.memory, task.point.cluster).memory  # fmt: skip
            key: object = replace(task, key="", point=replace(task.point, memory=None))
        except AutoshardError:
            budget, key = 0, task.key
        groups.setdefault(key, []).append((budget, task))
    return [[task for _, task in sorted(group, key=lambda bt: -bt[0])]
            for group in groups.values()]  # fmt: skip


def plan_points(tasks: Sequence[Task]) -> list[dict[str, Any]]:
    """The rows of `tasks`, planned in order in this worker (`budget_groups`' group)."""
    return [plan_point(task) for task in tasks]


def plan_request_of(task: Task) -> PlanRequest:
    """The request `autoshard plan` makes of the point's flags."""
    point = task.point
    training = requested(
        point.mode, dict(point.training), lambda name: "--" + name.replace("_", "-"),
        "--mode training",
    )  # fmt: skip
    cluster = make_cluster(point.mesh, point.device, None, None, point.memory, point.cluster)
    dims, batch = dict(point.dims), None
    pipelined = task.pipeline_axis is not None or PIPELINE_AXIS in cluster.mesh.axis_names
    schedule = task.schedule if pipelined else None  # (`--pipeline auto`: the pp meshes')
    if task.global_batch is not None:  # the dim's size is the global batch (checked: given)
        given = dict(point.training).get("micro_batches")
        batch = GlobalBatch(task.global_batch, dims.pop(task.global_batch),
                            int(given) if given else None)  # fmt: skip
    return PlanRequest(
        model_path=task.model, cluster=cluster, dims=dims, global_batch=batch,
        objective=Objective(task.objective), time_limit=task.time_limit, training=training,
        pipeline=pipeline_ask(cluster.mesh, task.pipeline_axis, schedule),
    )  # fmt: skip


def plan_point(task: Task, searches: SearchCache | None = _SEARCHES) -> dict[str, Any]:
    """The point's row: planned (from the searches of its other budgets kept in `searches`;
    None: alone), or its error (`status` infeasible or error)."""
    started, cpu = time.monotonic(), time.process_time()
    try:
        requested_plan = plan_request(plan_request_of(task), graphs=_GRAPHS, searches=searches)
        row = {"status": "ok", "error": ""} | figures(requested_plan, task.point)
    except InfeasibleError as error:
        row = {"status": "infeasible", "error": str(error)}
    except AutoshardError as error:
        row = {"status": "error", "error": str(error)}
    except Exception as error:  # noqa: BLE001 - a point's failure is its row, not the sweep's
        last = traceback.extract_tb(error.__traceback__)[-1]
        where = f"{last.filename}:{last.lineno}"
        row = {"status": "error", "error": f"{type(error).__name__}: {error} ({where})"}
    return {"key": task.key, "point": task.point.to_json(), "devices": task.point.devices,
            **row, "wall_s": round(time.monotonic() - started, 3),
            "cpu_s": round(time.process_time() - cpu, 3)}  # fmt: skip


def tokens_per_step(requested_plan: RequestedPlan) -> int:
    """The tokens a step takes: the elements of the model's first input where it holds
    integer ids (batch x sequence), else its leading dim (samples); times the micro-batches
    of a training step."""
    graph = requested_plan.graph
    first = graph.values[graph.inputs[0]]
    shape = first.shape
    ids = str(first.dtype).startswith(("int", "uint"))
    count = 1
    for size in shape if ids else shape[:1]:
        count *= size
    training = requested_plan.document.training
    return count * (training.micro_batches if training is not None else 1)


def figures(requested_plan: RequestedPlan, point: Point) -> dict[str, Any]:
    """The plan's figures in the table: step time, tokens/s/device, memory, the strategy."""
    document, cost = requested_plan.document, requested_plan.planned.cost
    step = cost.step_time_s  # a training step overlapped (`cost.overlap`)
    memory = cost.memory_bytes_per_device
    if document.pipeline is not None:  # the cost is a stage's: the pipeline's step and stages
        step = document.pipeline["step_time_s"]
        memory = max(s["memory"]["bytes_per_device"] for s in document.pipeline["stages"])
    tokens = tokens_per_step(requested_plan)
    story = (document.story or "").split(". ")[0].rstrip(".")
    solver = document.solver
    return {
        "step_time_s": step, "tokens_per_step": tokens,
        "tokens_per_s_per_device": tokens / step / point.devices if step else 0.0,
        "memory_bytes_per_device": memory,
        "memory_budget_bytes": requested_plan.cluster.memory,
        "comm_bytes_per_device": cost.comm_bytes_per_device,
        "recompute": str(document.training.recompute) if document.training else "",
        "solver": f"{solver.status} gap {solver.gap:.2%}" if solver else "",
        "strategy": story, "plan_sha256": plan_sha256(document.to_json()),
    }  # fmt: skip


def plan_sha256(document: dict[str, Any]) -> str:
    """What a plan decides, as a hash: its values' shardings, its ops' options and its
    collectives (`autoshard plan --json`'s `values`, `ops` and `collectives`), so points
    that chose the same plan show the same hash."""
    decided = {key: document[key] for key in ("values", "ops", "collectives")}
    text = json.dumps(decided, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:20]
