"""`--recompute auto` with its recomputations priced before the search (`Ladder`: their
compute, and the least memory any plan of each can hold), and TorchTitan's op-level
selective recompute (`selective-op`): what it keeps, frees and replays, by hand."""

from __future__ import annotations

import re

import pytest

from autoshard.cost.cluster import make_cluster
from autoshard.cost.replay import memory_floor, recompute_ladder, replay_figures
from autoshard.pipeline import PlanRequest, _step_graphs, load_graph, plan_request
from autoshard.rules.gradient import RECOMPUTE_OF
from autoshard.search.budget import auto_plan
from autoshard.search.recompute import Ladder, choose_recompute
from autoshard.search.solver.outcome import InfeasibleError
from autoshard.training import Attention, Recompute, Training
from autoshard.units import format_bytes
from tests.training.test_recompute import _small_decoder

DIMS = {"batch": 2, "seq": 16}
BATCH, SEQ, HIDDEN, FFN = 2, 16, 64, 128
FUSED = Training(attention=Attention.FUSED)
LAYER = (
    *(f"input_norm.{op}" for op in ("pow", "mean", "add_eps", "sqrt", "div", "out")),
    "attn.k_proj.out", "attn.q_heads", "attn.k_heads", "attn.v_heads", "attn.q_t", "attn.k_t",
    "attn.v_t", "attn.ctx_t", "attn.merged", "attn.o_proj.out", "attn_residual",
    *(f"post_attn_norm.{op}" for op in ("pow", "mean", "add_eps", "sqrt", "div", "out")),
    "mlp.up_proj.out", "mlp.sigmoid", "mlp.silu", "mlp.gated", "mlp_residual",
)  # fmt: skip
"""A decoder layer's ops selective-op runs again (`build_decoder_shape_only`'s names): all but
q_proj, v_proj, gate_proj and down_proj (the 1st, 3rd, 5th and 7th linear matmuls) and the
attention core (its flash kernel)."""


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return _small_decoder(tmp_path_factory.mktemp("decoder") / "decoder.onnx")


def _layer_op(name: str) -> tuple[int, str]:
    """('layers.1.attn.k_proj.out_23', ...) -> (1, 'attn.k_proj.out')."""
    _, layer, rest = name.split(".", 2)
    return int(layer), rest.rsplit("_", 1)[0]


def test_selective_op_recomputes_all_but_every_other_linear_matmul_and_attention(decoder):
    """Per layer it keeps, for the backward, the layer's input and what the kept ops make;
    what the gradients read of the recomputed ops, per layer (b·s tokens; T a [b, s, h]
    bf16 tensor, F a [b, s, ffn] one, N a [b, s, 1] one): each norm's variance and root
    (Sqrt's and Div's gradients read them: 2N), its Div result (the norm weight's gradient:
    T) and its output (the next matmuls' weight gradients: T); Q, K, V in heads (the
    attention kernel's backward: 3T); the merged context (o_proj's weight: T); the residual
    sum (the second norm's Pow and Div: T); up, sigmoid, SiLU and the gated product (the
    MLP's products and down_proj's weight: 4F). 9T + 4N + 4F per layer, 2 layers. The
    added compute is the copies' seconds, the same as their originals', and the recomputed
    matmuls are k_proj and o_proj (2·b·s·h·h FLOPs each) and up_proj (2·b·s·h·ffn)."""
    graph = load_graph(decoder, DIMS, FUSED.but(Recompute.SELECTIVE_OP))
    recomputed = [op for op in graph.ops if op.attr(RECOMPUTE_OF, "")]
    by_layer: dict[int, list[str]] = {}
    for op in recomputed:
        layer, name = _layer_op(str(op.attr(RECOMPUTE_OF)))
        by_layer.setdefault(layer, []).append(name)
    assert by_layer == {1: list(LAYER), 0: list(LAYER)}  # the last layer's backward first
    planned = auto_plan(graph, make_cluster(mesh="1"))
    figures = replay_figures(graph, planned.plan, planned.cost)
    tokens = BATCH * SEQ
    t, f, n = (2 * tokens * width for width in (HIDDEN, FFN, 1))
    assert figures.freed_bytes == 2 * (9 * t + 4 * n + 4 * f)
    originals = [graph.op_by_name[str(op.attr(RECOMPUTE_OF))] for op in recomputed]
    assert figures.added_s == pytest.approx(
        sum(planned.cost.ops[op.name].seconds for op in originals)
    )
    matmuls = {
        _layer_op(str(op.attr(RECOMPUTE_OF)))[1]: planned.cost.ops[op.name].flops
        for op in recomputed if op.type == "MatMul"
    }  # fmt: skip
    assert matmuls == {
        "attn.k_proj.out": 2 * tokens * HIDDEN * HIDDEN,
        "attn.o_proj.out": 2 * tokens * HIDDEN * HIDDEN,
        "mlp.up_proj.out": 2 * tokens * HIDDEN * FFN,
    }


def _request(model, memory: int | None, training: Training) -> PlanRequest:
    return PlanRequest(
        model_path=model, cluster=make_cluster(mesh="2", memory=str(memory or "80GB")),
        dims={"batch": 8, "seq": 32}, time_limit=300, training=training,
    )  # fmt: skip


def _lowest(model, training: Training) -> int:
    """The least memory any plan of `training` needs (proven optimal)."""
    with pytest.raises(InfeasibleError) as refused:
        plan_request(_request(model, 2**16, training))
    lowest = refused.value.lowest
    assert lowest is not None and lowest.peak == lowest.bound
    return lowest.peak


def test_no_plan_holds_less_than_the_memory_floor(decoder):
    """The floor `auto` skips a recomputation by is below the least memory its plans need."""
    request = _request(decoder, None, FUSED)
    steps = _step_graphs(request, recompute_ladder(FUSED), None, {})[1]
    for training in (FUSED.but(Recompute.NONE), FUSED.but(Recompute.SELECTIVE_OP)):
        floor, lowest = memory_floor(steps[training], 2), _lowest(decoder, training)
        assert 0.8 * lowest < floor <= lowest


def test_auto_solves_the_cheapest_first_and_skips_what_cannot_fit(decoder):
    request = _request(decoder, None, FUSED)
    forward, steps = _step_graphs(request, recompute_ladder(FUSED), None, {})
    ladder = Ladder.of(forward, steps, request.cluster)
    # layers:4 and layers:2 recompute the same first layer of two: one is tried.
    ranked = ["none", "layers:4", "selective-op", "layers"]
    assert [t.recompute_text for t in ladder.ranked] == ranked
    floor = memory_floor(steps[FUSED.but(Recompute.NONE)], 2)
    assert ladder.floors[FUSED.but(Recompute.NONE)] == floor
    solved: list[str] = []

    def solve(training: Training, last: bool) -> tuple[float, bool]:
        solved.append(training.recompute_text)
        return 1.0, True

    considered = choose_recompute(ladder.ranked, dict.fromkeys(ladder.ranked, 0.0), solve,
                                  ladder.floors, floor - 1)[1]  # fmt: skip
    assert considered[0].why == f"needs at least {format_bytes(floor)} per device"
    assert solved == ranked[1:]


def test_auto_recomputes_exactly_when_the_budget_requires_it_under_fused_attention(decoder):
    """Just above the least memory a plan without recompute needs (2 %: at the line the
    proof takes CP-SAT minutes): none; a byte below it: the recomputation replaying the
    least compute whose plan fits, and the story says so with its figures."""
    lowest = _lowest(decoder, FUSED.but(Recompute.NONE))
    auto = FUSED.but(Recompute.AUTO)
    above = plan_request(_request(decoder, lowest * 102 // 100, auto)).document
    assert above.training is not None and above.training.recompute is Recompute.NONE
    below = plan_request(_request(decoder, lowest - 1, auto)).document
    assert below.training is not None and below.training.recompute is not Recompute.NONE
    assert below.cost is not None and below.cost.memory_bytes_per_device < lowest
    assert "chosen by the search: frees " in (below.story or "")
    assert re.search(r"\bnone\b[^;]*: no plan fits", below.story or "")
