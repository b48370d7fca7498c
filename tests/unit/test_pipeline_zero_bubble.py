"""ZB-H1 (zero bubble: the backward's weight gradients deferred into the drain) and each
interleaved chunk's own time in the schedule's simulation, against timelines worked out by
hand; the backward split read off a training step's ops."""

import pytest

from autoshard.cost.schedule import (
    Pass,
    Pipeline,
    Schedule,
    ScheduleKind,
    StageTime,
    order,
    simulate,
)
from autoshard.pipeline import load_graph
from autoshard.search.backward_split import weight_gradient_ops
from autoshard.search.pipelined import layer_runs, stage_of_ops
from autoshard.training import Training

ZB = Schedule(ScheduleKind.ZB_H1)
ONE_F_ONE_B = Schedule(ScheduleKind.ONE_F_ONE_B)
EQUAL = StageTime(forward=1.0, backward=2.0, weight=1.0)  # F = B = W = 1 s


def _starts(timeline, stage):
    return " ".join(f"{step}@{start:g}" for step, start, _ in timeline.passes[stage])


def test_zb_h1_timeline_by_hand():
    """4 stages, 4 micro-batches, F = B = W = 1 s, free sends. Stage s runs 3 - s forwards,
    then F, B (and, from its s-th B on, the oldest W); stage 3's Ws wait for the drain, where
    1F1B would sit idle. Every stage idles 3 s = (p - 1)(F + B - W), a third of 1F1B's 9 s =
    (p - 1)(F + B + W): step 15 against 21."""
    timeline = simulate(Pipeline(4, 4, ZB), [EQUAL] * 4)
    assert _starts(timeline, 0) == ("F0@0 F1@1 F2@2 F3@3 B0@7 W0@8 B1@9 W1@10 B2@11 W2@12 "
                                    "B3@13 W3@14")  # fmt: skip
    assert _starts(timeline, 3) == ("F0@3 B0@4 F1@5 B1@6 F2@7 B2@8 F3@9 B3@10 W0@11 W1@12 "
                                    "W2@13 W3@14")  # fmt: skip
    assert timeline.step_s == 15.0
    assert [timeline.step_s - busy for busy in timeline.busy_s] == [3.0] * 4
    one = simulate(Pipeline(4, 4, ONE_F_ONE_B), [EQUAL] * 4)
    assert one.step_s == 21.0 and [one.step_s - b for b in one.busy_s] == [9.0] * 4


@pytest.mark.parametrize(("m", "zb", "one"), [(4, 15.0, 21.0), (8, 27.0, 33.0), (12, 39.0, 45.0)])
def test_zb_h1_bubble_is_a_third_of_1f1b_s(m, zb, one):
    """Step m (F + B + W) + (p - 1)(F + B - W) against (m + p - 1)(F + B + W)."""
    ours = simulate(Pipeline(4, m, ZB), [EQUAL] * 4)
    theirs = simulate(Pipeline(4, m, ONE_F_ONE_B), [EQUAL] * 4)
    assert (ours.step_s, theirs.step_s) == (zb, one)
    idle, idle_1f1b = ours.bubble * ours.step_s, theirs.bubble * theirs.step_s
    assert idle == pytest.approx(idle_1f1b / 3)


def test_zb_h1_keeps_1f1b_s_peak():
    """A micro-batch's activations are held until its W: every stage keeps up to p, the most
    1F1B's first stage keeps (its stage s keeps p - s)."""
    assert simulate(Pipeline(4, 8, ZB), [EQUAL] * 4).in_flight == (4.0,) * 4
    assert simulate(Pipeline(4, 8, ONE_F_ONE_B), [EQUAL] * 4).in_flight == (4.0, 3.0, 2.0, 1.0)


def test_without_weight_gradients_zb_h1_is_1f1b():
    """No W to defer (w = 0): the same step as 1F1B."""
    times = [StageTime(1.0, 2.0)] * 4
    zb = simulate(Pipeline(4, 6, ZB), times)
    assert zb.step_s == simulate(Pipeline(4, 6, ONE_F_ONE_B), times).step_s == 27.0


@pytest.mark.parametrize(("p", "m"), [(p, m) for p in (2, 3, 4) for m in (1, 2, 3, 5, 8)])
def test_zb_h1_order_is_torch_s(p, m):
    """Each stage's order is torch's `ScheduleInterleavedZeroBubble`'s with one stage a rank
    (its private `_get_1f1b_rank_ops`, the zero-bubble branch)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for rank in range(p):
        warmup = min(p - 1 - rank, m)
        actions = schedules._get_1f1b_rank_ops(
            1, p, warmup, m - warmup, warmup, rank, lambda _, r=rank: r, lambda _, r=rank: r,
            num_1f1b_microbatches=rank, enable_zero_bubble=True,
        )  # fmt: skip
        kinds = {"F": (True, False), "I": (False, False), "W": (False, True)}
        theirs = [Pass(kinds[a.computation_type.value][0], a.microbatch_index,
                       weight=kinds[a.computation_type.value][1])
                  for a in actions if a]  # fmt: skip
        assert list(order(Pipeline(p, m, ZB), rank)) == theirs


def test_unequal_chunks_forward_by_hand():
    """4 stages of 2 chunks, 4 micro-batches, forward only, free sends: chunk 0 (the
    embedding) 2 s, chunk 7 (the head) 3 s, the others 1 s. Stage 0 runs F0..F3 of chunk 0
    [0, 8], then chunk 4 from 8; stages 1-3 follow a second behind; stage 3's chunk 7 starts
    F0 at 11 (chunk 6's F0 ends at 11) and runs back to back: 11 + 4 x 3 = 23. Split evenly
    over a stage's chunks (the stage's 4 s as 2 + 2) it would end elsewhere."""
    pipeline = Pipeline(4, 4, Schedule(ScheduleKind.INTERLEAVED, 2))
    chunks = [StageTime(2.0)] + [StageTime(1.0)] * 6 + [StageTime(3.0)]
    timeline = simulate(pipeline, chunks, training=False)
    assert _starts(timeline, 0) == "F0@0 F1@2 F2@4 F3@6 F0.1@8 F1.1@9 F2.1@10 F3.1@11"
    assert _starts(timeline, 3) == "F0@4 F1@6 F2@8 F3@10 F0.1@11 F1.1@14 F2.1@17 F3.1@20"
    assert timeline.step_s == 23.0
    assert timeline.busy_s == (12.0, 8.0, 8.0, 16.0)
    stages = [StageTime(3.0), StageTime(2.0), StageTime(2.0), StageTime(4.0)]
    assert simulate(pipeline, stages, training=False).step_s != 23.0


def test_equal_chunks_are_the_stage_split_evenly():
    """A time per chunk, each half its stage's, prices a training step as the stage's time."""
    pipeline = Pipeline(4, 8, Schedule(ScheduleKind.INTERLEAVED, 2))
    stages = [StageTime(1.0 + s, 2.0 + s) for s in range(4)]
    chunks = [StageTime(t.forward / 2, t.backward / 2) for _ in range(2) for t in stages]
    assert simulate(pipeline, chunks, 0.25) == simulate(pipeline, stages, 0.25)


def test_weight_gradients_are_read_off_the_step(tmp_path):
    """The 4-layer MLP's step: each layer's dW (`Grad[operand=1]` of its MatMul) and its bias
    gradient feed only the update: W; each dX, the ReLU's and the Add's gradients, which the
    layer before reads, and the loss's gradient: B. The embedding's dW is W, and nothing
    reads the first layer's input gradient but the embedding's dW, in another part: B."""
    from tests.e2e.test_pipelined_run import mlp

    graph = load_graph(mlp(tmp_path), {"batch": 4}, Training())
    count, runs = layer_runs(graph)
    parts = (range(0, 0), *(range(j, j + 1) for j in range(count)), range(count, count))
    deferred = weight_gradient_ops(graph, stage_of_ops(graph, parts, runs))
    names = {graph.ops[i].name for i in deferred}
    weights = {name for i in deferred for name in graph.ops[i].outputs}
    assert weights == {"embed@grad0", "head@grad0", *(f"w{i}@grad0" for i in range(4)),
                       *(f"b{i}@grad0" for i in range(4))}, names  # fmt: skip


def _stage(forward_s, backward_s=0.0, weight_s=0.0):
    return {"forward_s": forward_s, "backward_s": backward_s, "weight_s": weight_s,
            "update_s": 0.0}  # fmt: skip


def test_the_report_draws_weight_gradients_and_each_chunk_s_time():
    """The HTML timeline simulates the plan document's figures again: ZB-H1's W passes apart
    (the hand-worked 15 s step), an interleaved plan's chunks each at its own time (23 s)."""
    from autoshard.html.stages import timeline_svg

    stages = [{"compute": _stage(1.0, 2.0, 1.0)}] * 4
    block = {"schedule": "zb-h1", "micro_batches": 4, "p2p": {"time_s": 0.0}, "stages": stages}
    drawn = timeline_svg(block)
    assert drawn.count("<title>W") == drawn.count("<title>B") == 16
    assert "0 .. 15000.000 ms: forward, backward, weight gradient, sync + update" in drawn
    chunks = [{"layers": [c, c + 1], "stage": c % 4, "compute": _stage(f)}
              for c, f in enumerate([2.0, 1, 1, 1, 1, 1, 1, 3.0])]  # fmt: skip
    block = {"schedule": "interleaved:2", "micro_batches": 4, "p2p": {"time_s": 0.0},
             "stages": [{"compute": _stage(3.0)}] * 4, "chunks": chunks}  # fmt: skip
    assert "F3.1 20000.000 ms..23000.000 ms" in timeline_svg(block)


def test_the_search_takes_zb_h1_where_it_is_faster_and_fits():
    """4 layers of F = B = W = 1 s on 4 stages, 8 micro-batches: ZB-H1's step 27 s against
    1F1B's 33 (GPipe's 33). The head's activations (300 B a micro-batch, beside a layer's
    100) are kept 4 times on the last stage under ZB-H1 (1600 B), once under 1F1B (400 B):
    under a 1000 B budget 1F1B is the fastest that fits."""
    import dataclasses

    from autoshard.cost.cluster import make_cluster
    from autoshard.search.pipelined import LayerCosts, PipelineAsk
    from autoshard.search.pipesearch import fastest

    costs = LayerCosts(forward=(0.0, 1.0, 1.0, 0.0), backward=(0.0, 2.0, 2.0, 0.0),
                       update=(0.0,) * 4, held=(0,) * 4, activations=(0, 100, 100, 300),
                       send_bytes=0, training=True, weight=(0.0, 1.0, 1.0, 0.0))  # fmt: skip
    cluster = make_cluster("pp=4,dp=1")
    roomy = fastest(costs, dataclasses.replace(cluster, memory=2000), PipelineAsk(0), 4, 8)
    assert (roomy.pipeline.schedule, roomy.step_s) == (ZB, 27.0)
    assert [s.memory_bytes for s in roomy.stages] == [400, 400, 400, 1600]
    assert str(roomy) == "pipeline of 4 stages (ZB-H1 zero bubble, 8 micro-batches, bubble 11 %)"
    tight = fastest(costs, dataclasses.replace(cluster, memory=1000), PipelineAsk(0), 4, 8)
    assert (tight.pipeline.schedule, tight.step_s) == (ONE_F_ONE_B, 33.0)
    assert [s.memory_bytes for s in tight.stages] == [400, 300, 200, 400]


def test_the_summary_names_the_schedule_and_the_deferred_weight_gradients():
    from autoshard.cli.summaries import pipeline_summary

    stage = {"layers": [0, 2], "compute": _stage(1e-3, 2e-3, 0.75e-3),
             "memory": {"bytes_per_device": 1024, "micro_batches_in_flight": 2}}  # fmt: skip
    block = {"mesh": "pp=2,dp=2", "axis": 0, "schedule": "zb-h1", "micro_batches": 4,
             "step_time_s": 0.015, "bubble": 0.1, "memory_budget_bytes": 2048,
             "p2p": {"bytes_per_device_per_micro_batch": 64, "time_s": 1e-6},
             "stages": [stage, stage | {"layers": [2, 4]}]}  # fmt: skip
    lines = pipeline_summary(block).splitlines()
    assert lines[0].startswith("pipeline on mesh pp=2,dp=2 (axis 0): step 15.000 ms (zb-h1, 4 "
                               "micro-batches), bubble 10.0%")  # fmt: skip
    assert lines[2].startswith("  stage 1: layers 2..3, forward 1.000 ms + backward 2.000 ms "
                               "(weight gradients 0.750 ms, deferred) per micro-batch")  # fmt: skip
    assert "deferred" not in pipeline_summary(block | {"schedule": "1f1b"})
