"""The standard recipes priced beside a plan (`search.recipes`, `search.recipe_prices`): their
prices checked by hand on the MLP, equal to `autoshard plan` with the recipe pinned on the MLP
and a GPT-2 block, the recipes block of the plan document, and `explain --why-not RECIPE`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autoshard.cli.main import main
from autoshard.cost.cluster import make_cluster
from autoshard.cost.compute import op_cost
from autoshard.document.plan_document import PlanDocument, write_document
from autoshard.explain.saved import ExplainError, load_saved
from autoshard.explain.whynot import why_not, why_not_text
from autoshard.pipeline import PlanRequest, load_graphs, plan_request
from autoshard.rules import rule_for
from autoshard.search.options import Objective
from autoshard.search.recipes import (
    Recipe,
    RecipeError,
    megatron_splits,
    parse_recipe,
    recipe_layout,
)
from autoshard.sharding import Sharding, ShardingOption
from autoshard.training import Training

MODELS = Path(__file__).resolve().parents[2] / "models"
MLP = MODELS / "mlp.onnx"  # x [8, 64] -> Gemm 0.weight [256, 64] -> Relu -> Gemm 2.weight [64, 256]
BLOCK = MODELS / "block_dynamo.onnx"  # one GPT-2 block: attention and MLP, x [batch, seq, 32]
F32 = 4


def planned(path: Path, mesh: str, dims: dict, training: Training | None = None, memory=None):
    request = PlanRequest(model_path=path, cluster=make_cluster(mesh, memory=memory), dims=dims,
                          training=training)  # fmt: skip
    return request, plan_request(request)


@pytest.fixture(scope="module")
def mlp():
    return planned(MLP, "2x2", {"batch": 8})


def rows(document: PlanDocument) -> dict[str, dict]:
    assert document.recipes is not None
    return {r.name: r.to_json() for r in document.recipes.rows}


def test_mlp_recipes_by_hand(mlp):
    """MLP on 2x2 (H100s, every link 450 GB/s and 1 us), inference. dp: the batch of 8 over
    all 4 devices, 2 rows each, weights whole, no collective; tp-dp: the batch over axis 0 (4
    rows each), Megatron over axis 1 (0.weight split on its output features, 2.weight on its
    input features): one all_reduce of y's [4, 64] fp32 partial sums over 2 devices."""
    _, requested = mlp
    graph = requested.graph
    gemm0, relu, gemm2 = graph.ops
    cluster = requested.cluster

    def compute(op, option: str) -> float:
        rule = rule_for(op, graph)
        return op_cost(op, rule, ShardingOption.parse(option, len(rule.loops)), graph,
                       cluster).seconds  # fmt: skip

    found = rows(requested.document)
    # dp: every op's batch loop split over (0, 1); Gemm 0 does 2 x 64 x 256 multiply-adds.
    rule = rule_for(gemm0, graph)
    local = op_cost(gemm0, rule, ShardingOption.parse("[[0, 1]]", len(rule.loops)), graph, cluster)
    assert local.flops == 2 * (2 * 64 * 256)
    dp = sum(compute(op, "[[0, 1]]") for op in graph.ops)
    assert found["dp"]["step_time_s"] == pytest.approx(dp, rel=1e-12)
    assert found["dp"]["compute_time_s"] == pytest.approx(dp, rel=1e-12)
    # held at the peak: both weights and biases whole, x's, the Gemm's and the Relu's 2 rows
    weights = (256 * 64 + 256 + 64 * 256 + 64) * F32
    assert found["dp"]["memory_bytes_per_device"] == weights + (2 * 64 + 2 * 256 * 2) * F32
    # tp-dp: Gemm 0 column-split, Gemm 2 row-split (its reduction loop over axis 1)
    tp_compute = (compute(gemm0, "[[0], [1]]") + compute(relu, "[[0], [1]]")
                  + compute(gemm2, "[[0], [], [1]]"))  # fmt: skip
    y_shard = 4 * 64 * F32  # [4, 64] fp32 on each device
    n = 2
    sent = 2 * (n - 1) * (y_shard // n)  # the ring all_reduce's bytes (collectives.ring_bytes)
    assert sent == 1024
    all_reduce = 2 * (n - 1) * 1e-6 + sent / 450e9
    tp = found["tp-dp"]
    assert tp["compute_time_s"] == pytest.approx(tp_compute, rel=1e-12)
    assert tp["step_time_s"] == pytest.approx(tp_compute + all_reduce, rel=1e-12)
    halves = (256 * 64 // 2 + 256 // 2 + 64 * 256 // 2 + 64) * F32  # 2.bias whole
    assert tp["memory_bytes_per_device"] == halves + (4 * 64 + 4 * 128 * 2) * F32
    assert tp["fits"] and found["dp"]["fits"]


def test_an_inference_plan_prices_dp_and_tp_dp_only(mlp):
    _, requested = mlp
    assert list(rows(requested.document)) == ["dp", "tp-dp"]


@pytest.mark.parametrize(
    ("path", "dims"),
    [(MLP, {"batch": 8}), (BLOCK, {"batch": 8, "seq": 128})],
    ids=["mlp", "gpt2-block"],
)
@pytest.mark.parametrize("recipe", ["dp", "tp-dp"])
def test_a_recipes_price_is_the_plan_with_it_pinned(path, dims, recipe):
    """`autoshard plan` with the recipe's annotations finds the program the recipe was priced
    at: the same step time (float summation order aside) and the same memory."""
    request, requested = planned(path, "2x2", dims)
    row = rows(requested.document)[recipe]
    forward, graph = load_graphs(path, dims, None)
    mesh = request.cluster.mesh
    layout = recipe_layout(graph, megatron_splits(forward, mesh), mesh, Recipe(recipe))
    pinned = plan_request(dataclasses.replace(request, annotations=layout.annotations))
    cost = pinned.document.cost
    assert cost is not None
    assert row["step_time_s"] == pytest.approx(cost.objective, rel=1e-12)
    assert row["memory_bytes_per_device"] == cost.memory_bytes_per_device


@pytest.mark.parametrize("recipe", ["dp", "zero", "fsdp", "tp-dp", "tp-fsdp"])
def test_an_mlp_training_recipes_price_is_the_plan_with_it_pinned(recipe):
    """A training step's recipes too: the pinned plan's program costs the recipe's step time;
    its memory is the recipe's, or above it where the recipe's reshards of several
    collectives hold intermediates its memory rows leave out (`memory_at_least`)."""
    dims = {"batch": 8}
    request, requested = planned(MLP, "2x2", dims, Training())
    row = rows(requested.document)[recipe]
    forward, graph = load_graphs(MLP, dims, Training())
    mesh = request.cluster.mesh
    layout = recipe_layout(graph, megatron_splits(forward, mesh), mesh, Recipe(recipe))
    cost = plan_request(dataclasses.replace(request, annotations=layout.annotations)).document.cost
    assert cost is not None
    assert row["step_time_s"] == pytest.approx(cost.objective, rel=1e-12)
    if row["memory_at_least"]:
        assert row["memory_bytes_per_device"] <= cost.memory_bytes_per_device
    else:
        assert row["memory_bytes_per_device"] == cost.memory_bytes_per_device


def test_training_recipes_bound_the_pinned_programs():
    """On a GPT-2 block's training step the CCL passes after materialization send less than
    a recipe's materialized program: the pinned plan's program costs no more than the
    recipe's price. ZeRO splits the optimizer state over the 4 devices, FSDP the weights
    too: each needs less memory than dp. (Between the two the peak is the activations', of
    whichever fastest program: this block's weights are 32 wide.)"""
    dims = {"batch": 8, "seq": 128}
    request, requested = planned(BLOCK, "2x2", dims, Training())
    found = rows(requested.document)
    assert list(found) == ["dp", "zero", "fsdp", "tp-dp", "tp-fsdp"]
    forward, graph = load_graphs(BLOCK, dims, Training())
    mesh = request.cluster.mesh
    for recipe in ("zero", "fsdp"):
        layout = recipe_layout(graph, megatron_splits(forward, mesh), mesh, Recipe(recipe))
        pinned = plan_request(dataclasses.replace(request, annotations=layout.annotations))
        cost = pinned.document.cost
        assert cost is not None
        assert found[recipe]["step_time_s"] >= cost.objective * (1 - 1e-12)
        assert found[recipe]["memory_bytes_per_device"] <= cost.memory_bytes_per_device
    for recipe in ("zero", "fsdp"):
        assert found[recipe]["memory_bytes_per_device"] < found["dp"]["memory_bytes_per_device"]


def test_zero_and_fsdp_layouts():
    """ZeRO holds a weight whole and its optimizer state split over every axis, on the first
    dim the axes divide; FSDP the weight too."""
    forward, graph = load_graphs(MLP, {"batch": 8}, Training())
    mesh = make_cluster("2x2").mesh
    zero = {(a.value, a.for_users): a.sharding
            for a in recipe_layout(graph, {}, mesh, Recipe.ZERO).annotations}  # fmt: skip
    fsdp = {(a.value, a.for_users): a.sharding
            for a in recipe_layout(graph, {}, mesh, Recipe.FSDP).annotations}  # fmt: skip
    assert zero[("x", False)] == zero[("x", True)] == Sharding.parse("[[0, 1]]")
    assert zero[("0.weight", False)] == Sharding()
    assert zero[("0.weight@state", False)] == Sharding.parse("[[], [0, 1]]")
    assert fsdp[("0.weight", False)] == Sharding.parse("[[0, 1]]")
    assert fsdp[("2.bias", False)] == Sharding.parse("[[0, 1]]")  # 64 divides over 4
    assert fsdp[("2.bias@state", False)] == Sharding.parse("[[], [0, 1]]")


def test_the_difference_line_names_the_best_recipe_that_fits():
    """At 100 KB per device dp (134 KiB) does not fit: the best that fits is tp-dp."""
    _, requested = planned(MLP, "2x2", {"batch": 8}, memory="100KB")
    block = requested.document.recipes
    assert block is not None
    assert not block.row("dp").fits and block.row("tp-dp").fits
    assert block.best == "tp-dp"
    assert block.difference.startswith("the plan is ")
    assert "faster than the best recipe that fits, tp-dp" in block.difference
    again = PlanDocument.from_json(json.loads(json.dumps(requested.document.to_json())))
    assert again.recipes == block


def test_a_one_axis_mesh_has_no_tp_recipe():
    _, requested = planned(MLP, "4", {"batch": 8})
    found = rows(requested.document)
    assert found["tp-dp"]["refused"] == "needs two mesh axes (TP and DP); mesh 4 has one"
    assert found["tp-dp"]["step_time_s"] is None


@pytest.mark.parametrize(
    ("text", "training", "message"),
    [
        ("zero4", True, "recipe: unknown recipe 'zero4'; choose one of: dp, zero, fsdp, tp-dp, "
         "tp-fsdp"),
        ("fsdp", False, "recipe: recipe fsdp is a training layout and this plan is inference; "
         "choose one of: dp, tp-dp"),
    ],
    ids=["unknown", "training-only"],
)  # fmt: skip
def test_bad_recipe_names(text, training, message):
    with pytest.raises(RecipeError) as error:
        parse_recipe(text, training)
    assert str(error.value) == message


def test_recipe_aliases():
    assert parse_recipe("ZeRO2", True) is parse_recipe("zero1", True) is Recipe.ZERO
    assert parse_recipe("zero3", True) is Recipe.FSDP
    assert parse_recipe("ddp", False) is Recipe.DP


def test_why_not_a_recipe(mlp, tmp_path, capsys):
    """`explain --why-not tp-dp`: the plan's search asked again with the recipe pinned, and
    the recipe's price beside the plan with the line saying how the plan differs."""
    request, requested = mlp
    out = tmp_path / "mlp.json"
    write_document(out, requested.document)
    saved = load_saved(str(out), MLP)
    answer, target = why_not(saved, "tp-dp")
    assert (answer["kind"], answer["name"], answer["verdict"]) == ("recipe", "tp-dp",
                                                                   "CHOSEN CHEAPER")  # fmt: skip
    assert target is not None and target.cost is not None
    assert answer["recipe"] == rows(requested.document)["tp-dp"]
    assert answer["recipe"]["step_time_s"] == pytest.approx(target.cost.objective, rel=1e-12)
    assert answer["versus"].startswith("the plan is ") and "faster than tp-dp" in answer["versus"]
    text = why_not_text(answer).splitlines()
    assert text[0] == "why not tp-dp: CHOSEN CHEAPER"
    assert text[1].startswith("  recipe tp-dp (Megatron TP x DP) priced beside the plan: ")
    assert text[2] == f"  {answer['versus']}"
    with pytest.raises(ExplainError, match="unknown recipe 'tp'; choose one of: dp, tp-dp"):
        why_not(saved, "tp")
    code = main(["explain", str(out), "--model", str(MLP), "--why-not", "megatron"])
    assert code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["autoshard: error: --why-not 'megatron': unknown recipe 'megatron'; choose "
                   "one of: dp, tp-dp; or give NAME=SHARDING (e.g. 'x=[[0], []]')"]  # fmt: skip


def test_a_bytes_plan_ranks_the_recipes_by_bytes():
    """Under `--objective bytes` the recipes are lowered and priced as programs, and ranked by
    what they send: dp sends nothing, tp-dp its all_reduce of y (1 KiB per device)."""
    request = PlanRequest(model_path=MLP, cluster=make_cluster("2x2"), dims={"batch": 8},
                          objective=Objective.BYTES)  # fmt: skip
    block = plan_request(request).document.recipes
    assert block is not None and block.plan_comm_bytes_per_device == 0
    assert block.row("dp").comm_bytes_per_device == 0
    assert block.row("tp-dp").comm_bytes_per_device == 1024
    assert block.best == "dp"
    assert block.difference.startswith("the plan sends what the best recipe that fits, dp sends")
