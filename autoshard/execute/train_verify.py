"""Run a partitioned training step for N steps on every device in one process and check it
against PyTorch autograd on the original model.

Each device follows its own step list as the partition folder's steps.json writes it: the ops
of each segment file (by name, in the file's order) run as torch ops (`train_ops`), and each
`{"collective": j}` runs collective j with every other device (`simulate`, the dialect's
semantics). The devices run in lockstep from one collective to the next: a device whose list
reaches another collective than the rest (one dropped from its file) is named, as is an op
reading a tensor no step made. After each step a device's weights and optimizer state are its
update's results (`Graph.updates`), in the shardings they are held in.

The reference is single-process: the original ONNX file's nodes run as torch ops, the loss
(`train_ops.LOSS`) differentiated by `backward()`, and torch.optim's optimizer steps the
weights. After every step the loss, every synchronized gradient and every updated weight are
compared, each device's shard with the reference's region of it: a mismatch names the step,
the rank, the parameter and the relative difference (max |a - b| / max |b|).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from autoshard.execute import train_ops
from autoshard.execute.simulate import run_collective
from autoshard.execute.verify import TINY, VerifyError, assemble, input_specs, random_inputs
from autoshard.ir.graph import Graph, Op
from autoshard.passes.partition import DeviceProgram, LocalCollective, LocalCompute, Partitioned
from autoshard.program import Compute
from autoshard.rules.gradient import TRAIN, TrainOp
from autoshard.training.options import Precision, Training
from autoshard.training.step import gradient_name

TOLERANCE = 1e-5


@dataclass(frozen=True)
class Check:
    """How far one trained quantity is from the reference after one step (`rank` None: the
    loss, compared whole)."""

    step: int
    what: str  # loss, gradient, weight
    name: str
    rank: int | None
    max_rel_err: float
    max_abs_err: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_rel_err <= self.tolerance

    def line(self) -> str:
        where = f"rank {self.rank}" if self.rank is not None else "all ranks"
        return (
            f"step {self.step}, {where}: {self.what} of {self.name} differs from torch autograd "
            f"by {self.max_rel_err:.3g} relative (max abs {self.max_abs_err:.3g}, "
            f"tolerance {self.tolerance:g})"
        )


@dataclass(frozen=True)
class TrainingReport:
    checks: tuple[Check, ...]
    devices: int
    steps: int

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.ok)

    def worst(self, what: str) -> float:
        return max((c.max_rel_err for c in self.checks if c.what == what), default=0.0)

    def to_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "devices": self.devices,
            "steps": self.steps,
            "max_rel_err": {w: self.worst(w) for w in ("loss", "gradient", "weight")},
            "failures": [f.line() for f in self.failures],
        }


def check_training(training: Training) -> None:
    if training.precision is not Precision.FP32:
        raise VerifyError(
            f"verify runs training steps in fp32 only; partition with --precision fp32 "
            f"(this one is {training.precision})"
        )
    if training.micro_batches != 1:
        raise VerifyError("verify runs training steps of one micro-batch; this one has "
                          f"{training.micro_batches}")  # fmt: skip


def _torch(array: Any) -> Any:
    array = np.asarray(array)
    return torch.from_numpy(array.astype(np.float32) if array.dtype.kind == "f" else array.copy())


class _Device:
    """One device's program, its step list from steps.json and the tensors it holds."""

    def __init__(
        self,
        program: DeviceProgram,
        steps: Sequence[Mapping[str, Any]],
        graph: Graph,
        program_ops: Mapping[int, Op],
    ):
        self.program, self.graph, self.program_ops = program, graph, program_ops
        self.step_of = {o.name: i for i, o in program_ops.items()}
        self.ops = {s.op.name: s.op for s in program.steps if isinstance(s, LocalCompute)}
        self.collectives = [s for s in program.steps if isinstance(s, LocalCollective)]
        self.steps = steps
        self.env: dict[str, Any] = {}  # every tensor of the running step
        self.held: dict[str, Any] = {}  # constants, weights and optimizer state across steps
        self.position = 0

    def advance(self, step: int, nodes: Mapping[str, list[tuple[str, str]]]) -> int | None:
        """Run the device's steps up to its next collective; return its index (None: done)."""
        while self.position < len(self.steps):
            entry = self.steps[self.position]
            self.position += 1
            if "collective" in entry:
                return int(entry["collective"])
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
        except RuntimeError as error:  # torch's own error type
            raise VerifyError(
                f"device {index}: op {op.name!r} failed: {str(error).splitlines()[0]}"
            ) from None
        for name, result in zip(op.outputs, results, strict=False):
            if not name:
                continue
            if tuple(result.shape) != tuple(self.program.shapes[name]):
                raise VerifyError(
                    f"device {index}: tensor {name!r} of op {op.name!r} has local shape "
                    f"{list(result.shape)}; the partition says {list(self.program.shapes[name])}"
                )
            self.env[name] = result.detach()

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
        for j, local in enumerate(forward.inputs[:count]):
            if local and local != op.inputs[j] and local in self.held:
                args[j] = self.held[local]
        shapes = [self.program.shapes.get(n, ()) for n in forward.inputs]
        result = self.program.shapes[op.outputs[0]]
        return train_ops.train_op(op, forward, args, shapes, step, count, result)

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


def _segment_nodes(folder: Path, manifest: Mapping[str, Any]) -> dict[str, list[tuple[str, str]]]:
    """Each segment file's nodes (name, type) in order."""
    out: dict[str, list[tuple[str, str]]] = {}
    for device in manifest["devices"]:
        for entry in device["steps"]:
            path = entry.get("run")
            if path is not None and path not in out:
                model = onnx.load(os.fspath(folder / path))
                out[path] = [(n.name, n.op_type) for n in model.graph.node]
    return out


class _Partitioned:
    """Every device of the partition, stepped together."""

    def __init__(
        self, partitioned: Partitioned, graph: Graph, manifest: Mapping[str, Any], folder: Path
    ):
        self.partitioned, self.graph = partitioned, graph
        ops = {i: s.op for i, s in enumerate(partitioned.program.steps) if isinstance(s, Compute)}
        self.devices = [
            _Device(d, m["steps"], graph, ops)
            for d, m in zip(partitioned.devices, manifest["devices"], strict=True)
        ]
        self.nodes = _segment_nodes(folder, manifest)
        self.outputs = dict(zip(graph.outputs, partitioned.program.outputs, strict=True))
        tensors = partitioned.program.tensors
        for new, old in graph.updates.items():
            made, held = tensors[self.outputs[new]].sharding, tensors[old].sharding
            if made != held:  # the next step reads the update's result as the held value
                raise VerifyError(f"the update returns {new} as {made} but {old} is held {held}")

    def start(self, weights: Mapping[int, Mapping[str, Any]]) -> None:
        program = self.partitioned.program
        for device in self.devices:
            env = {n: _torch(v) for n, v in program.constants.items()}
            env.update({n: _torch(v) for n, v in device.program.constants.items()})
            env.update(weights[device.program.index])
            device.held = env

    def step(self, step: int, inputs: Mapping[str, np.ndarray]) -> None:
        for device in self.devices:
            device.env = dict(device.held)
            device.position = 0
            for name, array in inputs.items():
                region = self.partitioned.slices(name, device.program.index)
                device.env[name] = _torch(array[tuple(slice(a, b) for a, b in region)])
        while True:
            at = [d.advance(step, self.nodes) for d in self.devices]
            if all(j is None for j in at):
                break
            self.collective(at)
        for device in self.devices:
            for new, old in self.graph.updates.items():
                device.held[old] = device.env[self.outputs[new]]

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
        local = {d.program.device: d.env[step.source].numpy() for d in self.devices}
        moved = run_collective(step.collective, self.partitioned.mesh, local)
        for d in self.devices:
            d.env[step.target] = _torch(moved[d.program.device])


def _name(device: _Device, j: int | None) -> str:
    if j is None:
        return "no more collectives"
    step = device.collectives[j]
    return f"collective {j} ({step.collective.kind} of {step.source})"


def reference_steps(
    model: str | os.PathLike[str], trained: Sequence[str], optimizer: str,
    inputs: Sequence[Mapping[str, np.ndarray]],
) -> list[tuple[float, dict[str, np.ndarray], dict[str, np.ndarray]]]:  # fmt: skip
    """PyTorch autograd and torch.optim on the original ONNX file: per step, the loss, every
    trained weight's gradient and its value after the step."""
    proto = onnx.load(os.fspath(model))
    values = {i.name: _torch(numpy_helper.to_array(i)) for i in proto.graph.initializer}
    parameters = {n: values[n].clone().requires_grad_(True) for n in trained}
    values.update(parameters)
    step_of = train_ops.reference_optimizer(optimizer, list(parameters.values()))
    out = []
    for feed in inputs:
        outputs = run_model(proto, dict(values) | {n: _torch(a) for n, a in feed.items()})
        loss = sum(o.sum() for o in outputs.values())
        for p in parameters.values():
            p.grad = None
        loss.backward()
        grads = {n: p.grad.detach().clone().numpy() for n, p in parameters.items()}
        if step_of is not None:
            step_of.step()
        weights = {n: p.detach().clone().numpy() for n, p in parameters.items()}
        out.append((float(loss.detach()), grads, weights))
    return out


def run_model(proto: onnx.ModelProto, values: Mapping[str, Any]) -> dict[str, Any]:
    """The model's outputs by name, its nodes run as torch ops on `values` (initializers and
    inputs by name)."""
    env = dict(values)
    for node in proto.graph.node:
        attrs = {a.name: _attribute(a) for a in node.attribute}
        args = [env[n] if n else None for n in node.input]
        results = train_ops.forward(node.op_type, attrs, args, len(node.output))
        env.update({n: r for n, r in zip(node.output, results, strict=False) if n})
    return {o.name: env[o.name] for o in proto.graph.output}


def _attribute(attribute: onnx.AttributeProto) -> Any:
    value = helper.get_attribute_value(attribute)
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    return tuple(value) if isinstance(value, list) else value


def _errors(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    diff = float(np.max(np.abs(a.astype(np.float64) - b))) if a.size else 0.0
    return diff / max(float(np.max(np.abs(b))) if b.size else 0.0, TINY), diff


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
) -> TrainingReport:
    """Train the partition of `folder` (its steps.json, `graph` the training step, `weights`
    each device's own) `steps` steps on seeded random inputs, and check every step against
    the reference (`reference_steps`)."""
    check_training(training)
    states = set(graph.updates.values()) - set(graph.weights)
    trained = [w for w in graph.weights if gradient_name(w) in graph.values]
    specs = [s for s in input_specs(graph) if s.name not in states]
    feeds = [random_inputs(specs, seed + k) for k in range(steps)]
    reference = reference_steps(model, trained, str(training.optimizer), feeds)
    runner = _Partitioned(partitioned, graph, steps_manifest, Path(folder))
    start = {}
    for device in partitioned.devices:
        own = {n: _torch(a) for n, a in weights(device.index).items()}
        own |= {n: torch.zeros(tuple(device.shapes[n])) for n in states}
        start[device.index] = own
    runner.start(start)
    losses = [op.inputs[0] for op in graph.ops if op.type == TrainOp.LOSS_GRAD]
    checks: list[Check] = []
    for k, (loss, grads, new_weights) in enumerate(reference, start=1):
        runner.step(k, feeds[k - 1])
        total = sum(
            float(assemble(partitioned, n, [d.env[n].numpy() for d in runner.devices])[0].sum())
            for n in losses
        )
        rel, diff = _errors(np.asarray([total]), np.asarray([loss]))
        checks.append(Check(k, "loss", "+".join(losses), None, rel, diff, TOLERANCE))
        for w in trained:
            checks.append(_compare(runner, k, "gradient", w, gradient_name(w), grads[w], False))
            if w in graph.updates.values():
                checks.append(_compare(runner, k, "weight", w, w, new_weights[w], True))
    return TrainingReport(tuple(checks), len(partitioned.devices), steps)


def _compare(
    runner: _Partitioned, step: int, what: str, name: str, tensor: str, want: np.ndarray,
    held: bool,
) -> Check:  # fmt: skip
    """Each device's shard of `tensor` (a held one: its value after the update) against its
    region of `want`; the worst device's errors."""
    partitioned = runner.partitioned
    sharding = partitioned.program.tensors[tensor].sharding
    arrays = [(d.held if held else d.env)[tensor].numpy() for d in runner.devices]
    if sharding.partial_axes:
        rel, diff = _errors(assemble(partitioned, tensor, arrays)[0], want)
        return Check(step, what, name, None, rel, diff, TOLERANCE)
    worst = (-1.0, 0.0, 0)
    for device, array in zip(partitioned.devices, arrays, strict=True):
        region = tuple(slice(a, b) for a, b in partitioned.slices(tensor, device.index))
        rel, diff = _errors(array, want[region])
        worst = max(worst, (rel, diff, device.index))
    return Check(step, what, name, worst[2], worst[0], worst[1], TOLERANCE)
