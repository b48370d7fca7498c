"""The pipeline schedules: orders, critical paths, bubbles and activations in flight, against
hand-run timelines (each worked out pass by pass in the comments)."""

from fractions import Fraction

import pytest

from autoshard.cost.schedule import (
    Pipeline,
    Schedule,
    ScheduleKind,
    StageTime,
    ideal_bubble,
    order,
    simulate,
)
from autoshard.errors import PipelineError

GPIPE, ONE_F = Schedule(ScheduleKind.GPIPE), Schedule(ScheduleKind.ONE_F_ONE_B)
EQUAL = [StageTime(1.0, 2.0)] * 4
# Stage 2 twice as slow as the others.
UNEQUAL = [StageTime(1.0, 2.0), StageTime(1.0, 2.0), StageTime(2.0, 4.0), StageTime(1.0, 2.0)]


def test_1f1b_order_warms_up_p_minus_s_minus_1_forwards():
    pipeline = Pipeline(4, 4, ONE_F)
    assert [" ".join(map(str, order(pipeline, s))) for s in range(4)] == [
        "F0 F1 F2 F3 B0 B1 B2 B3",
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]


def test_interleaved_order_is_megatrons():
    # p = 2, v = 2, m = 2: stage 0 warms up (2 - 0 - 1) * 2 + (2 - 1) * 2 = 4 forwards.
    pipeline = Pipeline(2, 2, Schedule(ScheduleKind.INTERLEAVED, 2))
    assert " ".join(map(str, order(pipeline, 0))) == "F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1"
    assert " ".join(map(str, order(pipeline, 1))) == "F0 F1 F0.1 B0.1 F1.1 B1.1 B0 B1"


@pytest.mark.parametrize("schedule", [GPIPE, ONE_F], ids=str)
def test_equal_stages_take_m_plus_p_minus_1_slots(schedule):
    # Each slot is f + b = 3 s: (4 + 4 - 1) * 3 = 21; bubble 3/7, the textbook (p-1)/(m+p-1).
    timeline = simulate(Pipeline(4, 4, schedule), EQUAL)
    assert timeline.step_s == 21.0
    assert timeline.bubble == pytest.approx(3 / 7)
    assert timeline.bubble == pytest.approx(ideal_bubble(Pipeline(4, 4, schedule)))


def test_more_micro_batches_shrink_the_bubble():
    timeline = simulate(Pipeline(4, 8, ONE_F), EQUAL)
    assert timeline.step_s == 33.0  # (8 + 3) * 3
    assert timeline.bubble == pytest.approx(3 / 11)


def test_gpipe_unequal_stages():
    # Forwards: stage 2 (f = 2) ends F0..F3 at 4, 6, 8, 10; stage 3 ends F3 at 11. Backwards:
    # stage 3 runs B0..B3 over [11, 19]; stage 2 (b = 4) over [13, 29]; stage 1 ends B3 at 31;
    # stage 0 at 33. Busy 12 + 12 + 24 + 12 = 60 of 4 * 33: bubble 6/11.
    timeline = simulate(Pipeline(4, 4, GPIPE), UNEQUAL)
    assert timeline.step_s == 33.0
    assert timeline.bubble == pytest.approx(6 / 11)


def test_1f1b_unequal_stages():
    # Stage 3: F0 [4, 5] B0 [5, 7] F1 [7, 8] B1 [8, 10] F2 [13, 14] B2 [14, 16] F3 [19, 20]
    # B3 [20, 22]; stage 2: F0 [2, 4] F1 [4, 6] B0 [7, 11] F2 [11, 13] B1 [13, 17] F3 [17, 19]
    # B2 [19, 23] B3 [23, 27]; stage 1 ends B3 at 29, stage 0 at 31. Bubble 1 - 60/124.
    timeline = simulate(Pipeline(4, 4, ONE_F), UNEQUAL)
    assert timeline.step_s == 31.0
    assert timeline.bubble == pytest.approx(16 / 31)
    stage2 = [(str(step), start, end) for step, start, end in timeline.passes[2]]
    assert stage2[:3] == [("F0", 2.0, 4.0), ("F1", 4.0, 6.0), ("B0", 7.0, 11.0)]


def test_sends_lie_on_the_critical_path():
    # p = 2, m = 2, f = 1, b = 2, 0.5 s a send: stage 1 F0 [1.5, 2.5] F1 [2.5, 3.5]
    # B0 [3.5, 5.5] B1 [5.5, 7.5]; stage 0 B0 [6, 8] B1 [8, 10].
    timeline = simulate(Pipeline(2, 2, GPIPE), [StageTime(1.0, 2.0)] * 2, send_s=0.5)
    assert timeline.step_s == 10.0


def test_interleaving_divides_the_bubble_by_v():
    # Equal stages, free sends: (m + (p - 1) / v) (f + b) = (8 + 3/2) * 3.
    pipeline = Pipeline(4, 8, Schedule(ScheduleKind.INTERLEAVED, 2))
    timeline = simulate(pipeline, EQUAL)
    assert timeline.step_s == pytest.approx(28.5)
    assert timeline.bubble == pytest.approx(ideal_bubble(pipeline)) == pytest.approx(3 / 19)


@pytest.mark.parametrize(
    ("schedule", "micro_batches", "held"),
    [
        (GPIPE, 8, [8, 8, 8, 8]),  # every micro-batch until the backwards
        (ONE_F, 8, [4, 3, 2, 1]),  # p - s
        (ONE_F, 2, [2, 2, 2, 1]),  # never more than m
        # Megatron: stage s warms up 2 (p - s - 1) + (v - 1) p chunks, each 1/v of a stage;
        # stage 0 holds p (1 + (p - 1) / (p v)) = 5.5 micro-batches' worth (Korthikanti 2022).
        (Schedule(ScheduleKind.INTERLEAVED, 2), 8, [5.5, 4.5, 3.5, 2.5]),
    ],
    ids=["gpipe", "1f1b", "1f1b-few", "interleaved-2"],
)
def test_activations_in_flight(schedule, micro_batches, held):
    timeline = simulate(Pipeline(4, micro_batches, schedule), EQUAL)
    assert list(timeline.in_flight) == held


def test_forward_only_step():
    timeline = simulate(Pipeline(4, 4, ONE_F), EQUAL, training=False)
    assert timeline.step_s == 7.0  # (m + p - 1) f
    assert timeline.in_flight == (1.0,) * 4


def test_forward_only_interleaved_step_runs_every_chunk():
    """Forward only, interleaved 1F1B with 2 chunks a stage: each stage runs both chunks of
    every micro-batch, in Megatron's order (groups of p micro-batches, chunk by chunk), and the
    step is the textbook (m + (p - 1) / v) f = (4 + 3 / 2) 1 s."""
    pipeline = Pipeline(4, 4, Schedule(ScheduleKind.INTERLEAVED, 2))
    assert [str(p) for p in order(pipeline, 0, training=False)] == [
        "F0", "F1", "F2", "F3", "F0.1", "F1.1", "F2.1", "F3.1"]  # fmt: skip
    timeline = simulate(pipeline, EQUAL, training=False)
    assert timeline.step_s == 5.5
    assert timeline.in_flight == (1.0,) * 4


@pytest.mark.parametrize(
    ("text", "shown"),
    [("gpipe", "GPipe"), ("1f1b", "1F1B"), ("interleaved", "interleaved 1F1B, 2 virtual "
     "stages each"), ("interleaved:4", "interleaved 1F1B, 4 virtual stages each")],
)  # fmt: skip
def test_schedule_parse(text, shown):
    assert str(Schedule.parse(text)) == shown
    assert Schedule.parse(Schedule.parse(text).flag) == Schedule.parse(text)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Schedule.parse("zb-v"), "unknown schedule 'zb-v'; choose one of: gpipe, "
         "1f1b, interleaved[:V], zb-h1"),
        (lambda: Schedule.parse("zb-h1:2"), "unknown schedule 'zb-h1:2'"),
        (lambda: Schedule.parse("1f1b:2"), "unknown schedule '1f1b:2'"),
        (lambda: Schedule.parse("interleaved:1"), "at least 2 virtual stages, got 1"),
        (lambda: Pipeline(4, 6, Schedule.parse("interleaved")), "micro-batches divisible by "
         "the 4 stages, got 6"),
        (lambda: Pipeline(0, 6), "at least 1 stage"),
    ],
    ids=["unknown", "zb-virtual", "virtual-not-interleaved", "one-virtual", "interleaved-m",
         "no-stages"],
)  # fmt: skip
def test_bad_pipelines(make, message):
    with pytest.raises(PipelineError, match=message.replace("[", r"\[").replace("]", r"\]")):
        make()


def test_ideal_bubble_formula():
    assert Fraction(ideal_bubble(Pipeline(8, 32))).limit_denominator(100) == Fraction(7, 39)
