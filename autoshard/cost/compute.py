"""Compute: what one device spends on one op, a roofline per op (`op_cost`).

An op with loops of sizes s_i split over g_i devices runs Π ceil(s_i / g_i) iterations per
device (its local shard), so

    FLOPs   = iterations · flops per iteration (2, a multiply and an add, when it has a
              reduction loop, else 1; 0 for an op that only moves data: `OP_KINDS`)
    bytes   = reads · Σ operand shards + writes · Σ result shards (each tensor's local shard
              through the rule's maps, at its dtype; parameter operands are not data). A lookup
              (Gather) reads of its table only the rows its result holds: at most the result's
              elements at the table's dtype. `reads`, `writes` count passes (`OP_KINDS`).
              A lookup's gradient with respect to its table is a scatter-add: it writes
              the table's gradient shard once (zeroed) and adds each looked-up row's
              gradient into it, one addition per element of the gradient it reads
              (`scatter_add`): FLOPs those elements, bytes the shard written plus the
              gradient read and the rows it touches read and written, three passes over
              the gradient's shard at its dtype; not the masked product over every row of
              the table that the lookup's rule (a reduction over the rows) spells.
    special = iterations, for an op evaluating a transcendental function per element (exp,
              erf, tanh, a general power, ...: `Transcendental`), else 0
    time    = max(FLOPs / (peak · efficiency), bytes / (bandwidth · memory efficiency ·
              access), special / rate(family)) + launch
    bandwidth = the cache's if the device models one and bytes <= its size, else HBM's
    access  = 1 for a contraction, a lookup or an op reading every operand in the order it
              writes; `strided_efficiency` for one reading an operand broadcast (a bias, a
              mask, a norm's divisor: not a fused row kernel's parameters, not a one-element
              constant, which kernels take as a number) or permuted, or cutting an inner
              axis (Split, Slice, Concat, Pad); `transpose_efficiency` for one reading an
              operand whose innermost axis is not the result's (`access`)

the largest of the times its arithmetic, its memory traffic and its special functions need
at the rates real kernels reach, plus the shortest time any kernel takes. Memory traffic
streams at the full rate only in order: an elementwise kernel with a broadcast or permuted
operand loses its vectorized loads, a transpose of the innermost axis its coalesced ones; a
GPU's L2, like a CPU's last-level cache, holds what the last kernel wrote for the next.
A special function costs many instructions per element (a polynomial after a range
reduction), so where the vector units are slow next to memory (CPUs) it, not memory, bounds
the op; `rate(family)` is the device's measured rate (`DeviceKind.transcendental`, what
`autoshard calibrate` writes) or else its vector rate over `TRANSCENDENTAL_FLOPS[family]`, the
instructions an evaluation takes. A Pow whose exponent is a constant 2 or 3 is
multiplications (`int_pow`: kernels special-case it), 1 a copy and 0.5 a square root. Pure
views (Reshape, Squeeze, ...) launch no kernel and cost nothing.

A *contraction* (a reduction loop and two data operands: MatMul, Gemm, Einsum, Conv, and
gradient ops derived from them) runs on the matrix units at `peak(dtype)`, dtype its
result's or the one the graph names for it (`Graph.matmul_dtypes`: FP8 for a linear layer's
matmuls under fp8-mixed precision, its operands held in bf16); everything else at
the vector rate `default_flops`. A contraction's efficiency falls for small and thin shapes
and for misaligned ones: with M, N, K the local sizes of its loops indexing the first data
operand only, the second only, and its reductions,

    efficiency = matmul_efficiency · s(M) · s(N) · s(K) · (misaligned_efficiency
                 if M, N or K is not a multiple of 16 bytes' worth of elements)
                 · (matmul_cache_speedup if M·K + K·N + M·N elements fit in
                 matmul_cache_bytes), s(d) = d / (d + h)

where h (`matmul_half_dim`) is the dim at which a kernel runs at half speed: an output tile
fed a dim of half its width idles half its lanes, while dims of thousands give s ≈ 1. Tensor
cores need 16-byte aligned leading dims, and cuBLAS falls back to slower kernels otherwise. A
CPU's matmul whose operands and result stay in the cores' private caches runs several times
faster than one streaming them from the shared cache (`autoshard calibrate` measures both;
GPUs model no such level). A CPU's BLAS also re-lays out (packs) B of A @ B on every call when
B is no constant, a pass over its bytes at `pack_bandwidth` added to the contraction's time
(GPUs read operands in place). An op without a rule runs whole on every device: its outputs'
elements as FLOPs, all its inputs and outputs as bytes.

The measurements behind these rules: docs/concepts/cost-model-measurements.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from autoshard.cost.attention import attention_kernel, attention_op_cost, fused_cost
from autoshard.cost.cluster import Cluster
from autoshard.cost.devices import DeviceKind, Transcendental
from autoshard.cost.kernel import OpCost, local_loops
from autoshard.ir import dtypes
from autoshard.ir.graph import Graph, Op
from autoshard.mesh import Mesh
from autoshard.rules import IndexingMap, IteratorType, OpRule
from autoshard.rules.gradient import TRAIN, TrainOp
from autoshard.sharding import ShardingOption, shard_size
from autoshard.training.options import Precision, TrainingError

TRANSCENDENTAL_FLOPS: Mapping[Transcendental, int] = {
    # Vector instructions per evaluation in float32, where a device has no measured rate: a
    # range reduction and a polynomial (exp, log), a rational approximation (erf, tanh), an
    # extra-precise log, a multiply and an exp (a general pow), a hardware estimate and a
    # Newton step (sqrt), a range reduction and two polynomials (sin, cos); x**2 and x**3 are
    # one or two multiplications.
    Transcendental.EXP: 8,
    Transcendental.LOG: 10,
    Transcendental.ERF: 12,
    Transcendental.TANH: 12,
    Transcendental.POW: 40,
    Transcendental.INT_POW: 2,
    Transcendental.SQRT: 4,
    Transcendental.TRIG: 20,
}


@dataclass(frozen=True)
class OpKind:
    """How an op type computes, beyond its loops: FLOPs per iteration (None: 2 with a reduction
    loop, else 1), passes over its operands and results, whether operand 0 is a table it looks
    rows up in, whether it is a view (no kernel at all), the special function it evaluates
    once per iteration, if any, and whether it is a fused row kernel (a softmax, a norm) that
    reads its broadcast parameters once per row, not per element (`access`)."""

    flops: int | None = None
    reads: float = 1.0
    writes: float = 1.0
    lookup: bool = False
    view: bool = False
    special: Transcendental | None = None
    fused: bool = False


VIEWS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity",
                   "Shape", "Size"})  # fmt: skip
"""No kernel: a view of the same buffer, or metadata read on the host."""


MOVES = frozenset({"Transpose", "Concat", "Split", "Slice", "Pad", "Tile", "Expand", "Trilu",
                   "Resize", "ConstantOfShape", "Range", "OneHot", "ScatterND",
                   "ScatterElements"})  # fmt: skip
"""Kernels that move (or fill) data and compute nothing."""


OP_KINDS: Mapping[str, OpKind] = {
    **dict.fromkeys(VIEWS, OpKind(view=True)),
    **dict.fromkeys(MOVES, OpKind(flops=0)),
    **dict.fromkeys(("Gather", "GatherElements", "GatherND"), OpKind(flops=0, lookup=True)),
    # Softmax: max, subtract, exp, sum, divide per element; a pass for the row statistics and
    # one normalizing (eager kernels keep short rows in registers, long rows are read again).
    # Its exp is inside the fused row kernel, counted among the 5 (a CPU's vector rate is
    # measured on a softmax; a GPU's softmax is memory-bound).
    **dict.fromkeys(("Softmax", "LogSoftmax"), OpKind(flops=5, reads=2, fused=True)),
    # One special function per element (Sigmoid, Softplus and the ELUs are an exp and a few
    # flops; Gelu an erf, or a tanh when approximate: `special`).
    **dict.fromkeys(
        ("Exp", "Sigmoid", "Softplus", "Elu", "Selu", "Celu"), OpKind(special=Transcendental.EXP)
    ),  # fmt: skip
    "Log": OpKind(special=Transcendental.LOG),
    **dict.fromkeys(("Erf", "Gelu"), OpKind(special=Transcendental.ERF)),
    "Tanh": OpKind(special=Transcendental.TANH),
    "Pow": OpKind(special=Transcendental.POW),
    "Sqrt": OpKind(special=Transcendental.SQRT),
    **dict.fromkeys(
        ("Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh"),
        OpKind(special=Transcendental.TRIG),
    ),  # fmt: skip
    # Layer and RMS norms: one pass for the mean / mean square, one to normalize and scale.
    "LayerNormalization": OpKind(flops=8, reads=2, fused=True),
    "RMSNormalization": OpKind(flops=4, reads=2, fused=True),
    "GroupNormalization": OpKind(flops=8, reads=2, fused=True),
    "InstanceNormalization": OpKind(flops=8, reads=2, fused=True),
    # inference: a scale and a shift per element
    "BatchNormalization": OpKind(flops=2, fused=True),
    # onnxruntime's norms: a residual add (and bias) before a layer or RMS norm.
    "SimplifiedLayerNormalization": OpKind(flops=4, reads=2, fused=True),
    "SkipLayerNormalization": OpKind(flops=10, reads=2, fused=True),
    "SkipSimplifiedLayerNormalization": OpKind(flops=6, reads=2, fused=True),
    "FastGelu": OpKind(special=Transcendental.TANH),
    "BiasGelu": OpKind(special=Transcendental.ERF),
    "QuickGelu": OpKind(special=Transcendental.EXP),
    # Fused attention: an iteration per (batch, query head, query, key, head-size element)
    # (rules/attention.py), a multiply-add of Q·K and one of P·V.
    **dict.fromkeys(("Attention", "GroupQueryAttention", "MultiHeadAttention"), OpKind(flops=4)),
    # Rotary embedding: x·cos + rotate(x)·sin per element.
    "RotaryEmbedding": OpKind(flops=3),
}
"""Op types whose cost differs from the default `OpKind()`: one pass over the data at the
FLOPs the loops imply. Any other type, a derived gradient op included, is priced by the
default from its own rule."""


_DEFAULT = OpKind()


def op_kind(op: Op) -> OpKind:
    return OP_KINDS.get(op.type, _DEFAULT)


CHEAP_POWERS: Mapping[float, Transcendental | None] = {
    1.0: None, 2.0: Transcendental.INT_POW, 3.0: Transcendental.INT_POW,
    0.5: Transcendental.SQRT,
}  # fmt: skip
"""Constant exponents kernels special-case (onnxruntime's Pow: 2 and 3; torch's: 0.5, 1, 2,
3): a copy, multiplications, or a square root."""


def special(op: Op, graph: Graph) -> Transcendental | None:
    """The special function `op` evaluates per element: its kind's, but a tanh for an
    approximate Gelu and none (or a square root) for a Pow by a constant it special-cases."""
    found = op_kind(op).special
    if op.type == "Gelu" and op.attr("approximate", "none") == "tanh":
        return Transcendental.TANH
    if op.type == "Pow" and len(op.inputs) > 1:
        exponent = _scalar(graph, op.inputs[1])
        if exponent is not None and exponent in CHEAP_POWERS:
            return CHEAP_POWERS[exponent]
    return found


def _scalar(graph: Graph, name: str) -> float | None:
    """The value of a one-element constant, or weight whose data the file holds."""
    if name in graph.constants:
        array = graph.constants[name]
    elif (weight := graph.weights.get(name)) is not None and weight.has_data:
        if math.prod(weight.shape) != 1:
            return None
        array = weight.load()
    else:
        return None
    return float(array.reshape(-1)[0]) if array.size == 1 else None


def op_flops(
    op: Op, rule: OpRule | None, option: ShardingOption | None, graph: Graph, mesh: Mesh
) -> int:
    """FLOPs one device runs for `op` computed with `option` (None: whole on every device)."""
    kind = op_kind(op)
    if kind.view:
        return 0
    per_device = _iterations(op, rule, option, graph, mesh)
    if rule is None or option is None:
        return per_device
    if (scattered := _scattered(op, rule, option, graph, mesh)) is not None:
        return scattered[1]
    if kind.flops is not None:
        return per_device * kind.flops
    multiply_add = any(loop.kind is IteratorType.REDUCTION for loop in rule.loops)
    return per_device * (2 if multiply_add else 1)


def scatter_add(op: Op, graph: Graph) -> bool:
    """Whether `op` is a lookup's gradient with respect to its table (the module's
    docstring): the gradient of operand 0 of a Gather, GatherElements or GatherND."""
    if op.domain != TRAIN or op.type != TrainOp.GRAD or op.attr("operand", 0) != 0:
        return False
    forward = graph.op_by_name.get(str(op.attr("op")))
    return forward is not None and op_kind(forward).lookup


def _scattered(
    op: Op, rule: OpRule, option: ShardingOption, graph: Graph, mesh: Mesh
) -> tuple[str, int] | None:
    """The dtype and local elements of the gradient a scatter-add (`scatter_add`) reads;
    None for any other op."""
    indexing = rule.operands[-1] if rule.operands else None
    if indexing is None or not scatter_add(op, graph):
        return None
    gradient = graph.values[op.inputs[-1]]
    return gradient.dtype, _elements(gradient.shape, indexing, option, mesh)


def op_bytes(
    op: Op, rule: OpRule | None, option: ShardingOption | None, graph: Graph, mesh: Mesh
) -> int:
    """Bytes one device reads and writes for `op` computed with `option`: the local shard of
    every data operand and result through the rule's maps, times the op kind's passes."""
    kind = op_kind(op)
    if kind.view:
        return 0
    if rule is None or option is None:
        whole = [graph.values[n] for n in (*op.inputs, *op.outputs) if n and n not in graph.on_chip]
        return sum(dtypes.nbytes(v.dtype, math.prod(v.shape)) for v in whole)
    results = [
        (graph.values[name], _elements(graph.values[name].shape, rule.results[i], option, mesh))
        for i, name in enumerate(op.outputs)
        if name and name not in graph.on_chip
    ]
    written = sum(dtypes.nbytes(value.dtype, count) for value, count in results)
    if (scattered := _scattered(op, rule, option, graph, mesh)) is not None:
        return written + 3 * dtypes.nbytes(*scattered)
    read = 0
    for i, (name, indexing) in enumerate(zip(op.inputs, rule.operands, strict=False)):
        if not name or indexing is None or name in graph.on_chip:
            continue
        value = graph.values[name]
        count = _elements(value.shape, indexing, option, mesh)
        if kind.lookup and i == 0 and results:
            count = min(count, results[0][1])  # the rows it reads, not the table
        read += dtypes.nbytes(value.dtype, count)
    return round(kind.reads * read + kind.writes * written)


def _elements(
    shape: Sequence[int], indexing: IndexingMap, option: ShardingOption, mesh: Mesh
) -> int:
    """Elements of the local shard of a tensor of `shape` read through `indexing`."""
    count = 1
    for dim, size in enumerate(shape):
        axes = [a for loop in indexing.loops(dim) for a in option.loops[loop]]
        count *= shard_size(size, mesh.group_size(axes))
    return count


def matmul_efficiency(
    rule: OpRule,
    option: ShardingOption,
    mesh: Mesh,
    dtype: str,
    device: DeviceKind,
    inputs: Sequence[str] = (),
) -> float | None:
    """The fraction of the matrix units' peak a contraction reaches at its local shape (the
    module's docstring); None if the op is no contraction: no reduction loop, fewer than two
    data operands (of those present, when the op's `inputs` are given: a gradient op leaves
    out what it does not read), or an M or N of one (a reduction, a matrix-vector product:
    vector work)."""
    present = [bool(name) for name in inputs] or [True] * len(rule.operands)
    data = [m for m, here in zip(rule.operands, present, strict=False) if m is not None and here]
    reductions = [i for i, loop in enumerate(rule.loops) if loop.kind is IteratorType.REDUCTION]
    if len(data) < 2 or not reductions:
        return None
    local = local_loops(rule, option, mesh)
    first = {loop for dim in range(len(data[0].dims)) for loop in data[0].loops(dim)}
    second = {loop for dim in range(len(data[1].dims)) for loop in data[1].loops(dim)}
    parallel = set(range(len(local))) - set(reductions)
    if not parallel & first - second or not parallel & second - first:
        return None
    m = math.prod(local[i] for i in parallel & first - second)
    n = math.prod(local[i] for i in parallel & second - first)
    k = math.prod(local[i] for i in reductions)
    half = device.matmul_half_dim
    efficiency = device.matmul_efficiency
    for size in (m, n, k):
        efficiency *= size / (size + half)
    align = max(1, 128 // max(1, dtypes.bits(dtype)))
    if any(size % align for size in (m, n, k)):
        efficiency *= device.misaligned_efficiency
    if dtypes.nbytes(dtype, m * k + k * n + m * n) <= device.matmul_cache_bytes:
        efficiency *= device.matmul_cache_speedup
    return efficiency


def check_precision(precision: Precision, device: DeviceKind) -> None:
    """That `device` has the matrix units `precision` computes on: a device without an FP8
    rate (an A100) cannot run fp8-mixed's matmuls in FP8."""
    wanted = precision.matmul_dtype
    if wanted is not None and wanted not in device.flops:
        runs = [str(p) for p in Precision if p.matmul_dtype in (None, *device.flops)]
        raise TrainingError(
            f"precision {precision} needs FP8 tensor cores, which device {device.name!r} "
            f"lacks; its precisions: {', '.join(runs)}"
        )


def op_cost(
    op: Op, rule: OpRule | None, option: ShardingOption | None, graph: Graph, cluster: Cluster
) -> OpCost:
    """The roofline of `op` computed with `option` on one device (the module's docstring); an
    op of a fused region, its share of the region's kernel (`fused_cost`); an attention op and
    its gradients, its forward and backward flash kernels (`attention_op_cost`)."""
    if op.name in graph.fused.masks:  # a causal kernel masks its tiles itself
        return OpCost(0, 0, 0.0)
    kernel = graph.fused.kernel(op.name)
    if kernel is not None:
        return fused_cost(op, kernel, rule, option, graph, cluster)
    attention = attention_kernel(op, graph) if cluster.device.flash_attention and rule else None
    if attention is not None and rule is not None:
        return attention_op_cost(*attention, rule, option, graph, cluster)
    if op_kind(op).view:
        return OpCost(0, 0, 0.0)
    device, mesh = cluster.device, cluster.mesh
    flops = op_flops(op, rule, option, graph, mesh)
    moved = op_bytes(op, rule, option, graph, mesh)
    dtype = graph.values[op.outputs[0]].dtype if op.outputs and op.outputs[0] else "float32"
    dtype = graph.matmul_dtypes.get(op.name, dtype)
    efficiency, scatter = None, scatter_add(op, graph)
    if rule is not None and option is not None and flops and not scatter:
        efficiency = matmul_efficiency(rule, option, mesh, dtype, device, op.inputs)
    rate = device.default_flops if efficiency is None else device.peak(dtype) * efficiency
    cached = 0 < moved <= device.cache_bytes and device.cache_bandwidth > 0
    bandwidth = device.cache_bandwidth if cached else device.hbm_bandwidth
    bandwidth *= device.memory_efficiency
    if efficiency is None and rule is not None and not (op_kind(op).lookup or scatter):
        bandwidth *= access_efficiency(device, access(op, rule, graph))
    seconds = max(flops / rate, moved / bandwidth)
    if efficiency is not None and device.pack_bandwidth > 0 and rule is not None:
        seconds += _second_operand_bytes(op, rule, option, graph, mesh) / device.pack_bandwidth
    family = special(op, graph)
    if family is not None:
        seconds = max(seconds, _iterations(op, rule, option, graph, mesh) / special_rate(
            device, family))  # fmt: skip
    # A result kept on chip: the op runs inside the kernel of the op reading it, no launch.
    launch = 0.0 if op.outputs and all(n in graph.on_chip for n in op.outputs) else device.launch_s
    return OpCost(flops, moved, seconds + launch)


class Access(StrEnum):
    """How a memory-bound kernel reads its operands against the order it writes (`access`)."""

    STREAM = "stream"
    STRIDED = "strided"
    TRANSPOSED = "transposed"


def access(op: Op, rule: OpRule, graph: Graph) -> Access:
    """STREAM when every data operand is read in the order the first result is written;
    TRANSPOSED when one is read permuted with another innermost loop; STRIDED when one is
    read permuted otherwise, or broadcast (a loop of the result it lacks; not in a fused row
    kernel, which reads its parameters once per row), or when the result is a region of an
    axis inside a larger one (`REGIONS` along an inner axis: rows of a stride).
    Loops of one iteration do not count, nor a one-element constant (kernels take it as a
    number). The loops are the rule's, whole: a shard keeps their order."""
    sizes = [loop.size for loop in rule.loops]

    def order(indexing: IndexingMap) -> list[int]:
        return [
            loop for dim in range(len(indexing.dims)) for loop in indexing.loops(dim)
            if sizes[loop] > 1
        ]  # fmt: skip

    written = order(rule.results[0]) if rule.results else []
    found = Access.STRIDED if _inner_region(op, graph) else Access.STREAM
    for name, indexing in zip(op.inputs, rule.operands, strict=False):
        if not name or indexing is None or _scalar(graph, name) is not None:
            continue
        read = order(indexing)
        common_read = [loop for loop in read if loop in written]
        common_written = [loop for loop in written if loop in read]
        if common_read != common_written:
            if common_read[-1] != common_written[-1]:
                return Access.TRANSPOSED
            found = Access.STRIDED
        elif not op_kind(op).fused and set(written) - set(read):
            found = Access.STRIDED
    return found


REGIONS = frozenset({"Split", "Slice", "Concat", "Pad"})
"""Ops whose result is a region of their operand along some axes (or the reverse)."""


def _inner_region(op: Op, graph: Graph) -> bool:
    """Whether `op` cuts or joins along an axis inside another of more than one element."""
    if op.type not in REGIONS or not op.inputs[0] or not op.outputs or not op.outputs[0]:
        return False
    shape, result = graph.values[op.inputs[0]].shape, graph.values[op.outputs[0]].shape
    changed = [k for k, (a, b) in enumerate(zip(shape, result, strict=False)) if a != b]
    return bool(changed) and any(size > 1 for size in shape[: changed[0]])


def access_efficiency(device: DeviceKind, pattern: Access) -> float:
    """The fraction of the streaming rate a memory-bound kernel keeps reading by `pattern`."""
    if pattern is Access.TRANSPOSED:
        return device.transpose_efficiency
    return device.strided_efficiency if pattern is Access.STRIDED else 1.0


def _second_operand_bytes(
    op: Op, rule: OpRule, option: ShardingOption | None, graph: Graph, mesh: Mesh
) -> int:
    """Bytes of the local shard of a contraction's second data operand (B of A @ B)."""
    data = [(name, m) for name, m in zip(op.inputs, rule.operands, strict=False) if name and m]
    if len(data) < 2 or option is None:
        return 0
    name, indexing = data[1]
    value = graph.values[name]
    return dtypes.nbytes(value.dtype, _elements(value.shape, indexing, option, mesh))


def special_rate(device: DeviceKind, family: Transcendental) -> float:
    """Evaluations per second of a special function: the device's measured rate, else its
    vector rate over the instructions one takes (`TRANSCENDENTAL_FLOPS`)."""
    measured = device.transcendental.get(str(family))
    return measured if measured else device.default_flops / TRANSCENDENTAL_FLOPS[family]


def _iterations(
    op: Op, rule: OpRule | None, option: ShardingOption | None, graph: Graph, mesh: Mesh
) -> int:
    """The iterations of `op` one device runs: its local loops, or (no rule) its outputs."""
    if rule is None or option is None:
        return sum(math.prod(graph.values[o].shape) for o in op.outputs if o)
    return math.prod(local_loops(rule, option, mesh))


def compute_time(
    op: Op, rule: OpRule | None, option: ShardingOption | None, graph: Graph, cluster: Cluster
) -> float:
    """Seconds one device computes `op` with `option`: its roofline (`op_cost`)."""
    return op_cost(op, rule, option, graph, cluster).seconds
