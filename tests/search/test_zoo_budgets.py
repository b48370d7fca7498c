"""Models the solver was not developed on, under a memory budget that binds: tiny configs of
`models/make_zoo.py` (a Hugging Face ViT and GPT-2, a hand-written ResNet; TorchScript exports,
their batch dim symbolic and bound here) planned on 2x2 at 95 % of their free plan's peak, which
that plan does not fit. Each must end OPTIMAL: the memory-bound search proves its plan the best
that fits, within `--time-limit` (generous here: the deterministic limit, not the wall clock,
is what these solves meet on any machine; no wall-clock assertion)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autoshard.cost.cluster import make_cluster
from autoshard.ir.onnx_import import unbound_dims
from autoshard.pipeline import PlanRequest, plan_request
from autoshard.search.solver.outcome import SolverStatus

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

MODELS = Path(__file__).resolve().parents[2] / "models"
FAMILIES = ("vit", "resnet", "gpt2")
DIMS = {"batch": 8, "seq": 32}
SHARE = 0.95


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict[str, Path]:
    """The families' TorchScript exports, written by the zoo's own builders."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(MODELS))  # make_zoo imports its sibling make_models
        import make_zoo

        folder = tmp_path_factory.mktemp("zoo")
        paths = {}
        for name in FAMILIES:
            builder, _ = make_zoo.MODELS[name]
            paths[name] = folder / f"{name}_ts.onnx"
            make_zoo.save_atomic(make_zoo.export_ts(builder(None)), paths[name])
        sys.modules.pop("make_zoo", None)
        sys.modules.pop("make_models", None)
    return paths


def planned(path: Path, memory: str):
    """`autoshard plan`'s search on 2x2 at `memory`, the model's symbolic dims bound."""
    dims = {name: size for name, size in DIMS.items() if name in unbound_dims(path)}
    request = PlanRequest(
        model_path=path, cluster=make_cluster("2x2", memory=memory), dims=dims, time_limit=120
    )
    return plan_request(request).planned


@pytest.mark.parametrize("family", FAMILIES)
def test_a_binding_budget_ends_optimal(zoo, family):
    free = planned(zoo[family], "1TB")
    budget = int(SHARE * free.cost.memory_bytes_per_device)
    bound = planned(zoo[family], str(budget))
    assert free.solution.status is SolverStatus.OPTIMAL
    assert free.usage.peak > budget  # the budget binds: the free plan does not fit it
    assert bound.solution.status is SolverStatus.OPTIMAL, (bound.solution.gap, budget)
    assert bound.usage.peak <= budget
    assert bound.cost.objective >= free.cost.objective
