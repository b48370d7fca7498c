"""The search's objective is the program's cost: a reshard several readers need is priced once,
as materialization makes it once (`search.reads`). The cost is compute plus communication: a
training step's time with nothing overlapped, an upper bound of its overlapped step time
(`cost.overlap`, docs/concepts/step-time.md)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from autoshard.analysis.shorten import shortened
from autoshard.cost.cluster import make_cluster
from autoshard.cost.price import price
from autoshard.ir.graph import Graph
from autoshard.ir.onnx_import import import_onnx, unbound_dims
from autoshard.passes.lower import lower
from autoshard.passes.materialize import materialize
from autoshard.search.budget import NoPlanFits, Planned, auto_plan
from autoshard.search.reads import Reading, ValueReads, price_reads
from autoshard.sharding import Sharding
from autoshard.training import Training, training_graph
from autoshard.training.options import Attention, Overlap, Recompute

MODELS = Path(__file__).resolve().parents[2] / "models"
DIMS = {"batch": 8, "seq": 128}
BUNDLED = ["mlp", "cnn", "gpt2", "gpt2_dynamo", "bert", "block_dynamo", "decoder_32l_shape_only"]

R, S0, S1 = Sharding(), Sharding(((0,),)), Sharding(((), (0,)))
RESHARD = {(R, R): 0.0, (R, S1): 1.5, (S0, S0): 0.0, (S0, S1): 1.0, (S0, R): 0.5}


def pricer(_: str, held: tuple[Sharding, ...], need: tuple[Sharding, ...]) -> np.ndarray:
    return np.array([[RESHARD[(h, n)] for n in need] for h in held])


def objective(priced, choice) -> float:
    total = sum(priced.node[g][k] for g, k in enumerate(choice))
    for (a, b), matrix in priced.edges.items():
        if priced.forbidden.get((a, b), np.zeros(matrix.shape, bool))[choice[a], choice[b]]:
            return np.inf
        total += matrix[choice[a], choice[b]]
    return total


def program_cost(held: Sharding, needs: list[Sharding]) -> float:
    """What materialization makes: each distinct sharding read, once, from the held one."""
    return sum(RESHARD[(held, need)] for need in dict.fromkeys(needs))


def test_three_readers_in_three_groups_pay_one_reshard_and_the_optimum_changes() -> None:
    # Group 0 holds x replicated; groups 1..3 each read it: choice 0 reads it split as S1
    # and computes in 1.0, choice 1 reads it whole and computes in 2.0. Priced per reader, S1
    # costs 1.0 + 1.5 > 2.0 each: all read it whole (6.0). Made once, three S1 reads cost
    # 3 * 1.0 + 1.5 = 4.5: the optimum.
    reads = tuple(Reading(g, (S1, R), 1, ("op", g)) for g in (1, 2, 3))
    priced = price_reads([(ValueReads("x", 0, (R,), reads), 1)], [1, 2, 2, 2], pricer)
    assert len(priced.sizes) == 5  # the shared reshard's group
    compute = [np.zeros(1), *[np.array([1.0, 2.0])] * 3]
    for g, seconds in enumerate(compute):
        priced.node[g] += seconds
    best = {}
    for choice in itertools.product(*map(range, priced.sizes)):
        readers = choice[1:4]
        cost = objective(priced, choice)
        best[readers] = min(best.get(readers, np.inf), cost)
    for readers, cost in best.items():
        needs = [(S1, R)[k] for k in readers]
        truth = program_cost(R, needs) + sum((1.0, 2.0)[k] for k in readers)
        assert cost == pytest.approx(truth, rel=1e-12), readers
    assert min(best.values()) == pytest.approx(4.5)
    assert min(best, key=best.__getitem__) == (0, 0, 0)


def test_readers_in_one_group_pay_each_sharding_once() -> None:
    # Group 1 reads x three times: under choice 0 twice as S1 and once whole, under choice 1
    # all three as S1. Held S0: choice 0 costs S0->S1 once and S0->R once, choice 1 S0->S1 once.
    reads = (
        Reading(1, (S1, S1), 1, ("op", 0)),
        Reading(1, (S1, S1), 1, ("op", 1)),
        Reading(1, (R, S1), 1, ("op", 2)),
    )
    priced = price_reads([(ValueReads("x", 0, (S0, R), reads), 2)], [2, 2], pricer)
    assert len(priced.sizes) == 2  # one reader group: nothing shared across groups
    assert priced.edges[(0, 1)].tolist() == [[2 * (1.0 + 0.5), 2 * 1.0], [2 * 1.5, 2 * 1.5]]
    assert priced.edge_moves[(0, 1)].tolist() == [[4, 2], [2, 2]]


def _graph(model: str, training: bool):
    path = MODELS / f"{model}.onnx"
    graph = import_onnx(path, {k: v for k, v in DIMS.items() if k in unbound_dims(path)})
    return training_graph(graph, Training()) if training else graph


# Every bundled model on two meshes with the memory free, on one with a binding budget (BERT's
# binding solve takes minutes on two cores: its free plans stand for it).
CASES = [(m, mesh, False, "free") for m in BUNDLED for mesh in ("2x2", "2x4")]
CASES += [(m, "2x4", False, "binding") for m in BUNDLED if m != "bert"]
CASES += [("mlp", "2x4", True, "binding"), ("gpt2", "2x4", True, "binding")]


@pytest.fixture(scope="module")
def free_plans() -> dict[tuple[str, str, bool], tuple[Graph, Planned]]:
    """Each case's graph and plan with the memory free, made once: a binding case starts
    from the plan its free case checked."""
    return {}


@pytest.mark.parametrize("model, mesh, training, budget", CASES, ids=lambda v: str(v))
def test_the_searched_objective_is_the_programs_cost(
    free_plans, model, mesh, training, budget
) -> None:
    key = (model, mesh, training)
    if key not in free_plans:
        graph = _graph(model, training)
        free_plans[key] = graph, auto_plan(graph, make_cluster(mesh=mesh))
    graph, free = free_plans[key]
    planned = free
    if budget == "binding":
        squeezed = int(free.cost.memory_bytes_per_device * 0.7)
        try:
            planned = auto_plan(graph, make_cluster(mesh=mesh, memory=str(squeezed)))
        except NoPlanFits as none:
            planned = auto_plan(graph, make_cluster(mesh=mesh, memory=str(none.lowest.peak)))
    searched = planned.search.priced.objective(planned.solution.choice)
    cluster = make_cluster(mesh=mesh)
    made = price(materialize(graph, planned.plan), graph, cluster)
    # Sums of the same float terms in another order: equal to rounding.
    assert searched == pytest.approx(made.objective, rel=1e-12, abs=0)
    assert planned.cost.objective == pytest.approx(made.objective, rel=1e-12, abs=0)
    program = lower(graph, planned.plan)
    lowered = price(program, graph, cluster)
    assert lowered.objective == pytest.approx(made.objective, rel=1e-12, abs=0)
    if graph.phases:  # the step with nothing overlapped; overlapped, no longer
        serial = price(program, graph, cluster, overlap=Overlap(enabled=False))
        assert serial.step_time_s == pytest.approx(made.objective, rel=1e-12, abs=0)
        overlapped = price(program, graph, cluster, overlap=Overlap(bucket_mb=0.0))
        assert overlapped.step_time_s <= made.objective * (1 + 1e-12)


def test_a_gradient_sum_is_priced_as_the_program_reduces_it() -> None:
    # Two layers of the shape-only decoder (SwiGLU: gate and up read one normalized value),
    # trained with fused attention on 2x4 with memory free. The gradients of the normalized
    # values are sums of partial sums: the search adds them partial (`search.partials`) and
    # reduces once, and lowering has nothing left to reassociate.
    forward = shortened(_graph("decoder_32l_shape_only", False), 2)
    graph = training_graph(forward, Training(recompute=Recompute.NONE, attention=Attention.FUSED))
    cluster = make_cluster(mesh="2x4")
    planned = auto_plan(graph, cluster)
    summed = [op.name for op in graph.ops if op.name.endswith("@gradsum")]
    assert any(planned.plan.options[name].partial_axes for name in summed)
    searched = planned.search.priced.objective(planned.solution.choice)
    made = price(materialize(graph, planned.plan), graph, cluster)
    assert searched == pytest.approx(made.objective, rel=1e-12, abs=0)
    assert planned.cost.objective == pytest.approx(made.objective, rel=1e-12, abs=0)
