"""The answer ranked on the step's critical path (`search.critical`): a recipe's plan that
sends more but hides it under compute answers in place of the searched plan; where the
searched plan is fastest it stays."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import onnx
import pytest

from autoshard.cost.cluster import make_cluster
from autoshard.cost.price import price
from autoshard.deadline import Deadline
from autoshard.passes.lower import lower_measured
from autoshard.pipeline import PlanRequest, load_graphs, plan_request
from autoshard.search.budget import auto_plan
from autoshard.search.critical import fastest_answer
from autoshard.search.options import Objective
from autoshard.search.recipe_prices import price_recipes
from autoshard.search.recipes import Recipe, megatron_splits, recipe_layout
from autoshard.training import Recompute, Training
from autoshard.units import format_seconds

MODELS = Path(__file__).resolve().parents[2] / "models"
MLP = MODELS / "mlp.onnx"  # x [batch, 64] -> Gemm [256, 64] -> Relu -> Gemm [64, 256]
STEP = Training(recompute=Recompute.NONE)
DECODER_DIMS = {"batch": 8, "seq": 512}


@pytest.fixture(scope="module")
def decoder(tmp_path_factory) -> Path:
    """A 2-layer Llama-style decoder, hidden 1024 (8 heads), SwiGLU 2816, vocabulary 1000."""
    sys.path.insert(0, str(MODELS))
    from make_models import build_decoder_shape_only

    path = tmp_path_factory.mktemp("critical") / "decoder.onnx"
    onnx.save(build_decoder_shape_only(2, hidden=1024, heads=8, ffn=2816, vocab=1000).proto, path)
    return path


def searched_and_prices(path: Path, mesh: str, dims: dict, memory=None):
    """The search's own plan (`auto_plan`, no recipe ranked beside it) and the recipes, of
    the step `autoshard plan` plans (attention as the device runs it)."""
    cluster = make_cluster(mesh, memory=memory)
    forward, graph = load_graphs(path, dims, STEP.for_device(cluster.device.flash_attention))
    planned = auto_plan(graph, cluster, overlap=STEP.overlap)
    prices = price_recipes(graph, forward, cluster, planned.search, Objective.TIME)
    return graph, forward, cluster, planned, {p.recipe: p for p in prices}


def test_zero_hides_its_gradient_syncs_and_answers(decoder):
    """The decoder on 8 H100s, memory unbounded. The search's plan (least compute plus every
    collective at its full time) holds each weight split (its optimizer state too) and runs
    the MLPs tensor-parallel: activation all_gathers and reduce_scatters on the critical path,
    the gradients' reduce-scatters smaller. ZeRO-1/2's plan sends more bytes and costs more
    by that measure, but its gradients' reduce-scatters run bucket by bucket under the
    backward: its step is shorter, and `autoshard plan` answers it, the same program as with
    ZeRO's layout pinned (one pricing: `cost.price`)."""
    graph, forward, cluster, planned, prices = searched_and_prices(decoder, "8", DECODER_DIMS)
    searched, zero = planned.cost, prices[Recipe.ZERO]
    request = PlanRequest(model_path=decoder, cluster=cluster, dims=DECODER_DIMS, training=STEP)
    answer = plan_request(request)
    cost = answer.planned.cost
    assert answer.document.strategy is not None
    assert answer.document.strategy.counts == {"zero": 21}
    assert searched.objective < zero.step_time_s == pytest.approx(cost.objective, rel=1e-12)
    assert searched.comm_bytes_per_device < cost.comm_bytes_per_device
    assert cost.step_time_s < searched.step_time_s
    assert cost.schedule is not None and searched.schedule is not None
    assert cost.schedule.hidden_s > searched.schedule.hidden_s
    # Each plan's step: its compute, the communication it leaves exposed, the slowdown.
    for mine in (cost, searched):
        assert mine.schedule is not None
        exposed = mine.comm_time_s - mine.schedule.hidden_s
        assert mine.step_time_s == pytest.approx(
            mine.compute_time_s + exposed + mine.schedule.slowdown_s, rel=1e-9
        )
    mesh = cluster.mesh
    layout = recipe_layout(graph, megatron_splits(forward, mesh), mesh, Recipe.ZERO)
    pinned = plan_request(dataclasses.replace(request, annotations=layout.annotations))
    assert pinned.planned.plan.values == answer.planned.plan.values
    assert pinned.planned.cost.step_time_s == cost.step_time_s
    story = answer.document.story
    assert "Answered with the ZeRO-1/2 recipe's plan (zero)" in story
    assert "faster, though the searched plan costs less by the search's measure" in story
    assert "Answered" not in (pinned.document.story or "")
    assert answer.document.recipes is not None
    assert answer.document.recipes.difference.startswith("the plan is zero's fastest program")


def test_the_searched_plan_stays_where_it_is_fastest():
    """The MLP on 4 devices, batch 64: the search keeps everything whole (no collective), its
    step its compute. DDP's fastest program computes the first layer on a quarter of the
    batch each, so its compute is under the searched step and it is lowered and priced: it
    gathers the Relu's output for the second layer and syncs the first layer's gradients,
    each collective a few µs of latency with nothing to hide under (the gradients' one
    bucket closes with the backward's last op): compute plus all of it, slower. The searched
    plan answers, unchanged."""
    graph, _, cluster, planned, prices = searched_and_prices(MLP, "4", {"batch": 64})
    assert planned.cost.comm_time_s == 0.0
    assert planned.cost.step_time_s == planned.cost.compute_time_s
    dp = prices[Recipe.DP]
    assert dp.fits is True and dp.compute_time_s < planned.cost.step_time_s
    program, usage = lower_measured(graph, planned.search.plan(graph, cluster, dp.choice))
    cost = price(program, graph, cluster, usage, STEP.overlap)
    assert cost.schedule is not None and cost.schedule.hidden_s == 0.0
    assert cost.step_time_s == pytest.approx(cost.compute_time_s + cost.comm_time_s, rel=1e-9)
    assert cost.step_time_s > planned.cost.step_time_s
    answer = fastest_answer(graph, cluster, planned, list(prices.values()), STEP.overlap)
    assert answer.planned is planned and answer.recipe is None and answer.words == ""


def test_no_recipe_is_lowered_once_the_time_is_out():
    """Past the deadline the searched plan answers and the recipes it would have lowered are
    named (`Answer.unpriced`); a recipe whose compute alone is no faster is not among them."""
    graph, _, cluster, planned, prices = searched_and_prices(MLP, "4", {"batch": 64})
    passed = Deadline.start(0.0)
    answer = fastest_answer(graph, cluster, planned, list(prices.values()), STEP.overlap, passed)
    assert answer.planned is planned
    slower = {r for r, p in prices.items() if p.compute_time_s >= planned.cost.step_time_s}
    fitting = {r for r, p in prices.items() if p.fits is True and not p.refused}
    assert set(answer.unpriced) == fitting - slower
    assert Recipe.DP in answer.unpriced


def test_auto_recompute_ranks_each_candidate_on_the_critical_path(decoder):
    """With `--recompute auto` each candidate solved is ranked with the recipes: memory
    unbounded, `none` is solved alone (no budget binds), ZeRO's program answers it, and the
    recomputation's sentence gives that program's step."""
    cluster = make_cluster("8")
    request = PlanRequest(model_path=decoder, cluster=cluster, dims=DECODER_DIMS,
                          training=Training(recompute=Recompute.AUTO))  # fmt: skip
    answer = plan_request(request)
    alone = plan_request(dataclasses.replace(request, training=STEP))
    assert answer.planned.plan.values == alone.planned.plan.values
    step = answer.planned.cost.step_time_s
    assert step == alone.planned.cost.step_time_s
    story = answer.document.story or ""
    assert f"Recompute none ({format_seconds(step)} a step)" in story
    assert "Answered with the ZeRO-1/2 recipe's plan (zero)" in story
