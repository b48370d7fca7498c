"""A sweep from start to end: the grid's keys, the points already done (resumed), the rest
planned on an executor with progress, then the tables and the page written from every row.

Output folder: `results.jsonl` (one line per finished point, the resume log), `points.csv`
and `points.json` (the table in the grid's order), `front.html` (the fronts)."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoshard import __version__
from autoshard.files import write_atomic
from autoshard.html.markup import ms
from autoshard.sweep.executors import run_local, run_ray
from autoshard.sweep.front import pareto_front, step_cost
from autoshard.sweep.grid import Point, SweepError, point_key
from autoshard.sweep.page import sweep_html
from autoshard.sweep.points import Task
from autoshard.sweep.results import Results, read_results


@dataclass(frozen=True, kw_only=True)
class Sweep:
    """What a sweep is asked: the model, its points, what every plan is asked alike, where it
    runs and writes, and (`limit`) at most how many points this run plans."""

    model: Path
    points: tuple[Point, ...]
    out: Path
    objective: str = "time"
    time_limit: float = 60.0
    executor: str = "local"
    workers: int = 1
    ray_address: str | None = None
    price: float | None = None
    limit: int | None = None
    pipeline_axis: str | None = None
    """Every point's pipeline axis (None: none), run in `schedule`'s order (None: 1F1B)."""
    schedule: str | None = None
    global_batch: str | None = None
    """The dim whose grid sizes (`--dim`) are global batches (`search.microbatch`)."""


@dataclass(frozen=True, kw_only=True)
class Outcome:
    rows: tuple[dict[str, Any], ...]
    planned: int  # points this run planned
    resumed: int  # points the folder already had
    left: int  # points not planned (past `limit`)


def model_sha256(path: Path) -> str:
    try:
        with open(path, "rb") as model:
            return hashlib.file_digest(model, "sha256").hexdigest()
    except OSError as error:
        raise SweepError(f"cannot read the model {path}: {error.strerror}") from None


def run_sweep(sweep: Sweep, tell: Callable[[str], None] = lambda _: None) -> Outcome:
    """Plan the points the folder has no row for; write the tables and the page."""
    asked = {"objective": sweep.objective, "time_limit": sweep.time_limit,
             "autoshard": __version__}  # fmt: skip
    for name in (
        "pipeline_axis",
        "schedule",
        "global_batch",
    ):  # absent if not given: earlier keys hold
        if getattr(sweep, name) is not None:
            asked[name] = getattr(sweep, name)
    sha = model_sha256(sweep.model)
    keys = [point_key(sha, point, asked) for point in sweep.points]
    results = Results(sweep.out)
    done = read_results(sweep.out)
    todo = [Task(key=k, point=p, model=str(sweep.model), objective=sweep.objective,
                 time_limit=sweep.time_limit, pipeline_axis=sweep.pipeline_axis,
                 schedule=sweep.schedule, global_batch=sweep.global_batch)
            for k, p in zip(keys, sweep.points, strict=True) if k not in done]  # fmt: skip
    todo = list({task.key: task for task in todo}.values())
    resumed = len(sweep.points) - len(todo)
    chosen = todo[: sweep.limit] if sweep.limit is not None else todo
    watch = _Watch(len(chosen), resumed, len(sweep.points), tell)
    watch.begin()

    def on_row(row: dict[str, Any]) -> None:
        results.add(row)
        done[row["key"]] = row
        watch.finished(row)

    try:
        if sweep.executor == "ray":
            run_ray(chosen, sweep.workers, sweep.ray_address, on_row)
        else:
            run_local(chosen, sweep.workers, on_row)
    finally:
        results.close()
    rows = tuple(done[k] for k in keys if k in done)
    write_tables(sweep, rows)
    return Outcome(rows=rows, planned=len(chosen), resumed=resumed, left=len(todo) - len(chosen))


class _Watch:
    """The progress lines: points done, the best so far, the time left at this pace."""

    def __init__(self, count: int, resumed: int, total: int, tell: Callable[[str], None]) -> None:
        self.count, self.resumed, self.total, self.tell = count, resumed, total, tell
        self.done = 0
        self.best: tuple[float, dict[str, Any]] | None = None
        self.started = time.monotonic()

    def begin(self) -> None:
        resumed = f" ({self.resumed} done before)" if self.resumed else ""
        self.tell(f"sweep: {self.count} of {self.total} points to plan{resumed}")

    def finished(self, row: dict[str, Any]) -> None:
        self.done += 1
        if row["status"] == "ok" and (self.best is None or row["step_time_s"] < self.best[0]):
            self.best = (row["step_time_s"], row)
        elapsed = time.monotonic() - self.started
        left = elapsed / self.done * (self.count - self.done)
        best = (f"best {ms(self.best[0])} on {self.best[1]['devices']} devices "
                f"({self.best[1]['point']['mesh']})" if self.best else "no plan yet")  # fmt: skip
        self.tell(f"sweep: {self.done}/{self.count} points, {best}, about {left:.0f} s left")


COLUMNS = ("key", "mesh", "devices", "cluster", "device", "memory", "dims", "training",
           "status", "step_time_s", "tokens_per_s_per_device", "memory_bytes_per_device",
           "memory_budget_bytes", "comm_bytes_per_device", "cost_per_step", "on_front",
           "strategy", "plan_sha256", "error")  # fmt: skip


def table(rows: Sequence[dict[str, Any]], price: float | None) -> list[dict[str, Any]]:
    """Every row as the table's record (the fronts marked, the run's timing left out: the
    same rows give the same bytes)."""
    planned = [i for i, row in enumerate(rows) if row["status"] == "ok"]
    fronts = fronts_of([rows[i] for i in planned], price)
    marks: dict[int, list[str]] = {}
    for name, front in fronts.items():
        for i in (i for group in front for i in group):
            marks.setdefault(planned[i], []).append(name)
    records = []
    for i, row in enumerate(rows):
        point = row["point"]
        ok = row["status"] == "ok"
        records.append({
            "key": row["key"], "mesh": point["mesh"], "devices": row["devices"],
            "cluster": point["cluster"] or "", "device": point["device"] or "",
            "memory": point["memory"] or "",
            "dims": " ".join(f"{k}={v}" for k, v in point["dims"].items()),
            "training": " ".join(f"{k}={v}" for k, v in point["training"].items()),
            "status": row["status"],
            **{c: row.get(c) if ok else None for c in COLUMNS[9:14]},
            "cost_per_step": step_cost(row["devices"], row["step_time_s"], price)
            if ok and price is not None else None,
            "on_front": " ".join(marks.get(i, [])), "strategy": row.get("strategy", ""),
            "plan_sha256": row.get("plan_sha256", ""),
            "error": row["error"],
        })  # fmt: skip
    return records


def workload(row: dict[str, Any]) -> str:
    """What a step computes (the dims and the training step): only steps of the same work
    compare by their time, so each workload has fronts of its own."""
    point = row["point"]
    return json.dumps([point["dims"], point["mode"], point["training"]], sort_keys=True)


def fronts_of(planned: Sequence[dict[str, Any]], price: float | None) -> dict[str, list[list[int]]]:
    """The fronts of the planned rows, one per workload (`workload`), as indices in `planned`
    by increasing x: step time against devices, and against the cost of a step where a price
    is given."""
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(planned):
        groups.setdefault(workload(row), []).append(i)
    fronts: dict[str, list[list[int]]] = {"devices": []}
    if price is not None:
        fronts["cost"] = []
    for members in groups.values():
        rows = [planned[i] for i in members]
        fronts["devices"].append([members[j] for j in pareto_front(
            [(r["devices"], r["step_time_s"]) for r in rows])])  # fmt: skip
        if price is not None:
            costs = [step_cost(r["devices"], r["step_time_s"], price) for r in rows]
            fronts["cost"].append([members[j] for j in pareto_front(
                [(c, r["step_time_s"]) for c, r in zip(costs, rows, strict=True)])])  # fmt: skip
    return fronts


def write_tables(sweep: Sweep, rows: Sequence[dict[str, Any]]) -> None:
    records = table(rows, sweep.price)
    text = io.StringIO()
    writer = csv.DictWriter(text, COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(records)
    write_atomic(sweep.out / "points.csv", text.getvalue().encode())
    data = json.dumps({"model": sweep.model.name, "points": records}, indent=1, sort_keys=True)
    write_atomic(sweep.out / "points.json", (data + "\n").encode())
    planned = [row for row in rows if row["status"] == "ok"]
    costs = [
        step_cost(r["devices"], r["step_time_s"], sweep.price)
        if r["status"] == "ok" and sweep.price is not None
        else None
        for r in rows
    ]
    page = sweep_html(f"autoshard sweep: {sweep.model.name}", rows, sweep.price,
                      fronts_of(planned, sweep.price), costs)  # fmt: skip
    write_atomic(sweep.out / "front.html", page.encode())
