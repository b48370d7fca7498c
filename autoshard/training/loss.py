"""The loss a training step differentiates, as ops of the step's graph (`with_loss`), so the
search plans it and the rules shard it like any other op.

- `sum`: every element of the model's outputs summed; no op is added (the loss's gradient
  of each output is ones, `TrainOp.LOSS_GRAD`).
- `cross-entropy`: the mean over positions of -log softmax(logits)[label], the logits the
  model's first output (classes on its last dim), the labels a new int64 graph input
  (`LABELS`, the logits' shape less the last dim). It is written with the ops the rules
  cover, in the numerically stable form, so a logits tensor split over its classes (a
  Megatron plan's vocab-parallel LM head) is reduced across the split as Megatron's
  vocab-parallel cross-entropy reduces it, by the reductions' own partial results:

      m     = ReduceMax(logits, -1)              max over the classes: all_reduce(max)
      z     = logits - m
      lse   = Log(ReduceSum(Exp(z), -1))         sum of exponentials: all_reduce(sum)
      hit   = Equal(Unsqueeze(labels, -1), classes)   classes = 0..C-1, split as the logits
      picked= ReduceSum(Where(hit, z, 0), -1)    the label's logit: all_reduce(sum)
      loss  = ReduceSum(lse - picked) / (positions * micro-batches)

  The maximum only shifts the logits: the loss does not depend on it, so the gradient that
  reaches it through `z` and `lse` sums to zero (to rounding), whichever class its own
  gradient picks.

  Under gradient accumulation the graph is one micro-batch of the step's batch: its mean is
  scaled by the micro-batches too, so the micro-batches' losses and accumulated gradients sum
  to the whole batch's mean, as frameworks divide the loss by the accumulation steps.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from autoshard.ir import dtypes
from autoshard.ir.graph import Attrs, AttrValue, Graph, Op, Value
from autoshard.training.options import Loss, TrainingError

LABELS = "labels"
"""The graph input holding a cross-entropy loss's labels (class indices)."""

LOSS_VALUE = "loss"
"""The step's loss value, the one output of a graph with a cross-entropy loss."""

_PREFIX = "loss@"  # the names of the values and ops the loss adds


def logits_of(graph: Graph) -> Value:
    """The output a cross-entropy loss reads: the model's first, a float tensor of at least
    one dim (its classes on the last)."""
    value = graph.values[graph.outputs[0]]
    if value.dtype not in dtypes.FLOAT_DTYPES or not value.shape:
        raise TrainingError(
            f"loss cross-entropy reads the model's first output as logits, but "
            f"{value.name!r} is {value.dtype}{list(value.shape)}: use --loss sum"
        )
    return value


def with_loss(graph: Graph, loss: Loss, micro_batches: int = 1) -> Graph:
    """`graph` (one of a step's `micro_batches`) with `loss` computed as its one output
    (module docstring); as is for `sum`."""
    if loss is Loss.SUM:
        return graph
    taken = [n for n in (LABELS, LOSS_VALUE) if n in graph.values]
    if taken:
        raise TrainingError(f"loss cross-entropy adds the value {taken[0]!r}, which the model "
                            "already has: use --loss sum")  # fmt: skip
    return _CrossEntropy(graph, logits_of(graph)).build(micro_batches)


class _CrossEntropy:
    def __init__(self, graph: Graph, logits: Value) -> None:
        self.graph, self.logits = graph, logits
        self.values = dict(graph.values)
        self.constants = dict(graph.constants)
        self.ops: list[Op] = []

    def constant(self, name: str, array: np.ndarray) -> str:
        name = _PREFIX + name
        self.constants[name] = array
        self.values[name] = Value(name, array.shape, str(array.dtype))
        return name

    def op(self, kind: str, inputs: tuple[str, ...], shape: tuple[int, ...], dtype: str = "",
           attrs: dict[str, AttrValue] | None = None, name: str = "") -> str:  # fmt: skip
        out = name or f"{_PREFIX}{len(self.ops)}_{kind.lower()}"
        self.values[out] = Value(out, shape, dtype or self.logits.dtype)
        self.ops.append(Op(out, kind, inputs=inputs, outputs=(out,), attrs=Attrs(attrs or {})))
        return out

    def reduce(self, kind: str, x: str, keep: bool = True) -> str:
        """`kind` over the last dim (keeping it as 1), or over every dim (`keep` false)."""
        shape = self.values[x].shape
        axes = [len(shape) - 1] if keep else list(range(len(shape)))
        out = (*shape[:-1], 1) if keep else ()
        attrs: dict[str, AttrValue] = {"keepdims": int(keep)}
        if kind == "ReduceMax" and self.graph.opset < 18:  # axes an attribute before opset 18
            return self.op(kind, (x,), out, attrs=attrs | {"axes": tuple(axes)})
        name = self.constant(f"axes{len(self.ops)}", np.asarray(axes, np.int64))
        return self.op(kind, (x, name), out, attrs=attrs)

    def build(self, micro_batches: int) -> Graph:
        logits, shape = self.logits.name, self.logits.shape
        classes, positions = shape[-1], math.prod(shape[:-1]) * micro_batches
        self.values[LABELS] = Value(LABELS, shape[:-1], "int64")
        last = self.constant("last", np.asarray([len(shape) - 1], np.int64))
        column = self.op("Unsqueeze", (LABELS, last), (*shape[:-1], 1), "int64")
        every = self.constant("classes", np.arange(classes, dtype=np.int64))
        hit = self.op("Equal", (column, every), shape, "bool")
        shifted = self.op("Sub", (logits, self.reduce("ReduceMax", logits)), shape)
        total = self.reduce("ReduceSum", self.op("Exp", (shifted,), shape))
        log_total = self.op("Log", (total,), self.values[total].shape)
        zero = self.constant("zero", np.zeros((), dtypes.numpy_dtype(self.logits.dtype)))
        picked = self.reduce("ReduceSum", self.op("Where", (hit, shifted, zero), shape))
        terms = self.op("Sub", (log_total, picked), self.values[picked].shape)
        # A divisor, not its reciprocal: a count is exact in any float type, 1/count is not.
        count = np.asarray(positions, dtypes.numpy_dtype(self.logits.dtype))
        mean = (self.reduce("ReduceSum", terms, keep=False), self.constant("positions", count))
        self.op("Div", mean, (), name=LOSS_VALUE)
        return dataclasses.replace(
            self.graph,
            ops=(*self.graph.ops, *self.ops),
            values=self.values,
            inputs=(*self.graph.inputs, LABELS),
            outputs=(LOSS_VALUE,),
            constants=self.constants,
        )


def label_classes(graph: Graph) -> int | None:
    """How many classes the labels of `graph`'s cross-entropy index (None: it has none)."""
    classes = graph.values.get(_PREFIX + "classes")
    return classes.shape[0] if classes is not None and LABELS in graph.inputs else None


def check_labels(labels: np.ndarray, classes: int) -> None:
    """A TrainingError naming the labels outside the classes 0..classes-1."""
    outside = int(np.count_nonzero((labels < 0) | (labels >= classes)))
    if outside:
        raise TrainingError(
            f"input {LABELS!r} holds {outside} labels outside the logits' classes 0..{classes - 1}"
        )
