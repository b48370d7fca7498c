"""Pipeline schedules: the order each stage runs its micro-batches' forward and backward
passes in, and what that order costs, the step's critical path and the activations in flight.

A pipeline splits a model's layers into `p` stages along a mesh axis, one stage per position
on it, and a step's batch into `m` micro-batches. Each stage runs a forward pass per
micro-batch, sends the boundary activation to the next stage, and later a backward pass that
sends the boundary's gradient back. The schedules (see docs/concepts/pipeline.md for the
sources):

- `gpipe` (GPipe): every forward, then every backward; a stage keeps all `m` micro-batches'
  activations until their backward.
- `1f1b` (PipeDream-Flush): stage `s` (0-based) runs `p - s - 1` forwards, then alternates one
  forward and one backward, then drains; it keeps at most `p - s` micro-batches in flight.
- `interleaved` (Megatron-LM's interleaved 1F1B): each device holds `v` chunks of layers
  (virtual stages `s, s + p, ..., s + (v - 1) p`), run in Megatron's order; the bubble shrinks
  by `v` for more p2p sends and more activations in flight.
- `zb-h1` (ZB-H1, Qi et al. 2023, "Zero Bubble Pipeline Parallelism"; torch's
  `ScheduleInterleavedZeroBubble` with one stage a device runs this order): the backward split
  into the input gradient `B`, which the stage before waits for, and the weight gradient `W`,
  which nothing waits for. 1F1B's order with `B` in place of the whole backward, and stage `s`
  runs a `W` (the oldest pending) after each `B` once it has run `s` of them, the rest after
  its last `B`: the deferred `W`s fill the drain's idle time. A micro-batch's activations are
  held until its `W`, so every stage keeps up to `p` (1F1B's first stage's peak).

The step time is not a formula: `simulate` runs the schedule's order against the data
dependencies (a micro-batch's forward on a stage after its forward on the one before, plus the
send; its backward after the backward on the one after) and takes the critical path, so
unequal stages and sends are priced as they fall. With equal stages and free sends it is the
textbook `(m + p - 1) (f + b)` (GPipe, 1F1B), `(m + (p - 1) / v) (f + b)` (interleaved),
`m (f + b) + (p - 1) (f + b - 2 w)` (ZB-H1, `b` the whole backward, `w` its weight gradient's
share, at most `b / 2`: the bubble a third of 1F1B's where f = b - w = w).

Worked example: p = 2, m = 2, f = 1, b = 2 per micro-batch, free sends, GPipe. Stage 0 runs
F0 [0, 1], F1 [1, 2]; stage 1 F0 [1, 2], F1 [2, 3], B0 [3, 5], B1 [5, 7]; stage 0 B0 [5, 7],
B1 [7, 9]. Step 9 = (2 + 2 - 1) * 3; each stage is busy 6 of 9 s: bubble 1/3 = (p-1)/(m+p-1).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from autoshard.errors import PipelineError


class ScheduleKind(enum.StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"


_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B",
          "zb-h1": "ZB-H1 zero bubble"}  # fmt: skip
CHOICES = "gpipe, 1f1b, interleaved[:V], zb-h1"
"""The schedules `--schedule` takes, as its error lists them."""


@dataclass(frozen=True)
class Schedule:
    """A schedule and its virtual stages per device (`interleaved` only, at least 2)."""

    kind: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    virtual: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ScheduleKind(self.kind))
        if self.kind is ScheduleKind.INTERLEAVED:
            if self.virtual < 2:
                raise PipelineError(
                    f"interleaved schedule needs at least 2 virtual stages, got {self.virtual}"
                )
        elif self.virtual != 1:
            raise PipelineError(f"schedule {self.kind} has no virtual stages; use interleaved:V")

    @staticmethod
    def parse(text: str) -> Schedule:
        """`gpipe`, `1f1b`, `interleaved` (2 virtual stages), `interleaved:V` or `zb-h1`."""
        name, _, virtual = text.strip().lower().partition(":")
        choices = CHOICES
        try:
            kind = ScheduleKind(name)
        except ValueError:
            raise PipelineError(f"unknown schedule {text!r}; choose one of: {choices}") from None
        if not virtual:
            return Schedule(kind, 2 if kind is ScheduleKind.INTERLEAVED else 1)
        if kind is not ScheduleKind.INTERLEAVED or not virtual.isdigit():
            raise PipelineError(f"unknown schedule {text!r}; choose one of: {choices}")
        return Schedule(kind, int(virtual))

    @property
    def splits_backward(self) -> bool:
        """Whether the backward runs as two passes, the input gradient and, later, the
        weight gradient (zero-bubble schedules)."""
        return self.kind is ScheduleKind.ZB_H1

    def __str__(self) -> str:
        """As the story says it: `1F1B`, `interleaved 1F1B, 2 virtual stages each`."""
        name = _NAMES[self.kind.value]
        if self.kind is ScheduleKind.INTERLEAVED:
            return f"{name}, {self.virtual} virtual stages each"
        return name

    @property
    def flag(self) -> str:
        """As `--schedule` takes it."""
        if self.kind is ScheduleKind.INTERLEAVED:
            return f"interleaved:{self.virtual}"
        return self.kind.value


@dataclass(frozen=True)
class Pipeline:
    """`stages` pipeline stages (one per position on the pipeline axis), `micro_batches` per
    step, run in `schedule`'s order."""

    stages: int
    micro_batches: int
    schedule: Schedule = Schedule()

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise PipelineError(f"a pipeline needs at least 1 stage, got {self.stages}")
        if self.micro_batches < 1:
            raise PipelineError(f"micro-batches must be at least 1, got {self.micro_batches}")
        interleaved = self.schedule.kind is ScheduleKind.INTERLEAVED
        if interleaved and self.micro_batches % self.stages:
            raise PipelineError(
                f"interleaved schedule needs micro-batches divisible by the {self.stages} "
                f"stages, got {self.micro_batches}; use a multiple of {self.stages} or 1f1b"
            )

    def __str__(self) -> str:
        return (f"pipeline of {self.stages} stages ({self.schedule}, {self.micro_batches} "
                f"micro-batches)")  # fmt: skip


@dataclass(frozen=True)
class StageTime:
    """Seconds one stage (or one chunk of an interleaved stage) spends on one micro-batch: its
    forward, its whole backward (zero for inference), and of that the weight gradient's share
    (what a zero-bubble schedule defers: the ops nothing before them waits for)."""

    forward: float
    backward: float = 0.0
    weight: float = 0.0


@dataclass(frozen=True)
class Pass:
    """One pass of the schedule: the forward (or backward) of `micro_batch` on virtual stage
    `chunk` of its device (0 outside interleaved); a zero-bubble schedule's backward is two
    passes, the input gradient and, `weight`, the weight gradient."""

    forward: bool
    micro_batch: int
    chunk: int = 0
    weight: bool = False

    def __str__(self) -> str:
        chunk = f".{self.chunk}" if self.chunk else ""
        kind = "F" if self.forward else "W" if self.weight else "B"
        return f"{kind}{self.micro_batch}{chunk}"


def order(pipeline: Pipeline, stage: int, training: bool = True) -> tuple[Pass, ...]:
    """The passes stage `stage` runs, in order (forwards only when not `training`: an
    interleaved stage's every chunk, in Megatron's order)."""
    p, m = pipeline.stages, pipeline.micro_batches
    v, kind = pipeline.schedule.virtual, pipeline.schedule.kind
    if kind is ScheduleKind.INTERLEAVED:  # Megatron's: groups of p micro-batches, chunk by chunk
        fs = [Pass(True, (k // (p * v)) * p + k % p, (k % (p * v)) // p) for k in range(m * v)]
        if not training:
            return tuple(fs)
        bs = [Pass(False, (k // (p * v)) * p + k % p, v - 1 - (k % (p * v)) // p)
              for k in range(m * v)]  # fmt: skip
        warmup = min((p - stage - 1) * 2 + (v - 1) * p, m * v)
    elif not training or kind is ScheduleKind.GPIPE:
        forwards = [Pass(True, i) for i in range(m)]
        return tuple(forwards + ([Pass(False, i) for i in range(m)] if training else []))
    elif kind is ScheduleKind.ZB_H1:
        return _zero_bubble(p, m, stage)
    else:
        fs = [Pass(True, i) for i in range(m)]
        bs = [Pass(False, i) for i in range(m)]
        warmup = min(p - stage - 1, m)
    found = fs[:warmup]
    for k in range(warmup, len(fs)):
        found += [fs[k], bs[k - warmup]]
    return tuple(found + bs[len(fs) - warmup :])


def _zero_bubble(p: int, m: int, stage: int) -> tuple[Pass, ...]:
    """ZB-H1's order for `stage` (torch's `_get_1f1b_rank_ops` with zero bubble and one stage
    a device): 1F1B's, each backward its input gradient, followed by the oldest pending weight
    gradient from the stage's `stage`-th backward on; the rest after the last backward."""
    warmup = min(p - stage - 1, m)
    found = [Pass(True, i) for i in range(warmup)]
    weights = 0
    for j in range(m):
        if warmup + j < m:
            found.append(Pass(True, warmup + j))
        found.append(Pass(False, j))
        if j >= stage:
            found.append(Pass(False, weights, weight=True))
            weights += 1
    return tuple(found + [Pass(False, i, weight=True) for i in range(weights, m)])


@dataclass(frozen=True)
class Timeline:
    """A simulated step: each stage's passes with their start and end (seconds), the step time
    (the critical path) and the activations each stage holds at most, in micro-batches' worth
    of its own layers (a chunk of an interleaved stage counts 1/v; a forward-only step frees
    each micro-batch's activations as it passes on, so holds one)."""

    passes: tuple[tuple[tuple[Pass, float, float], ...], ...]
    step_s: float
    in_flight: tuple[float, ...]
    busy_s: tuple[float, ...]

    @property
    def bubble(self) -> float:
        """The share of the step the stages sit idle, on average (sends count as idle)."""
        if self.step_s <= 0:
            return 0.0
        return 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.step_s)


def simulate(
    pipeline: Pipeline, times: Sequence[StageTime], send_s: float = 0.0, training: bool = True
) -> Timeline:
    """Run `pipeline`'s order with `times` per micro-batch and `send_s` seconds per boundary
    send (an activation forward, its gradient backward): each pass starts when its stage is
    free and its input has arrived. `times` holds each stage's (an interleaved stage's chunks
    then share it evenly) or each virtual stage's (`p * v`: chunk `c` of stage `s` at
    `c * p + s`, chunks holding different layers or the embedding and the head)."""
    p, v = pipeline.stages, pipeline.schedule.virtual
    if len(times) not in (p, p * v):
        raise PipelineError(f"{p} stages of {v} chunks need {p} or {p * v} times, "
                            f"got {len(times)}")  # fmt: skip
    chunk_times = list(times) if len(times) == p * v else [
        StageTime(t.forward / v, t.backward / v, t.weight / v) for _ in range(v) for t in times
    ]  # fmt: skip
    split = pipeline.schedule.splits_backward
    orders = [order(pipeline, s, training) for s in range(p)]
    done: dict[tuple[str, int, int], float] = {}  # (pass kind, micro-batch, virtual) -> end
    placed: list[list[tuple[Pass, float, float]]] = [[] for _ in range(p)]
    free = [0.0] * p
    last = p * v - 1
    while any(len(placed[s]) < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while len(placed[s]) < len(orders[s]):
                step = orders[s][len(placed[s])]
                virtual = step.chunk * p + s
                ready = _ready(step, virtual, last, done, send_s)
                if ready is None:
                    break
                start = max(free[s], ready)
                free[s] = start + _spent(step, chunk_times[virtual], split)
                done[(str(step)[0], step.micro_batch, virtual)] = free[s]
                placed[s].append((step, start, free[s]))
                moved = True
        if not moved:  # an order that waits on itself: a bug in `order`, never the input
            raise AssertionError(f"pipeline {pipeline} deadlocks")
    busy = tuple(sum(end - start for _, start, end in stage) for stage in placed)
    return Timeline(
        passes=tuple(tuple(stage) for stage in placed), step_s=max(free), busy_s=busy,
        in_flight=tuple(_in_flight(o, v) if training else 1.0 for o in orders),
    )  # fmt: skip


def _spent(step: Pass, time: StageTime, split: bool) -> float:
    """Seconds `step` takes: the forward, the whole backward, or, where the schedule splits
    it, the input gradient (the backward less the weight gradient) or the weight gradient."""
    if step.forward:
        return time.forward
    if not split:
        return time.backward
    return time.weight if step.weight else time.backward - time.weight


def _ready(
    step: Pass, virtual: int, last: int, done: dict[tuple[str, int, int], float], send_s: float
) -> float | None:
    """When `step`'s input is there (None: not yet computed): the previous virtual stage's
    forward plus a send, the next one's backward plus a send (the last stage's backward starts
    from its own forward), a weight gradient after its own stage's input gradient."""
    if step.forward:
        if virtual == 0:
            return 0.0
        before = done.get(("F", step.micro_batch, virtual - 1))
        return None if before is None else before + send_s
    if step.weight:
        return done.get(("B", step.micro_batch, virtual))
    if virtual == last:
        return done.get(("F", step.micro_batch, virtual))
    after = done.get(("B", step.micro_batch, virtual + 1))
    return None if after is None else after + send_s


def _in_flight(passes: Sequence[Pass], virtual: int) -> float:
    """The most activations held at once: forwards run whose backward (its weight gradient,
    where the schedule splits it) has not."""
    ends = any(step.weight for step in passes)
    held, most = 0, 0
    for step in passes:
        if step.forward:
            held += 1
        elif step.weight or not ends:
            held -= 1
        most = max(most, held)
    return most / virtual


def ideal_bubble(pipeline: Pipeline) -> float:
    """The textbook bubble of equal stages and free sends: `(p - 1) / (v m + p - 1)` of the
    step (GPipe and 1F1B: v = 1). Not ZB-H1's: it depends on the weight gradients' share
    (the module's docstring), which `simulate` takes."""
    if pipeline.schedule.splits_backward:
        raise PipelineError(f"{pipeline.schedule.flag} has no bubble without stage times")
    p, m, v = pipeline.stages, pipeline.micro_batches, pipeline.schedule.virtual
    return (p - 1) / (v * m + p - 1)
