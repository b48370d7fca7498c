"""A sweep worker's caches under `--recompute auto` (`sweep.points`): a point whose budget
binds builds every rung of the recomputation ladder, and the point's next budgets still find
the model imported and its searches built (the caches hold a whole ladder), each row what
`autoshard plan` of that point alone prints."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
from pathlib import Path

import onnx

from autoshard.cli.main import main
from autoshard.sweep import points
from autoshard.sweep.grid import Point
from autoshard.sweep.points import Task, budget_groups, plan_point, plan_sha256
from tests.training.test_recompute import MODELS

DIMS = (("batch", 8), ("seq", 32))
BUDGETS = ("1GiB", "4MB", "3MB", "100KB")  # free, binding (every rung built), binding, none fits


def _decoder(path: Path) -> Path:
    """models/make_models.py's shape-only decoder of 4 layers (5 distinct rungs)."""
    spec = importlib.util.spec_from_file_location("make_models", MODELS / "make_models.py")
    assert spec is not None and spec.loader is not None
    make_models = importlib.util.module_from_spec(spec)
    sys.modules["make_models"] = make_models  # its dataclasses look it up
    spec.loader.exec_module(make_models)
    onnx.save(make_models.build_decoder_shape_only(4, hidden=64, heads=4, ffn=128,
                                                   vocab=128).proto, path)  # fmt: skip
    return path


def _alone(model: Path, memory: str) -> tuple[int, dict[str, object] | None]:
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(io.StringIO()):
        code = main(["plan", str(model), "--mesh", "2x2", "--dim", "batch=8", "--dim", "seq=32",
                     "--mode", "training", "--memory", memory, "--json", "-q"])  # fmt: skip
    return code, json.loads(text.getvalue()) if code == 0 else None


def test_a_binding_points_budgets_import_once_and_are_each_budgets_plan(tmp_path: Path) -> None:
    model = _decoder(tmp_path / "decoder.onnx")
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
