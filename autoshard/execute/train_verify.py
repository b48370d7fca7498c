"""Run a partitioned training step for N steps on every device in one process and check it
against PyTorch autograd on the original model.

Each device follows its own step list as the partition folder's steps.json writes it: the ops
of each segment file (by name, in the file's order) run as torch ops (`train_ops`), and each
`{"collective": j}` runs collective j with every other device (`simulate`, the dialect's
semantics). The devices run in lockstep from one collective to the next: a device whose list
reaches another collective than the rest (one dropped from its file) is named, as is an op
reading a tensor no step made. After each step a device's weights and optimizer state are its
update's results (`Graph.updates`), in the shardings they are held in.

The checks (`train_check`): the loss, every synchronized gradient, every updated weight and
optimizer state against PyTorch autograd and torch.optim on the original ONNX file. A NaN made
by any op stops the step at once, naming the device and the op (a gradient op: its parameter).
`autoshard run` runs the same `TrainingDevice` per process, its collectives on
torch.distributed (`run.train`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from autoshard.execute import train_ops
from autoshard.execute.simulate import run_collective
from autoshard.execute.train_check import (
    Check,
    Checked,
    TrainingReport,
    check_training,
    computing_in,
    floats_of,
    held_start,
    reference_of,
    step_checks,
    to_numpy,
    to_torch,
    tolerance_of,
)
from autoshard.execute.verify import (
    InputSpec,
    VerifyError,
    check_inputs,
    input_specs,
    random_inputs,
)
from autoshard.ir.graph import Graph, Op
from autoshard.passes.partition import LocalCollective, LocalCompute, Partitioned
from autoshard.program import Compute
from autoshard.rules.gradient import TRAIN, TrainOp, accumulated_gradients
from autoshard.training.loss import LABELS, check_labels, label_classes
from autoshard.training.options import Optimizer, Training

_SHAPED = frozenset({"Reshape", "Expand"})
"""Ops whose operand 1 is their result's shape: a Grad at any sharding reads it from the
local shape of its result's gradient."""


_UNREAD = frozenset({"Add", "Sub", "Sum", "Concat"})
"""Ops whose gradient reads none of their operands (the values of the operands it does not
differentiate do not matter, only their shapes)."""


class TrainingDevice:
    """One device's program, its step list from steps.json and the tensors it holds."""

    def __init__(
        self, partitioned: Partitioned, index: int, steps: Sequence[Mapping[str, Any]], graph: Graph
    ):
        program_ops = program_ops_of(partitioned)
        program = partitioned.devices[index]
        self.partitioned = partitioned
        self.program, self.graph, self.program_ops = program, graph, program_ops
        self.step_of = {o.name: i for i, o in program_ops.items()}
        self.ops = {s.op.name: s.op for s in program.steps if isinstance(s, LocalCompute)}
        self.collectives = [s for s in program.steps if isinstance(s, LocalCollective)]
        self.steps = steps
        self.env: dict[str, Any] = {}  # every tensor of the running step
        self.held: dict[str, Any] = {}  # constants, weights and optimizer state across steps
        self.position = 0
        # Gradient accumulation (`micro_batches`): the gradients the syncs read, summed over
        # the step's micro-batches in float32 at least (as Megatron's main_grad: a bf16 sum
        # would round at every micro-batch); what reads them waits for the last (`deferred`).
        self.accumulated = accumulated_gradients(graph)
        self.sums: dict[str, Any] = {}
        self.loss_sums: dict[str, Any] = {}
        self.deferred: set[str] = set()
        self.last = True

    def begin(self, inputs: Mapping[str, Any], last: bool = True) -> None:
        """Start a step, or one of its micro-batches (`last`: the one that syncs and updates):
        the held tensors and this device's slices of the graph inputs."""
        self.env = dict(self.held) | dict(inputs)
        self.position = 0
        self.deferred = set() if last else set(self.accumulated)
        self.last = last

    def carry(self, losses: Sequence[str]) -> None:
        """After a micro-batch but the last: its loss terms kept (its gradients are, as each
        is made: `accumulate`)."""
        for n in losses:
            self.loss_sums[n] = self.env[n] + self.loss_sums.get(n, 0)

    def total_losses(self, losses: Sequence[str]) -> None:
        """After the last micro-batch: its loss terms summed with the others'."""
        for n in losses:
            self.env[n] = self.env[n] + self.loss_sums.pop(n, 0)

    def end(self, updates: Mapping[str, str], outputs: Mapping[str, str]) -> None:
        """End a step: each weight and optimizer state held is its update's result."""
        for new, old in updates.items():
            self.held[old] = self.env[outputs[new]]

    def advance(
        self,
        step: int,
        nodes: Mapping[str, list[tuple[str, str]]],
        at: Callable[[int], None] | None = None,
    ) -> int | None:
        """Run the device's steps up to its next collective; return its index (None: done).
        `at` is told the position of each entry of the step list as it starts."""
        while self.position < len(self.steps):
            if at is not None:
                at(self.position)
            entry = self.steps[self.position]
            self.position += 1
            if "collective" in entry:
                j = int(entry["collective"])
                if self.collectives[j].source not in self.deferred:
                    return j
                self.deferred.add(self.collectives[j].target)
                continue
            for name, kind in nodes[entry["run"]]:
                if kind == "Constant" and name not in self.ops:
                    continue  # the device's loose constants: in its tensors from the start
                self.run(self.op(name), step)
        return None

    def op(self, name: str) -> Op:
        if name not in self.ops:
            raise VerifyError(f"device {self.program.index}: its steps run op {name!r}, which "
                              "its program does not have")  # fmt: skip
        return self.ops[name]

    def run(self, op: Op, step: int) -> None:
        index = self.program.index
        if self.deferred.intersection(op.inputs):  # a sync or an update: the last micro-batch's
            self.deferred.update(op.outputs)
            return
        missing = [n for n in op.inputs if n and n not in self.env]
        if missing:
            made = [j for j, c in enumerate(self.collectives) if c.target == missing[0]]
            cause = (
                f"the result of {_name(self, made[0])}, which its steps do not run"
                if made
                else "which no step before it made"
            )
            raise VerifyError(f"device {index}: op {op.name!r} reads {missing[0]!r}, {cause}")
        args = [self.env[n] if n else None for n in op.inputs]
        try:
            if op.domain == TRAIN:
                results = self.train_op(op, args, step)
            else:
                results = train_ops.forward(op.type, dict(op.attrs), args, len(op.outputs))
        except (RuntimeError, IndexError, ValueError) as error:  # torch's own error types
            raise VerifyError(
                f"device {index}: op {op.name!r} failed: {str(error).splitlines()[0]}"
            ) from None
        for name, result in zip(op.outputs, results, strict=False):
            if not name:
                continue
            if result.is_floating_point():  # a constant's or a cast's: the step's floats
                result = result.to(_dtype_of(self.graph, name))
            if name in self.accumulated:
                result = self.accumulate(name, result)
            if tuple(result.shape) != tuple(self.program.shapes[name]):
                raise VerifyError(
                    f"device {index}: tensor {name!r} of op {op.name!r} has local shape "
                    f"{list(result.shape)}; the partition says {list(self.program.shapes[name])}"
                )
            self.env[name] = result.detach()
            if result.is_floating_point() and bool(torch.isnan(result).any()):
                raise NotANumber(f"device {index}: {_what(op, self.graph)} has NaN in "
                                 f"{int(torch.isnan(result).sum())} of {result.numel()} "
                                 "elements")  # fmt: skip

    def accumulate(self, name: str, result: Any) -> Any:
        """Gradient `name` summed with the micro-batches' before; kept but in the last."""
        total = result.to(torch.promote_types(result.dtype, torch.float32))
        if name in self.sums:
            total = total + self.sums.pop(name)
        if not self.last:
            self.sums[name] = total
        return total.to(result.dtype)

    def train_op(self, op: Op, args: list[Any], step: int) -> list[Any]:
        """A training op; a Grad differentiates its forward op as this device runs it (its
        own constants: a rewritten shape), the graph's forward op telling the operand count."""
        if op.type != TrainOp.GRAD:
            return train_ops.train_op(op, None, args, (), step)
        name = str(op.attr("op"))
        count = len(self.graph.op_by_name[name].inputs)
        if name not in self.ops:  # rewritten into several local ops (a masked lookup)
            return [self.rewritten_gradient(op, name, args[:count], args[count:])]
        forward = self.ops[name]
        if forward.type == "Gather" and int(op.attr("operand", 0)) == 0:  # type: ignore[arg-type]
            return [self.lookup_gradient(op, forward, args[1], args[count])]
        gradients = zip(args[count:], forward.outputs, strict=False)
        shapes = [self.program.shapes.get(n, ()) for n in forward.inputs]
        if all(g is None or tuple(g.shape) == self.program.shapes[o] for g, o in gradients):
            # The Grad runs at its forward op's sharding: it reads the op's local constants.
            for j, local in enumerate(forward.inputs[:count]):
                if local and op.inputs[j] and local != op.inputs[j] and local in self.held:
                    args[j] = self.held[local]
        elif forward.type in _UNREAD and args[count] is not None:
            # Another sharding: the unread operands take the shapes that fit the result's
            # gradient (the operand's own comes from the Grad's result).
            shapes = self.unread_shapes(forward, tuple(args[count].shape))
        if forward.type in _SHAPED and count < len(args) and args[count] is not None:
            args[1] = torch.tensor(tuple(args[count].shape), dtype=torch.int64)
        result = self.program.shapes[op.outputs[0]]
        return train_ops.train_op(op, forward, args, shapes, step, count, result)

    def unread_shapes(self, forward: Op, local: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The local shapes of a linear op's operands beside its result's gradient of local
        shape `local`, at the gradient's sharding: a dim the result shares with the operand
        (the same extent, numpy's broadcasting aligning from the right) is as split as the
        result's; another one (a broadcast 1, a concatenated operand's own extent) is whole."""
        tensors = self.partitioned.program.tensors
        whole = tensors[forward.outputs[0]].shape
        shapes = []
        for name in forward.inputs:
            own = tensors[name].shape if name in tensors else ()
            fitted = [
                n if s == w else s
                for s, w, n in zip(own[::-1], whole[::-1], local[::-1], strict=False)
            ]
            shapes.append(tuple(fitted[::-1]))
        return shapes

    def lookup_gradient(self, op: Op, forward: Op, indices: Any, gradient: Any) -> Any:
        """The gradient of a lookup's table: rows of the whole table (a Grad that writes its
        device's rows reads every index) scattered, then the device's rows of it."""
        result = op.outputs[0]
        axis = int(forward.attr("axis", 0)) % len(self.program.shapes[result])  # type: ignore[arg-type]
        start, stop = self.partitioned.slices(result, self.program.index)[axis]
        shape = list(self.program.shapes[result])
        shape[axis] = self.partitioned.program.tensors[result].shape[axis]
        attrs = dict(forward.attrs)
        whole = train_ops.gradient(
            0, lambda values: train_ops.forward("Gather", attrs, values), [torch.zeros(shape),
            indices], [gradient],
        )  # fmt: skip
        return whole.narrow(axis, start, stop - start)

    def rewritten_gradient(
        self, op: Op, name: str, reads: Sequence[Any], gradients: Sequence[Any]
    ) -> Any:
        """The gradient of forward op `name`'s operand as the local ops it was rewritten into
        compute it: those of its program step, reading its operands by the program's names."""
        step = self.step_of[name]
        forward = self.program_ops[step]
        local = [s.op for s in self.program.steps if isinstance(s, LocalCompute) and s.step == step]
        operands = [
            r if r is not None else torch.zeros(tuple(self.program.shapes[n]))
            for r, n in zip(reads, forward.inputs, strict=True)
        ]

        def run(values: list[Any]) -> list[Any]:
            env = dict(self.env)
            env.update({n: v for n, v in zip(forward.inputs, values, strict=True) if n})
            for o in local:
                args = [env[n] if n else None for n in o.inputs]
                results = train_ops.forward(o.type, dict(o.attrs), args, len(o.outputs))
                env.update({n: r for n, r in zip(o.outputs, results, strict=False) if n})
            return [env[n] for n in forward.outputs]

        return train_ops.gradient(int(op.attr("operand", 0)), run, operands, gradients)  # type: ignore[arg-type]


class NotANumber(VerifyError):
    """A NaN made by a device's op: the step cannot go on."""


def _what(op: Op, graph: Graph) -> str:
    """An op for a message: a gradient op names its parameter or its forward op's operand."""
    if op.domain != TRAIN or op.type != TrainOp.GRAD:
        return f"op {op.name!r} ({op.type})"
    forward = graph.op_by_name[str(op.attr("op"))]
    operand = int(op.attr("operand", 0))  # type: ignore[arg-type]
    read = forward.inputs[operand] if operand < len(forward.inputs) else ""
    of = f"parameter {read}" if read in graph.weights else f"{read!r}"
    return f"op {op.name!r} (the gradient of {of} through {forward.type} {forward.name!r})"


def segment_nodes(folder: Path, manifest: Mapping[str, Any]) -> dict[str, list[tuple[str, str]]]:
    """Each segment file's nodes (name, type) in order."""
    out: dict[str, list[tuple[str, str]]] = {}
    for device in manifest["devices"]:
        for entry in device["steps"]:
            path = entry.get("run")
            if path is not None and path not in out:
                model = onnx.load(os.fspath(folder / path))
                out[path] = [(n.name, n.op_type) for n in model.graph.node]
    return out


def program_ops_of(partitioned: Partitioned) -> dict[int, Op]:
    """The whole program's compute ops by step (a Grad of a rewritten op reads its step)."""
    steps = partitioned.program.steps
    return {i: s.op for i, s in enumerate(steps) if isinstance(s, Compute)}


class _Partitioned:
    """Every device of the partition, stepped together."""

    def __init__(
        self, partitioned: Partitioned, graph: Graph, manifest: Mapping[str, Any], folder: Path
    ):
        self.partitioned, self.graph = partitioned, graph
        self.devices = [
            TrainingDevice(partitioned, d.index, m["steps"], graph)
            for d, m in zip(partitioned.devices, manifest["devices"], strict=True)
        ]
        self.nodes = segment_nodes(folder, manifest)
        self.outputs = dict(zip(graph.outputs, partitioned.program.outputs, strict=True))
        tensors = partitioned.program.tensors
        for new, old in graph.updates.items():
            made, held = tensors[self.outputs[new]].sharding, tensors[old].sharding
            if made != held:  # the next step reads the update's result as the held value
                raise VerifyError(f"the update returns {new} as {made} but {old} is held {held}")

    def start(self, weights: Any) -> None:
        for device in self.devices:
            index = device.program.index
            device.held = start_tensors(self.partitioned, self.graph, index, weights(index))

    def step(
        self, step: int, micro_batches: Sequence[Mapping[str, np.ndarray]], losses: Sequence[str]
    ) -> None:
        """One training step over its micro-batches' inputs: the last syncs and updates."""
        for k, inputs in enumerate(micro_batches, start=1):
            last = k == len(micro_batches)
            for device in self.devices:
                device.begin(local_inputs(self.partitioned, device.program.index, inputs), last)
            while True:
                at = [d.advance(step, self.nodes) for d in self.devices]
                if all(j is None for j in at):
                    break
                self.collective(at)
            for device in self.devices:
                if last:
                    device.total_losses(losses)
                    device.end(self.graph.updates, self.outputs)
                else:
                    device.carry(losses)

    def collective(self, at: Sequence[int | None]) -> None:
        counts = {j: at.count(j) for j in at}
        j = max(counts, key=lambda k: (counts[k], k is not None))
        odd = [d for d, k in zip(self.devices, at, strict=True) if k != j]
        if odd or j is None:
            d = odd[0]
            theirs = at[d.program.index]
            raise VerifyError(
                f"device {d.program.index} runs {_name(d, theirs)} where the other devices run "
                f"{_name(self.devices[at.index(j)], j)}: its steps leave out or reorder a "
                "collective"
            )
        step = self.devices[0].collectives[j]
        local = {d.program.device: to_numpy(d.env[step.source]) for d in self.devices}
        moved = run_collective(step.collective, self.partitioned.mesh, local)
        for d in self.devices:
            d.env[step.target] = to_torch(moved[d.program.device]).to(d.env[step.source].dtype)


def local_inputs(
    partitioned: Partitioned, index: int, inputs: Mapping[str, np.ndarray]
) -> dict[str, Any]:
    """Device `index`'s slices of the graph inputs, as torch tensors."""
    return {
        name: to_torch(array[tuple(slice(a, b) for a, b in partitioned.slices(name, index))])
        for name, array in inputs.items()
    }


def _name(device: TrainingDevice, j: int | None) -> str:
    if j is None:
        return "no more collectives"
    step = device.collectives[j]
    return f"collective {j} ({step.collective.kind} of {step.source})"


def training_feeds(
    graph: Graph, steps: int, seed: int = 0, inputs: Mapping[str, np.ndarray] | None = None
) -> list[list[dict[str, np.ndarray]]]:
    """Each step's graph inputs, one set per micro-batch (`Graph.micro_batches`): `inputs`
    every step, the whole batch (checked against the graph; split on the first dim into the
    micro-batches), or seeded random ones, new each micro-batch (a cross-entropy's labels
    below its classes)."""
    states = set(graph.updates.values()) - set(graph.weights)
    specs = [s for s in input_specs(graph) if s.name not in states]
    return feeds_of(specs, label_classes(graph), graph.micro_batches, steps, seed, inputs)


def feeds_of(
    specs: Sequence[InputSpec], classes: int | None, count: int, steps: int, seed: int = 0,
    inputs: Mapping[str, np.ndarray] | None = None,
) -> list[list[dict[str, np.ndarray]]]:  # fmt: skip
    """`training_feeds` of the inputs `specs` (one micro-batch's), `classes` a cross-entropy's
    labels are below, `count` micro-batches a step."""
    specs = [_given(s, classes) for s in specs]
    if inputs is None:
        return [[random_inputs(specs, seed + k * count + j) for j in range(count)]
                for k in range(steps)]  # fmt: skip
    whole = [dataclasses.replace(s, shape=_batch_of(s.shape, count)) for s in specs]
    given = check_inputs(whole, inputs)
    if classes is not None:
        check_labels(given[LABELS], classes)
    split = {n: np.split(a, count) if a.ndim else [a] * count for n, a in given.items()}
    return [[{n: parts[j] for n, parts in split.items()} for j in range(count)]] * steps


def _given(spec: InputSpec, classes: int | None) -> InputSpec:
    """An input as the step is given it: labels below the classes; a float one in float32,
    the model's own (a mixed-precision step casts it, as it casts its weights)."""
    if spec.name == LABELS:
        return dataclasses.replace(spec, high=classes)
    if spec.dtype in ("bfloat16", "float16"):
        return dataclasses.replace(spec, dtype="float32")
    return spec


def _batch_of(shape: tuple[int, ...], micro_batches: int) -> tuple[int, ...]:
    """The shape of a whole batch of `micro_batches` inputs of `shape` (its first dim)."""
    return (shape[0] * micro_batches, *shape[1:]) if shape else shape


def start_tensors(
    partitioned: Partitioned, graph: Graph, index: int, weights: Mapping[str, Any]
) -> dict[str, Any]:
    """What device `index` holds before the first step: the program's constants and its own,
    its weights, and its optimizer states: zeros, but a master weight (mixed precision: the
    state's first plane), which starts as the weight as given (`weights`, before it is cast
    to the step's dtype)."""
    device = partitioned.devices[index]
    held = {n: to_torch(v) for n, v in partitioned.program.constants.items()}
    held |= {n: to_torch(v) for n, v in device.constants.items()}
    held |= {n: to_torch(a) for n, a in weights.items()}
    for op in graph.ops:
        if op.type != TrainOp.UPDATE:
            continue
        _, weight, state = op.inputs
        dtype = _dtype_of(graph, state)
        held[state] = torch.zeros(tuple(device.shapes[state]), dtype=dtype)
        if device.shapes[state][0] > Optimizer(str(op.attr("optimizer"))).moments:
            region = _within(partitioned, index, state, weight)
            held[state][0] = to_torch(np.asarray(weights[weight])[region]).to(dtype)
    return held


def _dtype_of(graph: Graph, name: str) -> Any:
    """The torch dtype of a float tensor of the step: the graph's float32 (an optimizer state
    of a bf16 step) as float32, any other as the step computes (torch's default dtype)."""
    value, computing = graph.values.get(name), torch.get_default_dtype()
    if value is not None and value.dtype == "float32" and computing != torch.float64:
        return torch.float32
    return computing


def _within(partitioned: Partitioned, index: int, state: str, weight: str) -> tuple[slice, ...]:
    """The region of device `index`'s slice of `weight` its slice of `state` covers (past the
    planes' dim): a state is split as its weight or further (ZeRO)."""
    held = partitioned.slices(weight, index)
    region = []
    for (start, stop), (a, b) in zip(partitioned.slices(state, index)[1:], held, strict=True):
        if not a <= start <= stop <= b:
            raise VerifyError(f"device {index} holds a slice of {state!r} outside its slice of "
                              f"{weight!r}: its master weight cannot start from it")  # fmt: skip
        region.append(slice(start - a, stop - a))
    return tuple(region)


def verify_training(
    partitioned: Partitioned,
    graph: Graph,
    model: str | os.PathLike[str],
    weights: Any,
    steps_manifest: Mapping[str, Any],
    folder: str | os.PathLike[str],
    training: Training,
    steps: int = 3,
    seed: int = 0,
    inputs: Mapping[str, np.ndarray] | None = None,
    floats: str = "float32",
    loss: str | None = None,
) -> TrainingReport:
    """Train the partition of `folder` (its steps.json, `graph` the training step, `weights`
    each device's own) `steps` steps on `inputs` or seeded random ones, and check every step
    against the reference (`train_check.ReferenceRun`, each step from the weights and states
    the partition holds after the step before); `loss`: the one asked for, which must be the
    plan's (None: the plan's)."""
    check_training(training, loss)
    floats = floats_of(training, floats)
    checked = Checked.of(graph)
    feeds = training_feeds(graph, steps, seed, inputs)
    reference = reference_of(model, checked, training, floats)
    runner = _Partitioned(partitioned, graph, steps_manifest, Path(folder))
    checks: list[Check] = []
    start = None
    with computing_in(floats):
        runner.start(weights)
    for k, feed in enumerate(feeds, start=1):
        with computing_in(floats):
            runner.step(k, feed, checked.losses)
        computed = [{n: to_numpy(d.env[n]) for n in checked.computed} for d in runner.devices]
        held = [{n: to_numpy(d.held[n]) for n in checked.held} for d in runner.devices]
        want = reference.step(feed, start)
        checks += step_checks(partitioned, checked, k, want, computed, held, tolerance_of(floats))
        start = held_start(partitioned, checked, held)
    return TrainingReport(tuple(checks), len(partitioned.devices), steps, floats=floats)
