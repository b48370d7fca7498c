"""One device of a pipeline stage's training step, its step list run in two passes per
micro-batch, as a pipeline schedule orders them: the forward, then (later, after other
micro-batches' passes) the backward.

A stage's step list (`execute.stage_training`) is one training step: forward, backward,
gradient sync, update. Its forward pass runs the list up to the first entry that belongs to
the backward: a training op (the loss's gradient, a gradient op, a sync, an update), or a
collective whose source no entry before it made (the received gradient of a send, held
otherwise by the backward). Its backward pass resumes there, inside a segment if it stopped
inside one. Between them the micro-batch's tensors and place are kept (`Pass`), so a stage
can run other micro-batches' passes in between (1F1B); the gradients accumulate over the
micro-batches as the step's do (`TrainingDevice`), and the micro-batch made last (`last` at
`begin`) syncs and updates. On it, a pass also pauses before the first entry that reads a tied
weight's gradient (`tied`, `execute.tied`: summed with the other stages' first, `paused`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from autoshard.execute.train_verify import TrainingDevice
from autoshard.rules.gradient import TRAIN


@dataclass
class Pass:
    """A micro-batch between its forward and its backward: its tensors and place."""

    env: dict[str, Any]
    position: int
    offset: int
    deferred: set[str]
    last: bool
    waiting: set[str]


class StageDevice(TrainingDevice):
    """A `TrainingDevice` whose step list runs as a forward and a backward pass."""

    offset = 0  # the next node of the segment at `position - 1` (a pass stopped inside it)
    forward_only = False  # stop at the first entry of the backward
    tied: frozenset[str] = frozenset()  # tied weights' gradients, summed across stages
    waiting: set[str] = set()  # those not summed yet (the last micro-batch's)
    paused = False  # stopped before an entry reading a gradient in `waiting`

    def begin(self, inputs: Mapping[str, Any], last: bool = True) -> None:
        super().begin(inputs, last)
        self.offset = 0
        self.waiting = set(self.tied) if last else set()

    def save(self) -> Pass:
        """The running micro-batch, kept for its backward."""
        return Pass(self.env, self.position, self.offset, self.deferred, self.last, self.waiting)

    def restore(self, kept: Pass) -> None:
        self.env, self.position, self.offset = kept.env, kept.position, kept.offset
        self.deferred, self.last, self.waiting = kept.deferred, kept.last, kept.waiting

    def made_tied(self) -> list[str]:
        """The tied gradients made and not summed yet."""
        return sorted(n for n in self.waiting if n in self.env)

    def advance(
        self,
        step: int,
        nodes: Mapping[str, list[tuple[str, str]]],
        at: Callable[[int], None] | None = None,
    ) -> int | None:
        """Run up to the next collective (its index) or the end of the pass (None): the end
        of the list, or, with `forward_only`, the first entry of the backward, or an entry
        reading a tied gradient not summed yet (`paused`)."""
        self.paused = False
        while self.position < len(self.steps) or self.offset:
            if self.offset:  # resume inside the segment a forward stopped in
                if self._segment(self.steps[self.position - 1], step, nodes):
                    return None
                continue
            if at is not None:
                at(self.position)
            entry = self.steps[self.position]
            if "collective" in entry:
                j = int(entry["collective"])
                source = self.collectives[j].source
                if self.forward_only and source not in self.env and source not in self.deferred:
                    return None
                if source in self.waiting:
                    self.paused = True
                    return None
                self.position += 1
                if source not in self.deferred:
                    return j
                self.deferred.add(self.collectives[j].target)
                continue
            self.position += 1
            if self._segment(entry, step, nodes):
                return None
        return None

    def _segment(
        self, entry: Mapping[str, Any], step: int, nodes: Mapping[str, list[tuple[str, str]]]
    ) -> bool:
        """Run the segment `entry` from `offset`; whether the forward stopped inside it."""
        listed = nodes[entry["run"]]
        for k in range(self.offset, len(listed)):
            name, kind = listed[k]
            if kind == "Constant" and name not in self.ops:
                continue  # the device's loose constants: in its tensors from the start
            op = self.op(name)
            if self.waiting.intersection(op.inputs):
                self.paused = True
            if self.paused or (self.forward_only and op.domain == TRAIN):
                if k:
                    self.offset = k
                else:  # its first op: the backward runs the whole segment
                    self.position -= 1
                return True
            self.run(op, step)
        self.offset = 0
        return False
