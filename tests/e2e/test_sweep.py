"""`autoshard sweep` end to end: each point's row is what `autoshard plan` of that point
prints (same step time, memory and plan), on the local pool and on a real local Ray; a
resumed sweep plans only the points it lacks; the outputs are the same bytes run again."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from autoshard.cli.main import main
from autoshard.sweep.executors import run_local
from autoshard.sweep.grid import Point
from autoshard.sweep.points import Task, plan_sha256

MLP = str(Path(__file__).parents[2] / "models" / "mlp.onnx")
GRID = ["--devices", "4", "--max-axes", "2", "--dim", "batch=8", "--mode", "training",
        "--micro-batches", "1,2", "--price-per-device-hour", "2"]  # fmt: skip
POINTS = [("4", "1"), ("2x2", "1"), ("4", "2"), ("2x2", "2")]  # the grid, mesh fastest


def _sweep(out: Path, *extra: str) -> int:
    return main(["sweep", MLP, "-o", str(out), "-q", *GRID, *extra])


@pytest.fixture(scope="module")
def plans() -> dict[tuple[str, str], dict[str, Any]]:
    """`autoshard plan --json` of each point."""
    found = {}
    for mesh, micro in POINTS:
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            args = ["plan", MLP, "--mesh", mesh, "--dim", "batch=8", "--mode", "training",
                    "--micro-batches", micro, "--json", "-q"]  # fmt: skip
            assert main(args) == 0
        found[mesh, micro] = json.loads(text.getvalue())
    return found


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def _check_points(out: Path, plans: dict[tuple[str, str], dict[str, Any]]) -> None:
    table = json.loads((out / "points.json").read_text())["points"]
    assert [(p["mesh"], p["training"]) for p in table] == [
        (mesh, f"micro_batches={micro}") for mesh, micro in POINTS
    ]
    for record, (mesh, micro) in zip(table, POINTS, strict=True):
        plan = plans[mesh, micro]
        cost = plan["cost"]
        assert record["status"] == "ok", record["error"]
        assert record["step_time_s"] == cost["step_time_s"]  # training: the schedule's
        assert record["memory_bytes_per_device"] == cost["memory_bytes_per_device"]
        assert record["comm_bytes_per_device"] == cost["comm_bytes_per_device"]
        assert record["plan_sha256"] == plan_sha256(plan)
        assert record["strategy"] and plan["story"].startswith(record["strategy"])


def test_local_sweep_equals_plan_point_by_point(
    tmp_path: Path, plans: dict[tuple[str, str], dict[str, Any]]
) -> None:
    assert _sweep(tmp_path / "a", "--executor", "local", "--workers", "2") == 0
    _check_points(tmp_path / "a", plans)
    page = (tmp_path / "a" / "front.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") == 2
    assert "<script" not in page and "http://" not in page.replace("http://www.w3.org", "")


def test_resumed_sweep_plans_no_point_twice(
    tmp_path: Path, plans: dict[tuple[str, str], dict[str, Any]]
) -> None:
    out = tmp_path / "a"
    assert _sweep(out, "--executor", "local", "--workers", "1", "--limit", "1") == 0
    assert len(_rows(out)) == 1  # killed after one point
    assert _sweep(out, "--executor", "local", "--workers", "2") == 0
    keys = [row["key"] for row in _rows(out)]
    assert len(keys) == len(POINTS) == len(set(keys))  # the 3 others planned, none again
    _check_points(out, plans)
    before = {name: (out / name).read_bytes() for name in ("points.csv", "points.json",
                                                          "front.html")}  # fmt: skip
    assert _sweep(out, "--executor", "local") == 0  # nothing left: no plan at all
    assert len(_rows(out)) == len(POINTS)
    assert before == {name: (out / name).read_bytes() for name in before}


@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="Ray is not installed (pip install 'autoshard[sweep]'); the pool's test covers the rest",
)
def test_ray_sweep_equals_plan_point_by_point(
    tmp_path: Path, plans: dict[tuple[str, str], dict[str, Any]]
) -> None:
    assert _sweep(tmp_path / "a", "--executor", "ray", "--workers", "2") == 0
    _check_points(tmp_path / "a", plans)


BUDGETS = ("1KB", "100KB", "1GiB", "2KB", "200KB")  # below the floor, binding, free


def test_points_differing_in_budget_alone_are_each_budgets_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Budgets of one mesh share a search (`search.shared`): the free plan answers the
    budgets it fits, a refusal the budgets below its floor; each row is still what
    `autoshard plan` of that budget alone prints, binding budgets (another plan) and
    infeasible ones included."""
    out = tmp_path / "a"
    args = ["sweep", MLP, "-o", str(out), "-q", "--mesh", "2x2", "--dim", "batch=8",
            "--memory", ",".join(BUDGETS), "--executor", "local", "--workers", "1"]  # fmt: skip
    assert main(args) == 0
    table = json.loads((out / "points.json").read_text())["points"]
    assert [p["memory"] for p in table] == list(BUDGETS)
    for record, memory in zip(table, BUDGETS, strict=True):
        flags = ["--mesh", "2x2", "--dim", "batch=8", "--memory", memory, "--json", "-q"]
        code = main(["plan", MLP, *flags])
        out_text, err = capsys.readouterr()
        if code != 0:
            assert record["status"] == "infeasible" and "infeasible budget" in err
            continue
        plan = json.loads(out_text)
        assert record["status"] == "ok", record["error"]
        assert record["step_time_s"] == plan["cost"]["objective"]  # a forward pass's
        assert record["memory_bytes_per_device"] == plan["cost"]["memory_bytes_per_device"]
        assert record["plan_sha256"] == plan_sha256(plan)
    statuses = [p["status"] for p in table]
    assert statuses == ["infeasible", "ok", "ok", "infeasible", "ok"]
    assert len({p["plan_sha256"] for p in table if p["status"] == "ok"}) == 2  # one binds


def test_pipeline_auto_adds_each_mesh_pipelined_over_its_first_axis(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--pipeline auto`: each mesh of two axes is planned as given and pipelined over its
    first axis (`pp=2,x1=2`); a one-axis mesh and a first axis past the layers are not; each
    row is `autoshard plan` of its mesh."""
    gpt2 = str(Path(MLP).parent / "gpt2.onnx")
    out = tmp_path / "a"
    dims = ["--dim", "batch=2", "--dim", "seq=16", "--mode", "training"]
    args = ["sweep", gpt2, "-o", str(out), "-q", "--mesh", "2x2,4,64x1", *dims,
            "--pipeline", "auto", "--schedule", "gpipe", "--micro-batches", "2",
            "--executor", "local", "--workers", "1"]  # fmt: skip
    assert main(args) == 0
    capsys.readouterr()
    table = json.loads((out / "points.json").read_text())["points"]
    assert [p["mesh"] for p in table] == ["2x2", "pp=2,x1=2", "4", "64x1"]
    for record in table[:2]:
        flags = ["--mesh", record["mesh"], *dims, "--micro-batches", "2", "--json", "-q"]
        flags += ["--schedule", "gpipe"] if record["mesh"].startswith("pp") else []
        assert main(["plan", gpt2, *flags]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert record["status"] == "ok", record["error"]
        step = plan["pipeline"]["step_time_s"] if plan.get("pipeline") else plan["cost"][
            "step_time_s"]  # fmt: skip
        assert record["step_time_s"] == step
        assert record["plan_sha256"] == plan_sha256(plan)
    assert table[1]["strategy"].startswith("pipeline of 2 stages (GPipe")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--pipeline", "auto"], "--pipeline auto pipelines a training step: add --mode training"),
        (["--pipeline", "auto", "--mode", "training", "--pipeline-axis", "0"],
         "give --pipeline auto or --pipeline-axis, not both"),
    ],
)  # fmt: skip
def test_pipeline_auto_refusals(tmp_path: Path, capsys, flags, message) -> None:
    args = ["sweep", MLP, "-o", str(tmp_path / "a"), "--mesh", "2x2", "--dim", "batch=8"]
    assert main([*args, *flags]) == 2
    assert capsys.readouterr().err == f"autoshard: error: {message}\n"


def test_a_killed_pool_worker_plans_its_point_again() -> None:
    """The pool's worker is killed (SIGKILL) as the first point finishes: the points it had
    are planned again on a fresh pool, and each is recorded once, planned."""
    points = [Point(mesh=mesh, dims=(("batch", 8),)) for mesh in ("2", "4", "2x2")]
    tasks = [Task(key=str(p), point=p, model=MLP, objective="time", time_limit=60.0)
             for p in points]  # fmt: skip
    rows: list[dict[str, Any]] = []
    killed: list[int] = []

    def on_row(row: dict[str, Any]) -> None:
        if not rows:
            for child in multiprocessing.active_children():
                os.kill(child.pid or 0, signal.SIGKILL)
                killed.append(child.pid or 0)
        rows.append(row)

    run_local(tasks, 1, on_row)
    assert len(killed) == 1  # the pool's one worker
    assert sorted(row["key"] for row in rows) == sorted(t.key for t in tasks)
    assert [row["status"] for row in rows] == ["ok"] * 3


def _ray_workers_planning() -> list[int]:
    """The processes below this one whose title says they run a point (Ray titles a worker
    `ray::plan_points` while it runs a group of them)."""

    def parent(pid: int) -> int:
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return 0

    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        pid = int(entry.name)
        if title.startswith(b"ray::plan_points"):
            ancestor = pid
            while ancestor > 1 and ancestor != os.getpid():
                ancestor = parent(ancestor)
            if ancestor == os.getpid():
                found.append(pid)
    return found


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed")
def test_a_killed_ray_worker_plans_its_point_again() -> None:
    """A Ray worker killed (SIGKILL) mid-point: Ray runs the task again (its max_retries),
    and each point is recorded once, planned."""
    from autoshard.sweep.executors import run_ray

    gpt2 = str(Path(MLP).parent / "gpt2.onnx")
    points = [Point(mesh=mesh, dims=(("batch", 8), ("seq", 128))) for mesh in ("2", "4", "2x2")]
    tasks = [Task(key=str(p), point=p, model=gpt2, objective="time", time_limit=60.0)
             for p in points]  # fmt: skip
    rows: list[dict[str, Any]] = []
    killed: list[int] = []

    def on_row(row: dict[str, Any]) -> None:
        rows.append(row)
        for _ in range(100):  # the one worker takes the next point
            if killed:
                return
            for pid in _ray_workers_planning():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.05)

    run_ray(tasks, 1, None, on_row)
    assert killed
    assert sorted(row["key"] for row in rows) == sorted(t.key for t in tasks)
    assert [row["status"] for row in rows] == ["ok"] * 3
