"""The executable form of a training step's ops, in one place: ONNX ops as differentiable torch
functions (`forward`), and the ops a training step adds (`rules.gradient.TrainOp`) on top of
them (`train_op`).

    forward(op_type, attrs, args)     ONNX semantics, every result; a float tensor stays in
                                      torch's autograd graph
    train_op(op, forward_op, args, shapes, step)
      LossGrad   ones of the output's local shape: the step's loss is the sum of every element
                 of its outputs (a cross-entropy loss is an op of the step, `training.loss`,
                 whose one output is the loss)
      Grad       the forward op, as the device runs it, run again on the operands it reads
                 (zeros where it reads none: a linear op's gradient does not depend on them) and
                 differentiated by autograd with respect to operand `operand`, given its
                 results' gradients (`gradient`; an op the partition rewrote into several
                 local ops, a masked lookup, is differentiated through them)
      GradSync   the gradient as synchronized: the collective before it did the sync
      Update     the optimizer's update of one weight (`OPTIMIZER_SETTINGS`), as torch.optim
                 computes it: (gradient, weight, state) -> (next weight, next state)

The same `forward` runs the single-process reference (`autoshard.execute.train_verify`), on
the original ONNX file's nodes, so the two sides share ONNX semantics and nothing else: the
reference never sees a sharding, a collective or a gradient op.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from autoshard.errors import AutoshardError
from autoshard.ir.graph import Op
from autoshard.rules.gradient import TrainOp
from autoshard.training.options import OPTIMIZER_SETTINGS, Optimizer

Tensor = Any  # torch.Tensor (torch's stubs make every tensor Any here)


class NoTorchForm(AutoshardError):
    """An op with no torch form here: the training step cannot be executed."""


def _shape(value: Any) -> list[int]:
    return [int(v) for v in value.reshape(-1).tolist()]


def _reshape(attrs: Mapping[str, Any], args: Sequence[Tensor]) -> Tensor:
    x, target = args[0], _shape(args[1])
    if not attrs.get("allowzero", 0):
        target = [x.shape[i] if t == 0 else t for i, t in enumerate(target)]
    return x.reshape(target)


def _gemm(attrs: Mapping[str, Any], args: Sequence[Tensor]) -> Tensor:
    a = args[0].t() if attrs.get("transA", 0) else args[0]
    b = args[1].t() if attrs.get("transB", 0) else args[1]
    y = float(attrs.get("alpha", 1.0)) * (a @ b)
    if len(args) > 2 and args[2] is not None:
        y = y + float(attrs.get("beta", 1.0)) * args[2]
    return y


def _softmax(attrs: Mapping[str, Any], args: Sequence[Tensor]) -> Tensor:
    return torch.softmax(args[0], dim=int(attrs.get("axis", -1)))


def _reduce(name: str) -> Any:
    def run(attrs: Mapping[str, Any], args: Sequence[Tensor]) -> Tensor:
        x = args[0]
        axes = _shape(args[1]) if len(args) > 1 and args[1] is not None else attrs.get("axes")
        keep = bool(attrs.get("keepdims", 1))
        dims = list(range(x.dim())) if not axes else [int(a) for a in axes]
        return getattr(torch, name)(x, dim=dims, keepdim=keep)

    return run


def _gather(attrs: Mapping[str, Any], args: Sequence[Tensor]) -> Tensor:
    x, indices = args[0], args[1].long()
    axis = int(attrs.get("axis", 0)) % x.dim()
    indices = torch.where(indices < 0, indices + x.shape[axis], indices)
    picked = x.index_select(axis, indices.reshape(-1))
    return picked.reshape((*x.shape[:axis], *indices.shape, *x.shape[axis + 1 :]))


def _gather_nd(attrs: Mapping[str, Any], args: Sequence[Tensor]) -> Tensor:
    """ONNX GatherND without batch dims: each index row picks a slice of the leading dims."""
    x, indices = args[0], args[1].long()
    if int(attrs.get("batch_dims", 0)):
        raise NoTorchForm("op type GatherND with batch_dims has no torch form for a training step")
    k = indices.shape[-1]
    rows = indices.reshape(-1, k)
    picked = x[tuple(rows[:, j] % x.shape[j] for j in range(k))]
    return picked.reshape((*indices.shape[:-1], *x.shape[k:]))


def _axes(attrs: Mapping[str, Any], args: Sequence[Tensor]) -> list[int] | None:
    if len(args) > 1 and args[1] is not None:
        return _shape(args[1])
    axes = attrs.get("axes")
    return None if axes is None else [int(a) for a in axes]


def _unsqueeze(attrs: Mapping[str, Any], args: Sequence[Tensor]) -> Tensor:
    x, axes = args[0], _axes(attrs, args) or []
    rank = x.dim() + len(axes)
    for axis in sorted(a % rank for a in axes):
        x = x.unsqueeze(axis)
    return x


def _squeeze(attrs: Mapping[str, Any], args: Sequence[Tensor]) -> Tensor:
    x, axes = args[0], _axes(attrs, args)
    if axes is None:
        return x.squeeze()
    return x.squeeze(tuple(a % x.dim() for a in axes))


def _slice(attrs: Mapping[str, Any], args: Sequence[Tensor]) -> Tensor:
    x = args[0]
    starts, ends = _shape(args[1]), _shape(args[2])
    axes = _shape(args[3]) if len(args) > 3 and args[3] is not None else range(len(starts))
    steps = _shape(args[4]) if len(args) > 4 and args[4] is not None else [1] * len(starts)
    index = [slice(None)] * x.dim()
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        index[axis % x.dim()] = slice(start, end, step)
    return x[tuple(index)]


_ZERO = np.zeros(1, np.float32)  # ConstantOfShape's default value
_CAST = {1: torch.float32, 6: torch.int32, 7: torch.int64, 9: torch.bool, 10: torch.float16,
         11: torch.float64, 16: torch.bfloat16}  # fmt: skip


def _split(attrs: Mapping[str, Any], args: Sequence[Tensor], outputs: int) -> list[Tensor]:
    x, axis = args[0], int(attrs.get("axis", 0))
    if len(args) > 1 and args[1] is not None:
        sizes = _shape(args[1])
    elif "split" in attrs:
        sizes = [int(v) for v in attrs["split"]]
    else:
        count = int(attrs.get("num_outputs", outputs))
        size = -(-x.shape[axis] // count)
        sizes = [min(size, x.shape[axis] - k * size) for k in range(count)]
    return list(torch.split(x, sizes, dim=axis))


def _layer_norm(attrs: Mapping[str, Any], args: Sequence[Tensor]) -> Tensor:
    x = args[0]
    axis = int(attrs.get("axis", -1)) % x.dim()
    bias = args[2] if len(args) > 2 else None
    epsilon = float(attrs.get("epsilon", 1e-5))
    return torch.nn.functional.layer_norm(x, x.shape[axis:], args[1], bias, epsilon)


def _rms_norm(attrs: Mapping[str, Any], args: Sequence[Tensor]) -> Tensor:
    """RMSNormalization-23: x / sqrt(mean(x^2 over the dims from `axis`) + epsilon) * scale."""
    x = args[0]
    dims = list(range(int(attrs.get("axis", -1)) % x.dim(), x.dim()))
    epsilon = float(attrs.get("epsilon", 1e-5))
    return x * torch.rsqrt((x * x).mean(dim=dims, keepdim=True) + epsilon) * args[1]


def _heads(x: Tensor, count: int) -> Tensor:
    """A 3-D (batch, seq, heads * size) operand of Attention as 4-D (batch, heads, seq, size)."""
    if x.dim() == 4:
        return x
    return x.reshape(x.shape[0], x.shape[1], count, -1).transpose(1, 2)


def _attention(attrs: Mapping[str, Any], args: Sequence[Tensor], outputs: int) -> list[Tensor]:
    """Attention-23 without a past key/value cache: softmax(scale Q K^T + mask) V, the key and
    value heads repeated for grouped queries, a fully masked row all zeros (as ONNX defines
    it); the present key and value are K and V."""
    if any(a is not None for a in args[4:]) or outputs > 3:
        raise NoTorchForm("Attention with a past key/value cache or its QK output has no torch "
                          "form for a training step")  # fmt: skip
    q = _heads(args[0], int(attrs.get("q_num_heads", 0)))
    k = _heads(args[1], int(attrs.get("kv_num_heads", 0)))
    v = _heads(args[2], int(attrs.get("kv_num_heads", 0)))
    group = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = attrs.get("scale") or 1.0 / float(q.shape[-1]) ** 0.5
    scores = (q * float(scale)) @ keys.transpose(-1, -2)
    softcap = float(attrs.get("softcap", 0.0))
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    mask = args[3] if len(args) > 3 else None
    if mask is not None:
        bias = mask if mask.dtype != torch.bool else torch.zeros(mask.shape).masked_fill(
            ~mask, float("-inf"))  # fmt: skip
        scores = scores + bias
    if attrs.get("is_causal", 0):
        allowed = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    probabilities = torch.softmax(scores, dim=-1)
    probabilities = torch.where(torch.isnan(probabilities), 0.0, probabilities)
    y = probabilities @ values
    if args[0].dim() == 3:
        y = y.transpose(1, 2).reshape(args[0].shape[0], args[0].shape[1], -1)
    return [y, args[1], args[2]][:outputs]


_ONE: dict[str, Callable[[Tensor], Tensor]] = {
    "Relu": torch.relu, "Tanh": torch.tanh, "Sigmoid": torch.sigmoid, "Exp": torch.exp,
    "Neg": torch.neg, "Sqrt": torch.sqrt, "Erf": torch.erf, "Log": torch.log,
    "Identity": lambda x: x, "Reciprocal": torch.reciprocal, "Not": torch.logical_not,
    "IsNaN": torch.isnan,
}  # fmt: skip
_TWO: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "MatMul": torch.matmul, "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul,
    "Div": torch.div, "Pow": torch.pow, "Max": torch.maximum, "Min": torch.minimum,
    "And": torch.logical_and, "Or": torch.logical_or, "Equal": torch.eq, "Less": torch.lt,
    "LessOrEqual": torch.le, "Greater": torch.gt, "GreaterOrEqual": torch.ge,
}  # fmt: skip
_OTHER: dict[str, Callable[[Mapping[str, Any], Sequence[Tensor]], Tensor]] = {
    "Gemm": _gemm,
    "Reshape": _reshape,
    "Softmax": _softmax,
    "Transpose": lambda attrs, args: args[0].permute(
        *(attrs.get("perm") or range(args[0].dim() - 1, -1, -1))
    ),
    "ReduceSum": _reduce("sum"),
    "ReduceMean": _reduce("mean"),
    "ReduceMax": _reduce("amax"),
    "Sum": lambda attrs, args: sum(args[1:], args[0]),
    "Gather": _gather,
    "GatherND": _gather_nd,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Slice": _slice,
    "Concat": lambda attrs, args: torch.cat(list(args), dim=int(attrs["axis"])),
    "Cast": lambda attrs, args: args[0].to(_CAST[int(attrs["to"])]),
    "Shape": lambda attrs, args: torch.tensor(args[0].shape, dtype=torch.int64)[
        attrs.get("start", 0) : attrs.get("end")
    ],
    "ConstantOfShape": lambda attrs, args: torch.from_numpy(
        np.full(_shape(args[0]), np.asarray(attrs.get("value", _ZERO)).reshape(-1)[0])
    ),
    "Range": lambda attrs, args: torch.arange(args[0].item(), args[1].item(), args[2].item(),
                                              dtype=args[0].dtype),
    "Where": lambda attrs, args: torch.where(args[0], args[1], args[2]),
    "Flatten": lambda attrs, args: args[0].reshape(
        int(torch.tensor(args[0].shape[: int(attrs.get("axis", 1))]).prod()), -1
    ),
    "Expand": lambda attrs, args: args[0].expand(
        torch.broadcast_shapes(args[0].shape, tuple(_shape(args[1])))
    ),
    "LayerNormalization": _layer_norm,
    "RMSNormalization": _rms_norm,
}  # fmt: skip


def forward(
    op_type: str, attrs: Mapping[str, Any], args: Sequence[Tensor], outputs: int = 1
) -> list[Tensor]:
    """The results of ONNX op `op_type` on `args` (None where an operand is omitted) with
    `outputs` results."""
    if op_type in _ONE:
        return [_ONE[op_type](args[0])]
    if op_type in _TWO:
        return [_TWO[op_type](args[0], args[1])]
    if op_type == "Split":
        return _split(attrs, args, outputs)
    if op_type == "Attention":
        return _attention(attrs, args, outputs)
    if op_type in _OTHER:
        return [_OTHER[op_type](attrs, args)]
    if op_type == "Constant":
        return [torch.from_numpy(np.array(attrs["value"]))]
    supported = sorted([*_ONE, *_TWO, *_OTHER, "Attention", "Constant", "Split"])
    raise NoTorchForm(
        f"op type {op_type} has no torch form for a training step; supported: "
        + ", ".join(supported)
    )


def train_op(
    op: Op,
    forward_op: Op | None,
    args: Sequence[Tensor],
    shapes: Sequence[Sequence[int]],
    step: int,
    operands: int = 0,
    result: Sequence[int] = (),
) -> list[Tensor]:
    """The results of training op `op` (see the module docstring); `forward_op` is the op a
    Grad differentiates as this device runs it (a local rewrite may leave out an operand: the
    bias of a partial sum's Gemm on all devices but one), `shapes` the local shapes of its
    operands, `operands` how many operands the graph's forward op has (the Grad reads them,
    then its results' gradients), `result` the local shape of a Grad's result, `step` counts
    from 1."""
    kind = TrainOp(op.type)
    if kind is TrainOp.LOSS_GRAD:
        return [torch.ones_like(args[0])]
    if kind is TrainOp.GRAD_SYNC:
        return [args[0]]
    if kind is TrainOp.UPDATE:
        return list(update(str(op.attr("optimizer")), args[0], args[1], args[2], step))
    assert forward_op is not None
    operand = int(op.attr("operand", 0))  # type: ignore[arg-type]
    if operand >= len(forward_op.inputs) or not forward_op.inputs[operand]:
        return [torch.zeros(tuple(result))]  # the local op does not read it
    # The operand differentiated has the local shape of its gradient: a Grad may run at
    # another sharding than its forward op (a weight's gradient by row slices, ZeRO).
    shapes = [tuple(result) if j == operand and result else s for j, s in enumerate(shapes)]
    return [_gradient(op, forward_op, args[:operands], args[operands:], shapes)]


def _gradient(
    op: Op,
    forward_op: Op,
    reads: Sequence[Tensor],
    gradients: Sequence[Tensor],
    shapes: Sequence[Sequence[int]],
) -> Tensor:
    """The gradient of operand `operand` of `forward_op` (as this device runs it) given its
    results' `gradients`."""
    local = [
        reads[j] if j < len(reads) and reads[j] is not None
        else (torch.zeros(tuple(shapes[j])) if name else None)
        for j, name in enumerate(forward_op.inputs)
    ]  # fmt: skip
    attrs, count = dict(forward_op.attrs), len(forward_op.outputs)
    return gradient(
        int(op.attr("operand", 0)),  # type: ignore[arg-type]
        lambda operands: forward(forward_op.type, attrs, operands, count),
        local,
        gradients,
    )


def gradient(
    operand: int,
    run: Callable[[list[Tensor]], list[Tensor]],
    operands: Sequence[Tensor],
    gradients: Sequence[Tensor],
) -> Tensor:
    """The gradient of `run`'s operand `operand` at `operands`, given its results' gradients
    (None: a result no one reads): `run` is one op, or the local ops a partition rewrote it
    into (a masked lookup)."""
    values = list(operands)
    target = values[operand].detach().requires_grad_(True)
    values[operand] = target
    with torch.enable_grad():
        results = run(values)
        pairs = [(r, g) for r, g in zip(results, gradients, strict=False) if g is not None]
        (grad,) = torch.autograd.grad(
            [r for r, _ in pairs], [target], [g for _, g in pairs], allow_unused=True
        )
    return torch.zeros_like(target) if grad is None else grad.detach()


def update(
    optimizer: str, grad: Tensor, weight: Tensor, state: Tensor, step: int
) -> tuple[Tensor, Tensor]:
    """One optimizer step of `weight` as torch.optim takes it (Adam, AdamW, SGD with momentum,
    `OPTIMIZER_SETTINGS`), `state` its planes (Adam: m, v; SGD: the momentum buffer). Under
    mixed precision the state's first plane is the master weight (`Training.state_planes`):
    the step updates it in the state's dtype from the gradient cast up, and the weight is its
    copy in the weight's dtype."""
    kind = Optimizer(optimizer)
    if kind is Optimizer.NONE:
        return weight, state
    if state.shape[0] == kind.moments:
        return _step(kind, grad, weight, state, step)
    master, moments = _step(kind, grad.to(state.dtype), state[0], state[1:], step)
    return master.to(weight.dtype), torch.cat([master.unsqueeze(0), moments])


def _step(
    kind: Optimizer, grad: Tensor, weight: Tensor, state: Tensor, step: int
) -> tuple[Tensor, Tensor]:
    s = OPTIMIZER_SETTINGS
    if kind is Optimizer.SGD:
        momentum = s.momentum * state[0] + grad
        return weight - s.lr * momentum, momentum.unsqueeze(0)
    decay = s.adamw_weight_decay if kind is Optimizer.ADAMW else 0.0
    weight = weight * (1 - s.lr * decay)
    m = s.beta1 * state[0] + (1 - s.beta1) * grad
    v = s.beta2 * state[1] + (1 - s.beta2) * grad * grad
    correction1, correction2 = 1 - s.beta1**step, 1 - s.beta2**step
    denominator = v.sqrt() / correction2**0.5 + s.eps
    return weight - (s.lr / correction1) * m / denominator, torch.stack([m, v])


def reference_optimizer(optimizer: str, parameters: Sequence[Tensor]) -> Any:
    """torch.optim's own optimizer of `parameters` with `OPTIMIZER_SETTINGS` (the reference
    step never calls `update`)."""
    s, kind = OPTIMIZER_SETTINGS, Optimizer(optimizer)
    if kind is Optimizer.SGD:
        return torch.optim.SGD(parameters, lr=s.lr, momentum=s.momentum)
    if kind is Optimizer.ADAMW:
        return torch.optim.AdamW(
            parameters, lr=s.lr, betas=(s.beta1, s.beta2), eps=s.eps,
            weight_decay=s.adamw_weight_decay,
        )  # fmt: skip
    if kind is Optimizer.ADAM:
        return torch.optim.Adam(parameters, lr=s.lr, betas=(s.beta1, s.beta2), eps=s.eps)
    return None
