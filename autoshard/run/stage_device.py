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

A zero-bubble schedule (ZB-H1) splits the backward in two more (`split_backward`): the
backward pass runs the input gradient `B`, passing over the weight gradient's entries `W`
(the ops `search.backward_split` finds, what reads them, the collectives only they read), so
the gradient sent back leaves at once; a later pass (`weight_pass`) runs the entries passed
over, in the list's order. Each micro-batch's `W` runs in micro-batch order as its backward
did, so the gradients accumulate, sync and update as without the split, to the last bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from autoshard.execute.train_verify import TrainingDevice
from autoshard.passes.partition import LocalCompute
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
    skipped: list[tuple[int, int]]
    done: int
    weight_pass: bool


class StageDevice(TrainingDevice):
    """A `TrainingDevice` whose step list runs as a forward and a backward pass."""

    offset = 0  # the next node of the segment at `position - 1` (a pass stopped inside it)
    forward_only = False  # stop at the first entry of the backward
    tied: frozenset[str] = frozenset()  # tied weights' gradients, summed across stages
    waiting: set[str] = set()  # those not summed yet (the last micro-batch's)
    paused = False  # stopped before an entry reading a gradient in `waiting`
    weight_items: frozenset[tuple[int, int]] = frozenset()  # `W`'s entries (`split_backward`)
    skipped: list[tuple[int, int]] = []  # those the backward (`B`) passed, for the `W` pass
    done = 0  # of `skipped`, run by the `W` pass
    weight_pass = False  # running `skipped`

    def begin(self, inputs: Mapping[str, Any], last: bool = True) -> None:
        super().begin(inputs, last)
        self.offset = 0
        self.waiting = set(self.tied) if last else set()
        self.skipped, self.done, self.weight_pass = [], 0, False

    def save(self) -> Pass:
        """The running micro-batch, kept for its backward (or its `W` pass)."""
        return Pass(self.env, self.position, self.offset, self.deferred, self.last, self.waiting,
                    self.skipped, self.done, self.weight_pass)  # fmt: skip

    def restore(self, kept: Pass) -> None:
        self.env, self.position, self.offset = kept.env, kept.position, kept.offset
        self.deferred, self.last, self.waiting = kept.deferred, kept.last, kept.waiting
        self.skipped, self.done, self.weight_pass = kept.skipped, kept.done, kept.weight_pass

    def split_backward(
        self, weight_ops: frozenset[str], nodes: Mapping[str, list[tuple[str, str]]]
    ) -> None:
        """Run the backward as two passes (ZB-H1): `B`, then, on `weight_pass`, `W`: the
        entries of `weight_ops` (graph ops, `execute.stage_training.stage_weight_ops`: a
        local op by the program step it implements), those reading what they make (the
        gradient syncs, the update), and the collectives whose results only they read.
        Each entry is `(position, node)`, a collective's node -1."""
        items: list[tuple[tuple[int, int], tuple[str, ...], tuple[str, ...], bool]] = []
        graph_op = {s.op.name: self.program_ops[s.step].name
                    for s in self.program.steps if isinstance(s, LocalCompute)}  # fmt: skip
        for p, entry in enumerate(self.steps):
            if "collective" in entry:
                c = self.collectives[int(entry["collective"])]
                items.append(((p, -1), (c.source,), (c.target,), False))
                continue
            for k, (name, _) in enumerate(nodes[entry["run"]]):
                if name in self.ops:
                    op = self.ops[name]
                    items.append(((p, k), op.inputs, op.outputs, graph_op[name] in weight_ops))
        weights: set[tuple[int, int]] = set()
        made: set[str] = set()
        for key, inputs, outputs, weight in items:
            if weight or made.intersection(inputs):
                weights.add(key)
                made.update(outputs)
        read: dict[str, bool] = {}  # value -> whether only `W` entries read it (so far)
        for key, inputs, outputs, _ in reversed(items):
            if key[1] < 0 and key not in weights and read.get(outputs[0], False):
                weights.add(key)
            for name in inputs:
                read[name] = read.get(name, True) and key in weights
        self.weight_items = frozenset(weights)

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
        if self.weight_pass:
            return self._weights(step, nodes, at)
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
                if not self.forward_only and (self.position, -1) in self.weight_items:
                    self.skipped.append((self.position, -1))
                    self.position += 1
                    continue
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
            if (self.position - 1, k) in self.weight_items and not self.forward_only:
                self.skipped.append((self.position - 1, k))
                continue
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

    def _weights(
        self, step: int, nodes: Mapping[str, list[tuple[str, str]]],
        at: Callable[[int], None] | None,
    ) -> int | None:  # fmt: skip
        """The `W` pass: the entries the backward passed, in order, up to the next
        collective (its index) or the end (None), or before one reading a tied gradient
        not summed yet (`paused`)."""
        while self.done < len(self.skipped):
            p, k = self.skipped[self.done]
            self.position = p + 1  # where a failure names
            if at is not None:
                at(p)
            if k < 0:
                j = int(self.steps[p]["collective"])
                source = self.collectives[j].source
                if source in self.waiting:
                    self.paused = True
                    return None
                self.done += 1
                if source not in self.deferred:
                    return j
                self.deferred.add(self.collectives[j].target)
                continue
            op = self.op(nodes[self.steps[p]["run"]][k][0])
            if self.waiting.intersection(op.inputs):
                self.paused = True
                return None
            self.done += 1
            self.run(op, step)
        return None
