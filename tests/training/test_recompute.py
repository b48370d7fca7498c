"""Recomputation: what selective recompute frees and costs (hand-computed from GPT-2's attention
core), and `--recompute auto` recomputing exactly when the budget requires it."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import onnx
import pytest

from autoshard.annotations import Annotation
from autoshard.collectives import CollectiveKind
from autoshard.cost.cluster import make_cluster
from autoshard.cost.liveness import _walk_memory
from autoshard.cost.replay import ReplayFigures, recompute_ladder, replay_figures, replay_text
from autoshard.document.plan_document import PlanDocument
from autoshard.pipeline import PlanRequest, load_graph, plan_request
from autoshard.program import Compute
from autoshard.rules.gradient import RECOMPUTE_OF
from autoshard.search.budget import auto_plan
from autoshard.search.solver.outcome import InfeasibleError
from autoshard.sharding import Sharding
from autoshard.training import Attention, Recompute, Training, TrainingError
from autoshard.units import format_seconds

MODELS = Path(__file__).resolve().parents[2] / "models"
GPT2 = MODELS / "gpt2.onnx"
DIMS = {"batch": 2, "seq": 16}
AS_EXPORTED = Training(recompute=Recompute.SELECTIVE, attention=Attention.AS_EXPORTED)


def test_selective_recompute_frees_each_cores_two_read_squares_for_its_ops():
    """GPT-2's core is MatMul(Q, Kt) -> Mul(scale) -> Add(mask) -> Softmax -> Cast ->
    MatMul(., V). Without recompute the backward keeps two of its S x S values: the Softmax's
    input (its gradient reads it) and the Cast's result (the PV MatMul's gradient for V reads
    it); the Mul's and Add's gradients read no scores (multilinear by a constant, linear),
    the Cast's none. Selective recompute runs the first five again in each of the 2 layers:
    frees 2 layers x 2 values x batch·heads·S·S bf16 bytes, for their forward compute."""
    graph = load_graph(GPT2, DIMS, AS_EXPORTED)
    recomputed = [op for op in graph.ops if op.attr(RECOMPUTE_OF, "")]
    assert [op.type for op in recomputed] == ["MatMul", "Mul", "Add", "Softmax", "Cast"] * 2
    assert all(graph.phase(op.name) == "backward" for op in recomputed)
    planned = auto_plan(graph, make_cluster(mesh="1"))
    figures = replay_figures(graph, planned.plan, planned.cost)
    batch, heads, seq = 2, 4, 16
    assert figures.freed_bytes == 2 * 2 * batch * heads * seq * seq * 2
    head_dim = graph.values[recomputed[0].inputs[0]].shape[-1]
    scores = planned.cost.ops[recomputed[0].name]
    assert scores.flops == 2 * batch * heads * seq * seq * head_dim
    originals = [graph.op_by_name[str(op.attr(RECOMPUTE_OF))] for op in recomputed]
    assert figures.added_s == pytest.approx(
        sum(planned.cost.ops[op.name].seconds for op in originals)
    )
    assert figures.added_s + figures.base_s == pytest.approx(planned.cost.compute_time_s)


def test_selective_recompute_lowers_the_peak_where_the_scores_dominate():
    cluster = make_cluster(mesh="1")
    peaks = {}
    for recompute in (Recompute.NONE, Recompute.SELECTIVE):
        training = Training(recompute=recompute, attention=Attention.AS_EXPORTED)
        graph = load_graph(GPT2, {"batch": 8, "seq": 256}, training)
        planned = auto_plan(graph, cluster)
        peaks[recompute] = planned.cost.memory_bytes_per_device
    assert peaks[Recompute.SELECTIVE] < peaks[Recompute.NONE]


def test_fused_attention_recomputes_no_core_selectively():
    """A flash kernel keeps no S x S tensor and its backward recomputes the core already."""
    fused = Training(recompute=Recompute.SELECTIVE, attention=Attention.FUSED)
    graph = load_graph(GPT2, DIMS, fused)
    assert not [op for op in graph.ops if op.attr(RECOMPUTE_OF, "")]
    ladder = [t.recompute_text for t in recompute_ladder(fused)]
    assert ladder == ["none", "selective-op", "layers:4", "layers:2", "layers"]
    assert [t.recompute_text for t in recompute_ladder(AS_EXPORTED)] == [
        "none", "selective", "selective-op", "layers:4", "layers:2", "layers"
    ]  # fmt: skip


def test_every_kth_layer_recomputes_the_first_of_each_k():
    graph = load_graph(GPT2, DIMS, Training(recompute=Recompute.LAYERS, every=2))
    layers = {
        str(op.attr(RECOMPUTE_OF)).split("/")[3] for op in graph.ops if op.attr(RECOMPUTE_OF, "")
    }
    assert layers == {"h.0"}


def _plan(memory: int | None, recompute: Recompute) -> PlanDocument:
    budget = None if memory is None else str(memory)
    request = PlanRequest(
        model_path=GPT2, cluster=make_cluster(mesh="2x2", memory=budget),
        dims={"batch": 8, "seq": 32}, time_limit=300,
        training=Training(recompute=recompute, attention=Attention.AS_EXPORTED),
    )  # fmt: skip
    return plan_request(request).document


def test_auto_recomputes_exactly_when_the_budget_requires_it():
    """The least memory any plan without recompute needs is the line: just above it (2 %:
    at the line itself the proof takes CP-SAT minutes), none; a byte below it, a
    recomputation whose plan fits, and whose step is no slower than that of the one
    replaying the least compute (selective: what `auto` chose before it compared steps)."""
    with pytest.raises(InfeasibleError) as refused:
        _plan(2**20, Recompute.NONE)
    lowest = refused.value.lowest
    assert lowest is not None and lowest.peak == lowest.bound  # proven optimal
    at = _plan(lowest.peak * 102 // 100, Recompute.AUTO)
    assert at.training is not None and at.training.recompute is Recompute.NONE
    assert "Recomputation" not in (at.story or "")
    below = _plan(lowest.peak - 1, Recompute.AUTO)
    assert below.training is not None and below.training.recompute is not Recompute.NONE
    assert below.cost is not None and below.cost.memory_bytes_per_device < lowest.peak
    cheapest = _plan(lowest.peak - 1, Recompute.SELECTIVE).cost
    assert cheapest is not None and below.cost.step_time_s <= cheapest.step_time_s
    story = below.story or ""
    assert ", chosen by the search: frees " in story
    assert re.search(r"\bnone\b[^;]*: no plan fits", story)  # `none and layers:4: no plan fits`
    assert f"({format_seconds(below.cost.step_time_s)} a step)" in story


def test_the_story_says_the_recomputation_with_its_figures():
    figures = ReplayFigures(freed_bytes=31 * 2**30, added_s=1.0, base_s=25.0)
    assert replay_text(Training(recompute=Recompute.LAYERS, every=4), figures, True) == (
        "Recomputation: layer recompute (every 4th layer), chosen by the search: "
        "frees 31.00 GiB per device for 4.0 % more compute."
    )
    assert replay_text(Training(recompute=Recompute.SELECTIVE_OP), figures, False) == (
        "Recomputation: op-level selective recompute (each layer but every other linear matmul "
        "and its attention kernel), as asked: frees 31.00 GiB per device for 4.0 % more "
        "compute."
    )


@pytest.mark.parametrize(
    "text", ["sometimes", "selective:2", "layers:0", "layers:x", "auto:1"]
)  # fmt: skip
def test_a_bad_recompute_names_the_choices(text):
    with pytest.raises(TrainingError) as error:
        Training.parse(recompute=text)
    assert str(error.value) == (
        f"unknown recompute {text!r}; choose one of: none, selective, selective-op, layers, "
        "layers:K (every K-th layer), auto"
    )


def test_layers_every_k_round_trips_through_the_document_text():
    training = Training.parse(recompute="layers:4")
    assert (training.recompute, training.every) == (Recompute.LAYERS, 4)
    assert training.to_json()["recompute"] == "layers:4"
    assert Training.parse(recompute=training.recompute_text) == training
    assert Training.parse().recompute is Recompute.AUTO


def _small_decoder(path: Path, layers: int = 2) -> Path:
    """models/make_models.py's shape-only decoder, `layers` of hidden 64 (the 70B's shape)."""
    spec = importlib.util.spec_from_file_location("make_models", MODELS / "make_models.py")
    assert spec is not None and spec.loader is not None
    make_models = importlib.util.module_from_spec(spec)
    sys.modules["make_models"] = make_models  # its dataclasses look it up
    spec.loader.exec_module(make_models)
    built = make_models.build_decoder_shape_only(layers, hidden=64, heads=4, ffn=128, vocab=128)
    onnx.save(built.proto, path)
    return path


def test_a_recomputed_layer_gathers_its_sequence_split_input_again(tmp_path):
    """Sequence parallelism on mesh 2 with layer recompute: each layer's input (the residual
    stream, B x S x H = 2 x 16 x 64 bf16) held split on the sequence and read gathered (the
    layer's RMSNorm and residual Add computed on it whole). The recompute gathers the input
    again, as Megatron does, rather than keep the forward's gathered copy to the backward:
    at the backward's start only the split inputs (2 x 2048 bytes) are live of them, no
    gathered copy (2 x 4096 bytes before), and each input is all-gathered twice (forward,
    recompute)."""
    path = _small_decoder(tmp_path / "decoder.onnx")
    graph = load_graph(path, {"batch": 2, "seq": 16}, Training(recompute=Recompute.LAYERS))
    inputs = ("embed.out", "layers.0.mlp_residual")
    pins = []
    for name in inputs:
        pins += [Annotation(name, Sharding(((), (0,), ()))),
                 Annotation(name, Sharding(), for_users=True)]  # fmt: skip
    planned = auto_plan(graph, make_cluster(mesh="2"), pins)
    program = planned.program
    gathers = [
        (program.tensors[c.source].value, c.collective.kind)
        for c in program.communications
        if program.tensors[c.source].value in inputs
    ]
    assert sorted(gathers) == sorted(2 * [(n, CollectiveKind.ALL_GATHER) for n in inputs])
    backward = next(
        i for i, s in enumerate(program.steps)
        if isinstance(s, Compute) and graph.phase(s.op.name) != "forward"
    )  # fmt: skip
    live = next(live for i, _, live in _walk_memory(program) if i == backward)
    kept = {n: b for n, b in live.items() if program.tensors[n].value in inputs}
    assert kept == dict.fromkeys(inputs, 2 * 8 * 64 * 2)
