"""The training step as one graph: the forward ops, then the backward derived from them, the
gradient sync and the optimizer update (`training_graph`).

The search, lowering and pricing then see ops with rules like any other (`rules.gradient`),
so a backward reshard is priced and emitted by the same `plan_reshard` as a forward one, and
the memory of the step (activations kept for backward, gradients, optimizer state, gathered
weights) is counted by the same liveness as inference.

    forward   y = MatMul(x, w)
    backward  y@grad0 = LossGrad(y)                       (the loss's gradient, given y)
              w@grad0 = Grad[op=MatMul, operand=1](x, "", y@grad0)      dW: reads x, dY
              w@grad = GradSync(w@grad0)        kept until the update, in its own sharding
    optimizer w@next, w@state_next = Update(w@grad, w, w@state)

- Which values need a gradient: the parameters (float weights but scalars, the buffers the
  exporter marks, `Graph.buffers`, and those that only compute tables from constants, such as
  rotary frequencies: `buffers.trained_weights`) and every float value computed from one.
  Integer and mask paths need none.
- What a gradient op reads (the activations kept for backward): the gradients of the op's
  results, the op's integer operands (indices, masks) and, by op family, its float operands:
  a linear op (Add, Reshape, Transpose, Concat, Slice, ...) none, a multilinear one (MatMul,
  Einsum, Mul, Conv, ...) the operands other than the one differentiated, any other op all.
- A value read by several ops gets one gradient contribution from each; they are summed
  (`Sum`) once the last is made (tied embedding and LM head included).
- Every weight's gradient is synchronized (`GradSync`) as soon as it is complete, then kept
  until the optimizer's update at the end of the step; the update reads the weight and its
  optimizer state (`Training.state_planes` fp32 planes: master copy, moments), and its
  results replace them (`Graph.updates`), each returned in the sharding it is held in.
- Fused attention (`Graph.fused`): the gradient ops of a fused region's ops run as its
  backward kernel (the softmax's gradient op) or inside it, and the gradients of the values
  inside it are never held; a recomputed region runs its forward kernel again.
- Precision: every float value is computed in the precision's dtype (a model exported in
  fp32 trains in bf16 under bf16-mixed); under fp8-mixed the linear layers' matmuls, forward
  and backward, run on FP8 tensor cores (`Graph.matmul_dtypes`, `_Step.low_precision`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from autoshard.errors import AutoshardError
from autoshard.ir import dtypes
from autoshard.ir.fused import Kernel
from autoshard.ir.graph import Attrs, Graph, Op, Value, verify
from autoshard.rules import rule_for
from autoshard.rules.gradient import RECOMPUTE_OF, TRAIN, TrainOp
from autoshard.training.buffers import candidates, trained_weights
from autoshard.training.compiled import on_chip
from autoshard.training.loss import with_loss
from autoshard.training.options import Kernels, Training
from autoshard.training.replay import Replay, linear_ops

LINEAR = frozenset(
    {
        "Add", "Sub", "Neg", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze",
        "Transpose", "Concat", "Split", "Slice", "Expand", "Tile", "Pad", "ReduceSum",
        "ReduceMean", "Gather", "GatherElements", "GatherND", "Cast", "CastLike", "Dropout",
        "Sum", "Mean", "DepthToSpace", "SpaceToDepth",
    }
)  # fmt: skip
"""Ops whose gradient is a linear map of the results' gradients alone."""

MULTILINEAR = frozenset({"MatMul", "Gemm", "Einsum", "Mul", "Conv", "ConvTranspose"})
"""Ops linear in each float operand: the gradient of one reads the others."""


class TrainingGraphError(AutoshardError):
    """The model cannot be trained as asked (no output depends on a parameter)."""


def training_graph(
    graph: Graph, training: Training, replays: Sequence[Replay] = (),
    seeded: Sequence[str] = (), differentiated: Sequence[str] = (),
) -> Graph:  # fmt: skip
    """The training step of `graph` (see the module docstring), its ops in program order:
    forward, backward (gradient syncs among it), optimizer. The ops of each of `replays`
    (`training.replay`: a repeated layer, an attention core) run again just before the
    backward of its `before` op, which, with the backward of the ops before it, reads what
    they recompute: of a recomputed layer's activations only its inputs are kept from the
    forward. The loss is computed in the step (`training.loss`), so it is planned with it.

    A pipeline stage's step (`execute.stage_plans`): the gradient of each output in `seeded`
    is given, a graph input `{output}@grad0` (the next stage's), not the loss's; the total
    gradient of each input in `differentiated` is made and returned, after the step's outputs
    (the stage before takes it)."""
    step = with_loss(graph, training.loss, training.micro_batches)
    return _Step(step, training, replays, tuple(seeded), tuple(differentiated)).build()


def gradient_name(value: str) -> str:
    """The value holding `value`'s synchronized gradient (for a weight) or total gradient."""
    return f"{value}@grad"


def state_name(weight: str) -> str:
    return f"{weight}@state"


def float32_islands(graph: Graph) -> bool:
    """Whether `graph` computes in a 16-bit float and upcasts some values to float32 (a
    norm, rotary embeddings, the logits, as Llama's code runs them: its float32 islands).
    Mixed precision keeps those values in float32, as autocast keeps an explicit upcast, and
    computes the rest in its dtype; a float32 model's values all take the precision's."""
    floats = {v.dtype for v in graph.values.values()}
    return "float32" in floats and bool(floats & {"float16", "bfloat16"})


class _Step:
    def __init__(
        self, graph: Graph, training: Training, replays: Sequence[Replay],
        seeded: tuple[str, ...] = (), differentiated: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        self.graph, self.training = graph, training
        self.seeded, self.differentiated = seeded, differentiated
        self.seeds: list[str] = []  # the given gradients: inputs of the step
        self.replay_before = {replay.before: replay.ops for replay in replays if replay.ops}
        self.recomputed: dict[str, str] = {}  # value -> its recomputed value
        self.dtype = training.precision.dtype
        self.islands = float32_islands(graph)
        self.values: dict[str, Value] = {name: self.recast(v) for name, v in graph.values.items()}
        self.ops: list[Op] = list(graph.ops)
        self.phases: dict[str, str] = {}
        self.contributions: dict[str, list[str]] = {}
        self.states: list[str] = []  # optimizer state: inputs of the step, like the batch
        self.updates: dict[str, str] = {}
        self.rules = {op.name: rule_for(op, graph) for op in graph.ops}
        self.trainable = self.find_trainable()
        self.needs = self.find_needs()
        # What derives from the fused regions' ops and values (`Fused.derived`).
        self.fused_ops: dict[str, tuple[str, Kernel | None]] = {}
        self.fused_values: dict[str, tuple[str, bool]] = {}

    def recast(self, value: Value) -> Value:
        if self.islands and value.dtype == "float32":
            return value
        if value.dtype in dtypes.FLOAT_DTYPES and not value.dtype.startswith("complex"):
            return dataclasses.replace(value, dtype=self.dtype)
        return value

    def recast_constants(self) -> dict[str, np.ndarray]:
        """The model's constants in the dtypes their values now have: a float scale the
        exporter made a Constant is computed in the step's precision like the rest."""
        return {
            name: array.astype(dtypes.numpy_dtype(self.values[name].dtype), copy=False)
            for name, array in self.graph.constants.items()
        }

    # -- analysis --

    def is_data(self, op: Op, index: int) -> bool:
        """Whether operand `index` is data (not a shape, axes or other parameter)."""
        rule = self.rules[op.name]
        if rule is None:
            return True
        return index < len(rule.operands) and rule.operands[index] is not None

    def is_float(self, name: str) -> bool:
        return self.graph.values[name].dtype in dtypes.FLOAT_DTYPES

    def find_trainable(self) -> list[str]:
        """The parameters: float weights read as data, less scalars and buffers, the exporter's
        and those the graph shows (`buffers.trained_weights`)."""
        return trained_weights(self.graph, self.is_data)

    def find_needs(self) -> set[str]:
        """The values needing a gradient: trainable weights and float values computed from
        one (through data operands)."""
        needs = set(self.trainable) | set(self.differentiated)
        for op in self.graph.ops:
            if any(n in needs and self.is_data(op, i) for i, n in enumerate(op.inputs) if n):
                needs |= {o for o in op.outputs if o and self.is_float(o)}
        return needs

    def keeps(self, op: Op, operand: int, index: int) -> bool:
        """Whether the gradient of operand `operand` reads operand `index`."""
        name = op.inputs[index]
        if not name:
            return False
        if not self.is_data(op, index) or not self.is_float(name):
            return True  # shapes, axes, indices, masks
        if op.type in LINEAR:
            return False
        if op.type in MULTILINEAR:
            return index != operand
        return True

    # -- building --

    def add(self, op: Op, phase: str, *outputs: Value) -> None:
        self.ops.append(op)
        self.phases[op.name] = phase
        for value in outputs:
            self.values[value.name] = value

    def like(self, name: str, new: str) -> Value:
        value = self.values[name]
        return Value(new, value.shape, value.dtype)

    def contribute(self, name: str) -> str:
        """A fresh value for one more gradient contribution to `name`."""
        made = self.contributions.setdefault(name, [])
        made.append(f"{name}@grad{len(made)}")
        self.values[made[-1]] = self.like(name, made[-1])
        self.fused_values[made[-1]] = (name, False)
        return made[-1]

    def total(self, name: str) -> str:
        """The gradient of `name`: its only contribution, or their sum ("" when none)."""
        made = self.contributions.get(name, [])
        if len(made) <= 1:
            return made[0] if made else ""
        total = f"{name}@gradsum"
        if total not in self.values:
            op = Op(f"{name}@gradsum", "Sum", inputs=tuple(made), outputs=(total,))
            self.add(op, "backward", self.like(name, total))
            self.fused_values[total] = (name, False)
        return total

    def build(self) -> Graph:
        graph = self.graph
        if not self.trainable:
            raise TrainingGraphError(
                f"model {graph.name or '(unnamed)'} has no float weights to train"
            )
        seeds = [o for o in graph.outputs if o in self.needs]
        if not seeds:
            raise TrainingGraphError("no model output depends on a weight: nothing to train")
        for out in seeds:
            seed = self.contribute(out)
            if out in self.seeded:
                self.seeds.append(seed)
                continue
            op = Op(f"{out}@loss_grad", TrainOp.LOSS_GRAD, TRAIN, (out,), (seed,))
            self.add(op, "backward")
        first_reader = {w: graph.consumers(w)[0].name for w in self.trainable}
        synced: dict[str, str] = {}
        for index in reversed(range(len(graph.ops))):
            op = graph.ops[index]
            if index in self.replay_before:  # the op's gradient first, as without recompute
                for name in op.outputs:
                    self.total(name)
                self.recompute(self.replay_before[index])
            self.differentiate(op)
            for name in dict.fromkeys(op.inputs):
                if first_reader.get(name) == op.name:
                    synced[name] = self.sync(name)
        sent_back = tuple(self.total(name) for name in self.differentiated)
        outputs = (*self.optimize(synced), *sent_back)
        buffers = graph.buffers | set(candidates(graph, self.is_data)).difference(self.trainable)
        new = Graph(
            graph.name, tuple(self.ops), self.values, (*graph.inputs, *self.seeds, *self.states),
            outputs,
            graph.weights, self.recast_constants(), graph.opset, graph.nodes_in_file, buffers,
            updates=self.updates, phases=self.phases, micro_batches=self.training.micro_batches,
            fused=graph.fused.derived(self.fused_ops, self.fused_values),
            matmul_dtypes=self.low_precision(),
        )  # fmt: skip
        if self.training.kernels is Kernels.COMPILED:
            new = dataclasses.replace(new, on_chip=on_chip(new))
        verify(new)
        return new

    def low_precision(self) -> dict[str, str]:
        """The ops computing in the precision's matmul dtype (none but under fp8-mixed): the
        linear layers' matmuls, a MatMul or Gemm of activations by a trained weight (read as
        is or through views and casts: a transposed weight), with their gradients and
        recomputations. A matmul of two activations (attention's) stays in bf16."""
        dtype = self.training.precision.matmul_dtype
        if dtype is None:
            return {}
        linear = {op.name for op in linear_ops(self.graph, self.trainable)}
        return {
            op.name: dtype
            for op in self.ops
            if op.name in linear
            or (op.type == TrainOp.GRAD and op.attrs.get("op") in linear)
            or op.attrs.get(RECOMPUTE_OF) in linear
        }

    def differentiate(self, op: Op) -> None:
        gradients = tuple(self.total(o) if o else "" for o in op.outputs)
        if not any(gradients):
            return
        for i, name in enumerate(op.inputs):
            if not name or name not in self.needs or not self.is_data(op, i):
                continue
            reads = tuple(
                self.recomputed.get(n, n) if self.keeps(op, i, j) else ""
                for j, n in enumerate(op.inputs)
            )
            out = self.contribute(name)
            attrs = Attrs([("op", op.name), ("operand", i)])
            grad = Op(f"{op.name}@grad{i}", TrainOp.GRAD, TRAIN, reads + gradients, (out,), attrs)
            self.add(grad, "backward")
            softmax = self.graph.fused.kernel(op.name) is Kernel.FORWARD
            self.fused_ops[grad.name] = (op.name, Kernel.BACKWARD if softmax else Kernel.INSIDE)

    def recompute(self, positions: Sequence[int]) -> None:
        """The ops at `positions` again, each with its own option, reading their inputs from
        outside as kept and what they compute as recomputed."""
        for op in (self.graph.ops[i] for i in positions):
            outputs = tuple(f"{o}@re" if o else "" for o in op.outputs)
            copy = dataclasses.replace(
                op,
                name=f"{op.name}@recompute",
                inputs=tuple(self.recomputed.get(n, n) for n in op.inputs),
                outputs=outputs,
                attrs=Attrs({**op.attrs, RECOMPUTE_OF: op.name}),
            )
            made = {o: n for o, n in zip(op.outputs, outputs, strict=True) if o}
            self.add(copy, "backward", *(self.like(o, n) for o, n in made.items()))
            self.recomputed |= made
            self.fused_ops[copy.name] = (op.name, None)
            self.fused_values |= {n: (o, True) for o, n in made.items()}

    def sync(self, weight: str) -> str:
        total = self.total(weight)
        synced = gradient_name(weight)
        op = Op(f"{weight}@sync", TrainOp.GRAD_SYNC, TRAIN, (total,), (synced,))
        self.add(op, "gradient_sync", self.like(weight, synced))
        return synced

    def optimize(self, synced: dict[str, str]) -> tuple[str, ...]:
        """The update of every weight (in forward order), and the step's outputs."""
        planes = self.training.state_planes
        if planes == 0:  # no optimizer: the synchronized gradients are the step's outputs
            return tuple(synced[w] for w in self.trainable if w in synced)
        outputs: list[str] = []
        for weight in self.trainable:
            if weight not in synced:
                continue  # no output depends on it
            shape = self.values[weight].shape
            state = Value(state_name(weight), (planes, *shape), "float32")
            self.values[state.name] = state
            self.states.append(state.name)
            new_weight = self.like(weight, f"{weight}@next")
            new_state = Value(f"{state.name}_next", state.shape, state.dtype)
            op = Op(
                f"{weight}@update", TrainOp.UPDATE, TRAIN,
                (synced[weight], weight, state.name), (new_weight.name, new_state.name),
                Attrs({"optimizer": str(self.training.optimizer)}),
            )  # fmt: skip
            self.add(op, "optimizer", new_weight, new_state)
            self.updates |= {new_weight.name: weight, new_state.name: state.name}
            outputs += [new_weight.name, new_state.name]
        return tuple(outputs)
