"""Neural-network ops: normalizations, convolution, pooling.

Conv X [N, C, H, W] * W [M, C, KH, KW] (+ B [M]) -> Y [N, M, OH, OW], group 1:

    loops [d0: parallel(N), d1: parallel(M), d2: invalid(OH), d3: invalid(OW),
           d4: reduction_sum(C), d5: invalid(KH), d6: invalid(KW)]
    maps  X (d0, d4, s*d2 + l*d5, s*d3 + l*d6)   W (d1, d4, d5, d6)   B (d1)
          -> Y (d0, d1, d2, d3)

An input spatial dim is `stride * out + dilation * kernel` (pads are a constant offset, which a
sharding ignores). Splitting a spatial loop would need halos, which we do not do yet, so the
spatial and kernel loops are invalid. With a bias, a split of C would add B on every device:
the note "bias_once" tells the partitioner to add it on one device of the group only.

With group G > 1 (depthwise: G = C) channels come in G contiguous groups. One parallel loop of
size G stands for the group index: X's channel dim (C = G·C/G), W's and Y's output channels
(M = G·M/G) and B follow it, so splitting it n ways (n | G) gives each device whole groups.
The channels inside a group are an invalid loop (they are not a contiguous block of X). The
note "local_group" tells the partitioner that the local `group` attribute is G / n. The same
holds for GroupNormalization's `num_groups`.

Pools are Convs without weights: N and C parallel, spatial invalid. Global pools reduce the
spatial dims: a reduction loop (average, max) each.
"""

from __future__ import annotations

from collections.abc import Sequence

from autoshard.ir.graph import Graph, Op
from autoshard.rules.base import (
    DimExpr,
    IndexingMap,
    Loop,
    Note,
    OpRule,
    broadcast_map,
    invalid,
    parallel,
    reduction,
)
from autoshard.rules.registry import register
from autoshard.rules.shape import axis_attr
from autoshard.sharding import ReductionKind


def _shape(graph: Graph, name: str) -> tuple[int, ...]:
    return graph.values[name].shape


def _present(op: Op, index: int) -> bool:
    return len(op.inputs) > index and bool(op.inputs[index])


def _ints(op: Op, name: str, count: int) -> tuple[int, ...] | None:
    value = op.attr(name, (1,) * count)
    if not isinstance(value, tuple) or len(value) != count:
        return None
    return tuple(int(v) for v in value)


# ---- normalizations ---------------------------------------------------------------------------


@register("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization")
def layer_norm(op: Op, graph: Graph) -> OpRule | None:
    """Axes from `axis` on are normalized (invalid); scale and bias broadcast onto them; the
    Mean and InvStdDev results ([..., 1, 1]) follow the leading loops. onnxruntime's
    SimplifiedLayerNormalization (an RMS norm, in the ONNX domain) has the InvStdDev only."""
    shape = _shape(graph, op.inputs[0])
    axis = axis_attr(op, len(shape), -1)
    if axis is None:
        return None
    loops = tuple(invalid(d) if k >= axis else Loop(d) for k, d in enumerate(shape))
    params = tuple(
        broadcast_map(_shape(graph, name), len(shape)) if name else None for name in op.inputs[1:]
    )
    stats = IndexingMap.of(*range(axis), *(None for _ in range(axis, len(shape))))
    results = (IndexingMap.of(*range(len(shape))), stats, stats)[: len(op.outputs)]
    return OpRule(loops, (IndexingMap.of(*range(len(shape))), *params), results)


@register("SkipLayerNormalization", "SkipSimplifiedLayerNormalization", domain="com.microsoft")
def skip_layer_norm(op: Op, graph: Graph) -> OpRule | None:
    """onnxruntime's residual add and norm over the last axis: input + skip (broadcast) + bias,
    normalized (invalid) and scaled. Results: the output, mean and inverse std ([..., 1]),
    and the sum before the norm."""
    shape = _shape(graph, op.inputs[0])
    if len(shape) < 2:
        return None
    loops = (*parallel(*shape[:-1]), invalid(shape[-1]))
    identity = IndexingMap.of(*range(len(shape)))
    operands = tuple(
        broadcast_map(_shape(graph, name), len(shape)) if name else None for name in op.inputs[1:]
    )
    stats = IndexingMap.of(*range(len(shape) - 1), None)
    results = (identity, stats, stats, identity)[: len(op.outputs)]
    return OpRule(loops, (identity, *operands), results)


@register("BatchNormalization")
def batch_norm(op: Op, graph: Graph) -> OpRule | None:
    """Inference only: every loop parallel, the four [C] parameters follow the channel loop.
    Training mode (batch statistics, running-stat outputs) gets None."""
    shape = _shape(graph, op.inputs[0])
    if op.attr("training_mode", 0) or any(op.outputs[1:]) or len(shape) < 2:
        return None
    channel = IndexingMap.of(1)
    identity = IndexingMap.of(*range(len(shape)))
    params = (channel,) * (len(op.inputs) - 1)
    return OpRule(parallel(*shape), (identity, *params), (identity,) * len(op.outputs))


@register("InstanceNormalization")
def instance_norm(op: Op, graph: Graph) -> OpRule | None:
    """N and C parallel; the spatial dims are normalized (invalid)."""
    shape = _shape(graph, op.inputs[0])
    if len(shape) < 3:
        return None
    loops = (*parallel(*shape[:2]), *(invalid(d) for d in shape[2:]))
    identity = IndexingMap.of(*range(len(shape)))
    return OpRule(loops, (identity, IndexingMap.of(1), IndexingMap.of(1)), (identity,))


@register("GroupNormalization")
def group_norm(op: Op, graph: Graph) -> OpRule | None:
    """N parallel, the group loop (size num_groups) parallel with note "local_group", spatial
    invalid. Scale and bias ([G] in opset 18, [C] in 21) follow the group loop."""
    shape = _shape(graph, op.inputs[0])
    groups = op.attr("num_groups")
    if len(shape) < 3 or not isinstance(groups, int) or groups < 1 or shape[1] % groups:
        return None
    loops = (Loop(shape[0]), Loop(groups), *(invalid(d) for d in shape[2:]))
    identity = IndexingMap.of(*range(len(shape)))
    return OpRule(
        loops, (identity, IndexingMap.of(1), IndexingMap.of(1)), (identity,), note=Note.LOCAL_GROUP
    )


# ---- convolution and pooling ------------------------------------------------------------------


def _window(
    spatial: int, out_loop: int, kernel_loop: int, strides: Sequence[int], dilations: Sequence[int]
) -> tuple[DimExpr, ...]:
    """Input spatial dims: `stride * out + dilation * kernel` for each spatial dim."""
    return tuple(
        ((strides[i], out_loop + i), (dilations[i], kernel_loop + i)) for i in range(spatial)
    )


@register("Conv")
def conv(op: Op, graph: Graph) -> OpRule | None:
    x, w = _shape(graph, op.inputs[0]), _shape(graph, op.inputs[1])
    y = _shape(graph, op.outputs[0])
    spatial = len(x) - 2
    group = op.attr("group", 1)
    strides, dilations = _ints(op, "strides", spatial), _ints(op, "dilations", spatial)
    if spatial < 1 or len(w) != len(x) or strides is None or dilations is None:
        return None
    if not isinstance(group, int) or group < 1 or x[1] != w[1] * group or w[0] % group:
        return None
    bias = _present(op, 2)
    out_loops = 2
    channel_loop = 2 + spatial  # C (group 1) or the channels inside a group
    kernel_loop = channel_loop + 1
    windows = _window(spatial, out_loops, kernel_loop, strides, dilations)
    kernel = IndexingMap.of(1, channel_loop, *range(kernel_loop, kernel_loop + spatial))
    if group == 1:
        channel: Loop = reduction(x[1])
        x_map = IndexingMap((((1, 0),), ((1, channel_loop),), *windows))
        note = Note.BIAS_ONCE if bias else Note.NONE
    else:  # loop 1 is the group index; X's channel dim follows it (see the module docstring)
        channel = invalid(w[1])
        x_map = IndexingMap((((1, 0),), ((1, 1),), *windows))
        note = Note.LOCAL_GROUP
    loops = (
        Loop(x[0]),
        Loop(w[0] if group == 1 else group),
        *(invalid(d) for d in y[2:]),
        channel,
        *(invalid(d) for d in w[2:]),
    )
    operands = (x_map, kernel, IndexingMap.of(1)) if bias else (x_map, kernel)
    return OpRule(loops, operands, (IndexingMap.of(*range(len(y))),), note=note)


@register("MaxPool", "AveragePool", "LpPool")
def pool(op: Op, graph: Graph) -> OpRule | None:
    """N, C parallel; output and kernel spatial loops invalid. MaxPool's Indices result (flat
    offsets into the whole input) gets None."""
    x, y = _shape(graph, op.inputs[0]), _shape(graph, op.outputs[0])
    spatial = len(x) - 2
    kernel = op.attr("kernel_shape")
    strides, dilations = _ints(op, "strides", spatial), _ints(op, "dilations", spatial)
    if spatial < 1 or any(op.outputs[1:]) or strides is None or dilations is None:
        return None
    if not isinstance(kernel, tuple) or len(kernel) != spatial:
        return None
    kernel_loop = 2 + spatial
    loops = (*parallel(*x[:2]), *(invalid(d) for d in y[2:]), *(invalid(k) for k in kernel))
    x_map = IndexingMap(
        (((1, 0),), ((1, 1),), *_window(spatial, 2, kernel_loop, strides, dilations))
    )
    y_map = IndexingMap.of(*range(len(y)))
    return OpRule(loops, (x_map,), (y_map,) * len(op.outputs))


GLOBAL_POOLS: dict[str, ReductionKind | None] = {
    "GlobalAveragePool": ReductionKind.AVERAGE,
    "GlobalMaxPool": ReductionKind.MAX,
    "GlobalLpPool": None,
}


@register(*GLOBAL_POOLS)
def global_pool(op: Op, graph: Graph) -> OpRule | None:
    """N, C parallel; each spatial dim a reduction (average, max), invalid for GlobalLpPool."""
    x = _shape(graph, op.inputs[0])
    if len(x) < 3:
        return None
    kind = GLOBAL_POOLS[op.type]
    spatial = tuple(invalid(d) if kind is None else reduction(d, kind) for d in x[2:])
    keep = IndexingMap.of(0, 1, *(None for _ in x[2:]))
    return OpRule((*parallel(*x[:2]), *spatial), (IndexingMap.of(*range(len(x))),), (keep,))
