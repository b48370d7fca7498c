"""A sweep worker's caches under `--recompute auto` (`sweep.points`): a point whose budget
binds builds every rung of the recomputation ladder, and the point's next budgets still find
the model imported and its searches built (the caches hold a whole ladder), each row what
`autoshard plan` of that point alone prints."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from autoshard.cli.main import main
from autoshard.sweep import points
from autoshard.sweep.grid import Point
from autoshard.sweep.points import Task, budget_groups, plan_point, plan_sha256
from tests.training.test_recompute import _small_decoder

DIMS = (("batch", 8), ("seq", 32))
BUDGETS = ("1GiB", "4MB", "3MB", "100KB")  # free, binding (every rung built), binding, none fits


def _alone(model: Path, memory: str) -> tuple[int, dict[str, object] | None]:
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(io.StringIO()):
        code = main(["plan", str(model), "--mesh", "2x2", "--dim", "batch=8", "--dim", "seq=32",
                     "--mode", "training", "--memory", memory, "--json", "-q"])  # fmt: skip
    return code, json.loads(text.getvalue()) if code == 0 else None


def test_a_binding_points_budgets_import_once_and_are_each_budgets_plan(tmp_path: Path) -> None:
    model = _small_decoder(tmp_path / "decoder.onnx", layers=4)  # 5 distinct rungs
    tasks = [
        Task(key=m, point=Point(mesh="2x2", memory=m, dims=DIMS, mode="training"),
             model=str(model), objective="time", time_limit=60.0)
        for m in BUDGETS
    ]  # fmt: skip
    (group,) = budget_groups(tasks)
    assert [t.point.memory for t in group] == list(BUDGETS)  # largest first
    points._GRAPHS.clear()
    points._SEARCHES.clear()
    rows = [plan_point(group[0]), plan_point(group[1])]
    graphs = dict(points._GRAPHS)
    searches = dict(points._SEARCHES)
    assert len(graphs) > 4  # the binding budget built every rung (more than a cache of 4)
    rows += [plan_point(task) for task in group[2:]]
    # No import again, no search built again: the same graphs and searches, more where added.
    assert all(points._GRAPHS.get(key) is graph for key, graph in graphs.items())
    assert all(points._SEARCHES.get(key) is found for key, found in searches.items())
    statuses = []
    for row, memory in zip(rows, BUDGETS, strict=True):
        code, plan = _alone(model, memory)
        statuses.append(row["status"])
        if plan is None:
            assert code != 0 and row["status"] == "infeasible", row["error"]
            continue
        assert row["status"] == "ok", row["error"]
        assert row["step_time_s"] == plan["cost"]["step_time_s"]
        assert row["memory_bytes_per_device"] == plan["cost"]["memory_bytes_per_device"]
        assert row["recompute"] == plan["training"]["recompute"]
        assert row["plan_sha256"] == plan_sha256(plan)
    assert statuses == ["ok", "ok", "ok", "infeasible"]
    assert len({row["plan_sha256"] for row in rows[:3]}) == 3  # each binding budget its own
