"""ONNX ops as torch eager kernels, to time a device program's ops the way an eager PyTorch
model runs them (the fidelity bench, `autoshard.execute.fidelity`).

    kernel(op, args, shapes, torch) -> a closure running the op's kernel(s)

`args` are the op's operands as torch tensors (None where omitted), `shapes` its results' local
shapes. The closure is what is timed; everything decided from constant operands (an
exponent, a Split's sizes, a one-element operand a binary op takes as a number) is decided
before, once. Ops whose ONNX result is a new buffer (Transpose, Slice, Split, Expand) are
made contiguous, as their kernel writes it; views (Reshape, Squeeze, ...) stay views. An op
type without an entry has no kernel here (`KernelMissing`): the bench counts it apart.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autoshard.errors import AutoshardError
from autoshard.ir.graph import Op

Shapes = Sequence[tuple[int, ...]]
Kernel = Callable[[], object]


class KernelMissing(AutoshardError):
    """An op type this table has no torch kernel for."""


def _axis(op: Op, rank: int, default: int = 0) -> int:
    axis = int(op.attr("axis", default))  # type: ignore[arg-type]
    return axis + rank if axis < 0 else axis


SCALAR_SWAPPED: Mapping[str, str | None] = {
    "add": "add", "mul": "mul", "sub": "rsub", "div": None,
    "eq": "eq", "lt": "gt", "le": "ge", "gt": "lt", "ge": "le",
}  # fmt: skip
"""Binary ops torch runs with a Python number for an operand, as a model writes `x / 8.0` or
`1.0 - x` (the kernel reads the number once: a tensor of one element would be read
broadcast, the slower access on a GPU), and the op taking the number second when it came first."""


def _one_of(x: Any, other: Any) -> bool:
    return bool(x.numel() == 1 and other.numel() > 1 and x.dim() <= other.dim())


def _binary(name: str) -> Callable[..., Kernel]:
    def make(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
        function, a, b = getattr(torch, name), args[0], args[1]
        if name in SCALAR_SWAPPED and _one_of(b, a):
            second = b.reshape(-1)[0].item()
            return lambda: function(a, second)
        swapped = SCALAR_SWAPPED.get(name)
        if swapped is not None and _one_of(a, b):
            first, function = a.reshape(-1)[0].item(), getattr(torch, swapped)
            return lambda: function(b, first)
        return lambda: function(a, b)

    return make


def _unary(name: str) -> Callable[..., Kernel]:
    def make(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
        function, x = getattr(torch, name), args[0]
        return lambda: function(x)

    return make


def _pow(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
    x, e = args[0], args[1]
    exponent = float(e.reshape(-1)[0]) if e.numel() == 1 else e  # a model writes x ** 3.0
    return lambda: torch.pow(x, exponent)


def _gemm(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
    a = args[0].t() if op.attr("transA", 0) else args[0]
    b = args[1].t() if op.attr("transB", 0) else args[1]
    alpha, beta = float(op.attr("alpha", 1.0)), float(op.attr("beta", 1.0))  # type: ignore[arg-type]
    c = args[2] if len(args) > 2 else None
    if c is None:
        return lambda: torch.matmul(a, b)
    return lambda: torch.addmm(c, a, b, beta=beta, alpha=alpha)


def _softmax(log: bool) -> Callable[..., Kernel]:
    def make(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
        x = args[0]
        axis = _axis(op, x.dim(), -1)
        function = torch.log_softmax if log else torch.softmax
        return lambda: function(x, axis)

    return make


def _layer_norm(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else None
    axis = _axis(op, x.dim(), -1)
    eps = float(op.attr("epsilon", 1e-5))  # type: ignore[arg-type]
    normalized = tuple(x.shape[axis:])
    return lambda: torch.nn.functional.layer_norm(x, normalized, w, b, eps)


def _reduce(name: str) -> Callable[..., Kernel]:
    def make(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
        x = args[0]
        given: Any = op.attr("axes")
        if given is None and len(args) > 1 and args[1] is not None:
            given = args[1].reshape(-1).tolist()
        dims = tuple(range(x.dim())) if not given else tuple(int(a) for a in given)
        keep = bool(op.attr("keepdims", 1))
        if name == "amax":
            return lambda: torch.amax(x, dims, keep)
        function = getattr(torch, name)
        return lambda: function(x, dims, keep)

    return make


def _view(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
    x, shape = args[0], shapes[0]
    return lambda: x.reshape(shape)


def _copy_to(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
    """Slice (and the ops writing a part of their input): a copy of the result's region."""
    x, shape = args[0], shapes[0]
    region = tuple(slice(0, min(s, d)) for s, d in zip(shape, x.shape, strict=False))
    return lambda: x[region].contiguous()


def _transpose(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
    x = args[0]
    perm = op.attr("perm") or tuple(reversed(range(x.dim())))
    return lambda: x.permute(*perm).contiguous()  # type: ignore[misc]


def _concat(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
    parts = [a for a in args if a is not None]
    axis = _axis(op, parts[0].dim())
    return lambda: torch.cat(parts, axis)


def _split(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
    x = args[0]
    axis = _axis(op, x.dim())
    sizes = [s[axis] for s in shapes]
    return lambda: [p.contiguous() for p in torch.split(x, sizes, axis)]


def _gather(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
    table, indices = args[0], args[1]
    axis, shape = _axis(op, table.dim()), shapes[0]
    flat = indices.reshape(-1)
    return lambda: torch.index_select(table, axis, flat).reshape(shape)


def _gather_elements(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
    x, indices = args[0], args[1]
    axis = _axis(op, x.dim())
    return lambda: torch.gather(x, axis, indices)


def _gather_nd(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
    """Rows picked by index tuples: as many elements read as written."""
    x, shape = args[0], shapes[0]
    flat = x.reshape(-1)
    count = math.prod(shape)
    picked = torch.zeros(count, dtype=torch.int64, device=x.device)
    return lambda: flat.index_select(0, picked).reshape(shape)


def _expand(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
    x, shape = args[0], shapes[0]
    return lambda: x.expand(shape).contiguous()


def _where(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
    c, a, b = args
    return lambda: torch.where(c.bool(), a, b)


def _cast(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
    from autoshard.ir import dtypes

    x = args[0]
    target = dtypes.dtype_name(int(op.attr("to", 1)))  # type: ignore[arg-type]
    dtype = torch_dtype(target, torch, x.dtype if x.is_floating_point() else torch.float32)
    return lambda: x.to(dtype)


def _fill(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
    """ConstantOfShape, Range: a new tensor of the result's shape."""
    device, shape = args[0].device, shapes[0]
    return lambda: torch.zeros(shape, device=device)


def _trilu(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
    x = args[0]
    k = int(args[1].reshape(-1)[0]) if len(args) > 1 and args[1] is not None else 0
    function = torch.triu if op.attr("upper", 1) else torch.tril
    return lambda: function(x, k)


def _gelu(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
    x, approximate = args[0], str(op.attr("approximate", "none"))
    return lambda: torch.nn.functional.gelu(x, approximate=approximate)


def _not(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
    x = args[0]
    return lambda: torch.logical_not(x)


KERNELS: Mapping[str, Callable[..., Kernel]] = {
    "MatMul": _binary("matmul"),
    "Gemm": _gemm,
    "Add": _binary("add"),
    "Sub": _binary("sub"),
    "Mul": _binary("mul"),
    "Div": _binary("div"),
    "Max": _binary("maximum"),
    "Min": _binary("minimum"),
    "Equal": _binary("eq"),
    "Less": _binary("lt"),
    "LessOrEqual": _binary("le"),
    "Greater": _binary("gt"),
    "GreaterOrEqual": _binary("ge"),
    "And": _binary("logical_and"),
    "Or": _binary("logical_or"),
    "Not": _not,
    "Pow": _pow,
    **{
        op: _unary(name)
        for op, name in (
            ("Neg", "neg"),
            ("Abs", "abs"),
            ("Exp", "exp"),
            ("Log", "log"),
            ("Erf", "erf"),
            ("Tanh", "tanh"),
            ("Sigmoid", "sigmoid"),
            ("Relu", "relu"),
            ("Sqrt", "sqrt"),
            ("Reciprocal", "reciprocal"),
            ("Sin", "sin"),
            ("Cos", "cos"),
        )
    },  # fmt: skip
    "Gelu": _gelu,
    "Softmax": _softmax(log=False),
    "LogSoftmax": _softmax(log=True),
    "LayerNormalization": _layer_norm,
    "ReduceMean": _reduce("mean"),
    "ReduceSum": _reduce("sum"),
    "ReduceMax": _reduce("amax"),
    **dict.fromkeys(("Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"), _view),
    "Transpose": _transpose,
    "Slice": _copy_to,
    "Concat": _concat,
    "Split": _split,
    "Gather": _gather,
    "GatherElements": _gather_elements,
    "GatherND": _gather_nd,
    "Expand": _expand,
    "Where": _where,
    "Cast": _cast,
    "ConstantOfShape": _fill,
    "Range": _fill,
    "Trilu": _trilu,
}


def torch_dtype(name: str, torch: Any, floating: Any) -> Any:
    """The torch dtype of an ONNX element type; every floating type becomes `floating` (the
    dtype timed: bfloat16 on CUDA, float32 on a CPU)."""
    from autoshard.ir import dtypes

    if name == "bool":
        return torch.bool
    if dtypes.numpy_dtype(name).kind == "f":
        return floating
    return getattr(torch, name)


def kernel(op: Op, args: list[Any], shapes: Shapes, torch: Any) -> Kernel:
    """A closure running `op`'s torch kernel on `args` (the module's docstring)."""
    make = KERNELS.get(op.type) if not op.domain else None
    if make is None:
        raise KernelMissing(f"no torch kernel for {op.type} (op {op.name!r}); have: "
                            f"{', '.join(sorted(KERNELS))}")  # fmt: skip
    return make(op, args, shapes, torch)
