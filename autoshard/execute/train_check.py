"""A trained partition checked against its single-process reference, step by step: what is
compared, the reference itself, and the comparison, shared by the in-process `verify`
(`execute.train_verify`) and the distributed `run` (`run.train`).

The reference is single-process: the original ONNX file's nodes run as torch ops
(`train_ops.forward`), the loss differentiated by `backward()` (`reference_loss`: the outputs'
sum, or torch's own `cross_entropy` of the first output against the labels, never the ops
`training.loss` plans), and torch.optim's optimizer steps the weights. After every step the
loss, every synchronized gradient, every updated weight and every optimizer state are
compared, each device's shard with the reference's region of it: a mismatch names the step,
the rank, the parameter and the relative difference (max |a - b| over the shard / max |b|
over the whole tensor: a torch.testing-like absolute tolerance scaled to the tensor, since a
region can be all zeros but for rounding). Each reference step starts from the weights and
optimizer states the partition holds after the step before (`ReferenceRun`): float32
rounding, which a few steps of training amplify, does not compound across the steps compared.

An optimizer state is held as its planes stacked before the weight's dims (Adam: m then v;
SGD: the momentum buffer), as `training.step` lays it out; torch.optim's state of the weight
is stacked the same way to compare.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from autoshard.execute import train_ops
from autoshard.execute.verify import TINY, VerifyError, assemble
from autoshard.ir.graph import Graph
from autoshard.passes.partition import Partitioned
from autoshard.rules.gradient import TrainOp
from autoshard.training.loss import LABELS
from autoshard.training.options import Loss, Precision, Training, parse_choice
from autoshard.training.step import gradient_name, state_name

TOLERANCE = 1e-5
REFERENCE = np.float64
"""The reference computes in float64: the plan runs in float32 and is compared with the exact
step, so the reference's own rounding (another order of summation) does not count against it."""
_TORCH_FLOATS = {np.float64: torch.float64, np.float32: torch.float32}
KINDS = ("loss", "gradient", "weight", "state")
# torch.optim's names of a weight's state, in the order `train_ops.update` stacks them.
_STATE_KEYS = {"adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq"),
               "sgd": ("momentum_buffer",)}  # fmt: skip


@dataclass(frozen=True)
class Check:
    """How far one trained quantity is from the reference after one step (`rank` None: the
    loss, or a partial sum compared whole)."""

    step: int
    what: str  # one of KINDS
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
    timing: Mapping[str, object] | None = None  # a distributed run's wall times
    floats: str = "float32"  # what the partition's step computed in

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.ok)

    def worst(self, what: str) -> float:
        return max((c.max_rel_err for c in self.checks if c.what == what), default=0.0)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "ok": self.ok,
            "devices": self.devices,
            "steps": self.steps,
            "floats": self.floats,
            "max_rel_err": {w: self.worst(w) for w in KINDS},
            "failures": [f.line() for f in self.failures],
        }
        if self.timing is not None:
            out["timing"] = dict(self.timing)
        return out


def check_training(training: Training, loss: str | None = None) -> None:
    """Refuse a step this executor does not run, or a `loss` asked for (`--loss`, None: the
    plan's) that is not the one the step was planned with."""
    if loss is not None and parse_choice(Loss, loss, "loss") is not training.loss:
        raise VerifyError(
            f"--loss {loss} disagrees with the partition's loss {training.loss} (its manifest): "
            f"the loss is planned with the step; partition again with --loss {loss}"
        )
    if training.precision not in (Precision.FP32, Precision.BF16_MIXED):
        raise VerifyError(
            f"training steps run in fp32 and bf16-mixed; partition with --precision fp32 or "
            f"bf16-mixed (this one is {training.precision})"
        )


FLOATS = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
"""What a partition's training step may compute in: its own float32 or bfloat16 (a
bf16-mixed plan's, its optimizer states in float32), or float64 to tell a plan's error from
rounding (the order of summation differs from the reference's)."""

BF16_TOLERANCE = 5e-2
"""A bf16-mixed step against the reference in the same precision: bfloat16 keeps 8
significant bits, so one rounding moves a value by up to 2^-9 (2e-3) of it, and a sum
made in another order (each shard's, then the all_reduce's, against the whole one's) by
several; a value near cancellation (a gradient summed over the batch) by more, relative
to the largest of its tensor. A plan's error (a missing or doubled sync, a wrong split)
moves a tensor by a fraction of itself, far past it. Float32 and float64 steps keep
`TOLERANCE`."""


def floats_of(training: Training, floats: str) -> str:
    """What a step of `training` computes in when asked for `floats`: a bf16-mixed plan in
    bfloat16 unless float64 is asked for."""
    if training.precision is Precision.BF16_MIXED and floats == "float32":
        return "bfloat16"
    return floats


def tolerance_of(floats: str) -> float:
    return BF16_TOLERANCE if floats == "bfloat16" else TOLERANCE


@contextlib.contextmanager
def computing_in(floats: str) -> Iterator[None]:
    """Every float tensor made inside is a `floats` one (torch's default dtype, restored)."""
    if floats not in FLOATS:
        raise VerifyError(f"unknown float type {floats!r}; valid: {', '.join(FLOATS)}")
    saved = torch.get_default_dtype()
    torch.set_default_dtype(FLOATS[floats])
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def to_torch(array: Any, floats: Any = None) -> Any:
    """A torch tensor of `array`, its floats as `floats` (None: torch's default dtype)."""
    array = np.asarray(array)
    if array.dtype.name == "bfloat16":  # ml_dtypes': numpy's own kinds do not name it
        array = array.astype(np.float32)
    if array.dtype.kind != "f":
        return torch.from_numpy(array.copy())
    if floats is None:
        return torch.from_numpy(array.astype(np.float64)).to(torch.get_default_dtype())
    return torch.from_numpy(array.astype(floats))


@dataclass(frozen=True)
class Checked:
    """What a training step's checks read: the trained weights, the tensors summed into the
    loss, and the optimizer states (a weight's `state_name`, where it has one)."""

    trained: tuple[str, ...]
    losses: tuple[str, ...]
    states: tuple[str, ...]
    updated: frozenset[str]

    @classmethod
    def of(cls, graph: Graph) -> Checked:
        held = set(graph.updates.values())
        trained = tuple(w for w in graph.weights if gradient_name(w) in graph.values)
        losses = tuple(op.inputs[0] for op in graph.ops if op.type == TrainOp.LOSS_GRAD)
        states = tuple(state_name(w) for w in trained if state_name(w) in held)
        return cls(trained, losses, states, frozenset(held))

    @property
    def computed(self) -> tuple[str, ...]:
        """The tensors of a step a device's check reads: the loss terms and the gradients."""
        return (*self.losses, *(gradient_name(w) for w in self.trained))

    @property
    def held(self) -> tuple[str, ...]:
        """The tensors a device holds after a step that are checked: weights and states."""
        return (*(w for w in self.trained if w in self.updated), *self.states)


@dataclass(frozen=True)
class Reference:
    """One step of the reference: the loss, and per trained weight its gradient, its value
    after the step and its optimizer state (stacked planes)."""

    loss: float
    gradients: Mapping[str, np.ndarray]
    weights: Mapping[str, np.ndarray]
    states: Mapping[str, np.ndarray]


Start = tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]]
"""Where a reference step starts: the trained weights and their optimizer states (stacked
planes), whole."""


class ReferenceRun:
    """The single-process reference a step at a time: PyTorch autograd and torch.optim on the
    original ONNX file, in `floats`, differentiating `loss` of a step's whole batch
    (`reference_loss`; a step's inputs: one set per micro-batch). `low` (mixed precision, a
    torch dtype): the model runs in `low` on a copy of the weights, whose gradients step the
    `floats` master weights; a state is then the master stacked before the moments.

    A step given a `Start` takes it from those weights and states (the partition's after the
    step before, `held_start`; a mixed-precision state's first plane is the master), else
    from its own: each step is then compared with the exact step from the same point, and
    float32 rounding does not compound over the steps into the comparison."""

    def __init__(
        self, model: str | os.PathLike[str], trained: Sequence[str], optimizer: str,
        floats: Any = REFERENCE, loss: Loss = Loss.SUM, low: Any = None,
    ):  # fmt: skip
        self.proto = onnx.load(os.fspath(model))
        self.floats, self.optimizer, self.loss, self.low = floats, optimizer, loss, low
        initializers = self.proto.graph.initializer
        values = {i.name: to_torch(numpy_helper.to_array(i), floats) for i in initializers}
        self.masters = {n: values[n].clone().requires_grad_(True) for n in trained}
        self.computing = low or _TORCH_FLOATS[floats]
        self.values = {n: _to(v, self.computing) for n, v in values.items()}
        self.step_of = train_ops.reference_optimizer(optimizer, list(self.masters.values()))

    def step(
        self, feed: Sequence[Mapping[str, np.ndarray]], start: Start | None = None
    ) -> Reference:
        """One step on `feed` (one set of inputs per micro-batch), from `start` if given."""
        if start is not None:
            self._restart(*start)
        masters, low, computing = self.masters, self.low, self.computing
        copies = masters if low is None else {
            n: m.detach().to(low).requires_grad_(True) for n, m in masters.items()}  # fmt: skip
        values = self.values | copies
        batches = [{n: _to(to_torch(a, self.floats), computing) for n, a in micro.items()}
                   for micro in feed]  # fmt: skip
        outputs = [list(run_model(self.proto, values | b, computing).values()) for b in batches]
        total = reference_loss(self.loss, outputs, [batch.get(LABELS) for batch in batches])
        for n, p in masters.items():
            p.grad = copies[n].grad = None
        total.backward()
        for n, p in masters.items():
            p.grad = copies[n].grad.to(p.dtype)
        grads = {n: to_numpy(p.grad) for n, p in copies.items()}
        states = {}
        if self.step_of is not None:
            self.step_of.step()
            keys = _STATE_KEYS[self.optimizer]
            for n, p in masters.items():
                planes = [p] * (low is not None) + [self.step_of.state[p][k] for k in keys]
                states[n] = np.stack([to_numpy(plane) for plane in planes])
        weights = {n: to_numpy(p.to(computing)) for n, p in masters.items()}
        return Reference(float(total.detach()), grads, weights, states)

    def _restart(self, weights: Mapping[str, np.ndarray], states: Mapping[str, np.ndarray]) -> None:
        """The master weights and optimizer states set to `weights` and `states` (a
        mixed-precision state's first plane: the master, which its rounded weight is not)."""
        keys = (("master",) if self.low is not None else ()) + _STATE_KEYS[self.optimizer]
        with torch.no_grad():
            for n, array in weights.items():
                self.masters[n].copy_(to_torch(array, self.floats))
            for n, planes in states.items():  # torch.optim made them in the step before
                master = self.masters[n]
                for key, plane in zip(keys, planes, strict=True):
                    target = master if key == "master" else self.step_of.state[master][key]
                    target.copy_(to_torch(plane, self.floats))


def held_start(
    partitioned: Partitioned, checked: Checked, held: Sequence[Mapping[str, np.ndarray]]
) -> Start:
    """The whole trained weights and optimizer states the devices hold after a step (`held[d]`
    device d's, `Checked.held`): where the reference takes the next step from."""
    weights = {
        w: assemble(partitioned, w, [h[w] for h in held])[0]
        for w in checked.trained
        if w in checked.updated
    }
    states = {
        w: assemble(partitioned, state_name(w), [h[state_name(w)] for h in held])[0]
        for w in checked.trained
        if state_name(w) in checked.states
    }
    return weights, states


def reference_of(
    model: str | os.PathLike[str], checked: Checked, training: Training, floats: str
) -> ReferenceRun:
    """The reference of a step of `training` computing in `floats`: float64 for a float32
    step (the exact step); for a mixed-precision one, its model in the step's dtype (bfloat16,
    or float64 for a float64 run) and its master weights and moments in float32."""
    optimizer = str(training.optimizer)
    if not training.precision.master_copy:
        return ReferenceRun(model, checked.trained, optimizer, loss=training.loss)
    masters = np.float64 if floats == "float64" else np.float32
    return ReferenceRun(model, checked.trained, optimizer, masters, training.loss, FLOATS[floats])


def _to(tensor: Any, dtype: Any) -> Any:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def to_numpy(tensor: Any) -> np.ndarray:
    """A tensor's values as numpy (bfloat16's as float32: numpy has no such type)."""
    tensor = tensor.detach().clone()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def reference_loss(loss: Loss, outputs: Sequence[Sequence[Any]], labels: Sequence[Any]) -> Any:
    """The loss of a batch as torch computes it, given the model's `outputs` and the `labels`
    of each of its micro-batches: every element of the outputs summed, or
    `torch.nn.functional.cross_entropy` (the mean over the batch's positions) of the first
    output, its classes on the last dim, against the labels."""
    if loss is Loss.SUM:
        return sum(o.sum() for micro in outputs for o in micro)
    logits = torch.cat([micro[0].reshape(-1, micro[0].shape[-1]) for micro in outputs])
    targets = torch.cat([t.reshape(-1) for t in labels]).long()
    return torch.nn.functional.cross_entropy(logits, targets)


def run_model(
    proto: onnx.ModelProto, values: Mapping[str, Any], floats: Any = None
) -> dict[str, Any]:
    """The model's outputs by name, its nodes run as torch ops on `values` (initializers and
    inputs by name); `floats`: the dtype every float result is made (a constant's, a cast's)."""
    env = dict(values)
    for node in proto.graph.node:
        attrs = {a.name: _attribute(a) for a in node.attribute}
        args = [env[n] if n else None for n in node.input]
        results = train_ops.forward(node.op_type, attrs, args, len(node.output))
        if floats is not None:
            results = [r.to(floats) if r.is_floating_point() else r for r in results]
        env.update({n: r for n, r in zip(node.output, results, strict=False) if n})
    return {o.name: env[o.name] for o in proto.graph.output}


def _attribute(attribute: onnx.AttributeProto) -> Any:
    value = helper.get_attribute_value(attribute)
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    return tuple(value) if isinstance(value, list) else value


def _errors(a: np.ndarray, b: np.ndarray, scale: float | None = None) -> tuple[float, float]:
    """max |a - b| relative to `scale` (None: max |b|), and absolute."""
    if not a.size:
        return 0.0, 0.0
    difference = np.abs(a.astype(np.float64) - b)
    diff = float(np.max(np.where(np.isnan(difference), np.inf, difference)))
    if scale is None:
        scale = float(np.max(np.abs(b)))
    return diff / max(scale, TINY), diff


def step_checks(
    partitioned: Partitioned,
    checked: Checked,
    step: int,
    reference: Reference,
    computed: Sequence[Mapping[str, np.ndarray]],
    held: Sequence[Mapping[str, np.ndarray]],
    tolerance: float = TOLERANCE,
) -> list[Check]:
    """Step `step`'s checks: `computed[d]` and `held[d]` are device d's tensors of the step
    (`Checked.computed`) and those it holds after it (`Checked.held`), each within
    `tolerance` (`tolerance_of` the step's floats)."""
    total = sum(
        float(assemble(partitioned, n, [c[n] for c in computed])[0].sum()) for n in checked.losses
    )
    rel, diff = _errors(np.asarray([total]), np.asarray([reference.loss]))
    checks = [Check(step, "loss", "+".join(checked.losses), None, rel, diff, tolerance)]
    for w in checked.trained:
        tensor, want = gradient_name(w), reference.gradients[w]
        checks.append(_compare(partitioned, step, ("gradient", w, tensor), want, computed,
                               tolerance))  # fmt: skip
        if w in checked.updated:
            want = reference.weights[w]
            checks.append(_compare(partitioned, step, ("weight", w, w), want, held, tolerance))
        if state_name(w) in checked.states:
            want = reference.states[w]
            checks.append(_compare(partitioned, step, ("state", w, state_name(w)), want, held,
                                   tolerance))  # fmt: skip
    return checks


def _compare(
    partitioned: Partitioned, step: int, compared: tuple[str, str, str], want: np.ndarray,
    tensors: Sequence[Mapping[str, np.ndarray]], tolerance: float,
) -> Check:  # fmt: skip
    """Each device's shard of `tensor` against its region of `want`, relative to the whole
    tensor's largest value (a shard may hold only values that are zero but for rounding:
    the key bias's gradient, which softmax cancels); the worst device's errors (a partial
    sum's: the sum compared whole). `compared`: (what, name, tensor)."""
    what, name, tensor = compared
    sharding = partitioned.program.tensors[tensor].sharding
    arrays = [t[tensor] for t in tensors]
    if sharding.partial_axes:
        rel, diff = _errors(assemble(partitioned, tensor, arrays)[0], want)
        return Check(step, what, name, None, rel, diff, tolerance)
    worst, scale = (-1.0, 0.0, 0), float(np.max(np.abs(want), initial=0.0))
    for device, array in zip(partitioned.devices, arrays, strict=True):
        region = tuple(slice(a, b) for a, b in partitioned.slices(tensor, device.index))
        rel, diff = _errors(array, want[region], scale)
        worst = max(worst, (rel, diff, device.index))
    return Check(step, what, name, worst[2], worst[0], worst[1], tolerance)
