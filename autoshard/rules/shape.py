"""Data movement: Transpose, reshapes, Concat/Split/Slice, gathers and scatters, Pad, Tile...

Reshape (and Flatten, Squeeze, Unsqueeze, which are reshapes) uses the factorization rule: a
dim that splits or merges carries a sharding to its outermost factor. Size-1 dims are dropped,
the rest are grouped, left to right, into minimal blocks of equal element count, and in each
block the outermost input dim and the outermost output dim share one loop:

    [2, 6, 768] -> [2, 6, 12, 64]
    blocks  [2]↔[2]  [6]↔[6]  [768]↔[12, 64]
    loops [d0: parallel(2), d1: parallel(6), d2: parallel(12)]
    maps  (d0, d1, d2)  ->  (d0, d1, d2, 0)

The shared loop's size is gcd(A, B) of the two outermost dims A and B (12 = gcd(768, 12)):
splitting it n ways with n | gcd(A, B) gives shard k the rows [k·A/n, (k+1)·A/n) of the input
dim and [k·B/n, (k+1)·B/n) of the output dim, which are the same flat range of the block
(k·T/n to (k+1)·T/n, T the block's element count), so every split that divides the loop is an
exact split of both dims. Any other dim of a block follows no loop and is never split. When
gcd(A, B) = 1 (`[2, 3] -> [3, 2]`) the block has no loop at all: the rule is still returned,
and that block is computed whole on every device.

Gather on axis a looks rows of `data` up by `indices`. Its loops are the result's dims
(parallel) plus the gathered axis of `data` as a sum reduction, so a vocabulary-split
embedding (Megatron) is expressible; the rule's note "masked_lookup" tells the partitioner the
local rewrite: a device holding rows [lo, hi) looks up `indices - lo` (negative ids first
normalized by + size), with ids outside [lo, hi) giving zero rows, and the results are partial
sums. When the indices are a constant that is *block-local* along one of their dims j (split
both dim j of the indices and the gathered axis into g blocks: every id of block k falls in
rows block k), dim j and the gathered axis share one parallel loop of size g instead: each
device's ids all fall in its own rows, the same rewrite finds them, and nothing is partial.
TorchScript's BERT gathers its [batch·seq, 1] mask by constant ids [batch, 1, 1, seq] so;
split on the batch, the lookup stays local instead of needing an all_reduce.

Reshapes, Transpose, Concat, Split and Slice only move elements, so they commute with a sum:
moved partial sums add up to the moved whole (a slice of partial sums is the partial sums of the
slice). Their rules let them read and write partial sums (`MOVES_PARTIALS`, `OpRule.partial`):
a row-parallel product reshaped before the residual add is reduced after the reshape, where a
split of the sequence (a reduce-scatter) can follow.

Shape, Size, Range and NonZero are registered but return None (computed replicated): Shape and
Size read only metadata and give tiny results, Range's scalar inputs give a small result whose
split would need its start rewritten, NonZero's result shape depends on data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from autoshard.ir.graph import Graph, Op
from autoshard.rules.base import IndexingMap, Loop, Note, OpRule, invalid, parallel, reduction
from autoshard.rules.registry import register
from autoshard.sharding import ReductionKind

MOVES_PARTIALS = (ReductionKind.SUM,)
"""The partial values an op that only moves elements may read and write (`OpRule.partial`):
sums. Not max or min: a gradient computes with its forward op's option, and the gradient of a
move is a move (a linear map) only of sums."""

_CONSTANT_LIMIT = 4096  # elements: parameters (targets, axes, bounds) are small


def constant(graph: Graph, name: str) -> np.ndarray | None:
    """The value of an input known at planning time: a folded constant, or a small initializer
    with data (initializers stay in `graph.weights`, not `graph.constants`)."""
    if not name:
        return None
    if name in graph.constants:
        return np.asarray(graph.constants[name])
    weight = graph.weights.get(name)
    if weight is not None and weight.has_data and weight.size <= _CONSTANT_LIMIT:
        return np.asarray(weight.load())
    return None


def constant_ints(graph: Graph, name: str) -> tuple[int, ...] | None:
    value = constant(graph, name)
    if value is None or value.dtype.kind not in "iu":
        return None
    return tuple(int(v) for v in value.reshape(-1))


def normalize_axes(axes: Sequence[int], rank: int) -> tuple[int, ...] | None:
    """Axes in [0, rank), negatives counted from the end; None if one is out of range."""
    out = tuple(a + rank if a < 0 else a for a in axes)
    return out if all(0 <= a < rank for a in out) else None


def _shape(graph: Graph, name: str) -> tuple[int, ...]:
    return graph.values[name].shape


def _identity(rank: int) -> IndexingMap:
    return IndexingMap.of(*range(rank))


def _params(op: Op, first: int) -> tuple[None, ...]:
    """None maps for the inputs from `first` on (parameters, not data)."""
    return (None,) * max(0, len(op.inputs) - first)


# ---- reshapes ---------------------------------------------------------------------------------


def factorize(
    in_shape: Sequence[int], out_shape: Sequence[int]
) -> list[tuple[int, int, int]] | None:
    """The shared loops of a reshape as (input dim, output dim, loop size), in dim order.

    None when the element counts differ or a dim is 0. See the module docstring.
    """
    if math.prod(in_shape) != math.prod(out_shape) or 0 in in_shape or 0 in out_shape:
        return None
    a = [(i, d) for i, d in enumerate(in_shape) if d != 1]
    b = [(j, d) for j, d in enumerate(out_shape) if d != 1]
    pairs: list[tuple[int, int, int]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        first_a, first_b = i, j
        count_a, count_b = a[i][1], b[j][1]
        while count_a != count_b:  # every dim >= 2 and equal totals: stays in range
            if count_a < count_b:
                i += 1
                count_a *= a[i][1]
            else:
                j += 1
                count_b *= b[j][1]
        size = math.gcd(a[first_a][1], b[first_b][1])
        if size > 1:
            pairs.append((a[first_a][0], b[first_b][0], size))
        i += 1
        j += 1
    return pairs


def reshape_rule(
    op: Op, in_shape: Sequence[int], out_shape: Sequence[int], data_inputs: int = 1
) -> OpRule | None:
    pairs = factorize(in_shape, out_shape)
    if pairs is None:
        return None
    in_dims: list[int | None] = [None] * len(in_shape)
    out_dims: list[int | None] = [None] * len(out_shape)
    for loop, (i, j, _) in enumerate(pairs):
        in_dims[i] = out_dims[j] = loop
    return OpRule(
        parallel(*(size for _, _, size in pairs)),
        (IndexingMap.of(*in_dims), *_params(op, data_inputs)),
        (IndexingMap.of(*out_dims),),
        partial=MOVES_PARTIALS,
    )


def reshape_target(target: Sequence[int], in_shape: Sequence[int], allowzero: bool) -> list[int]:
    """ONNX Reshape's output shape: 0 copies the input dim (unless allowzero), -1 is inferred."""
    copy = not allowzero
    dims = [
        in_shape[k] if d == 0 and copy and k < len(in_shape) else d for k, d in enumerate(target)
    ]
    if -1 in dims:
        known = math.prod(d for d in dims if d != -1)
        dims[dims.index(-1)] = math.prod(in_shape) // known if known else 0
    return dims


@register("Reshape")
def reshape(op: Op, graph: Graph) -> OpRule | None:
    """None unless the target is a constant (the partitioner must rewrite it) that agrees with
    the inferred result shape."""
    target = constant_ints(graph, op.inputs[1])
    in_shape, out_shape = _shape(graph, op.inputs[0]), _shape(graph, op.outputs[0])
    if target is None or target.count(-1) > 1:
        return None
    if reshape_target(target, in_shape, bool(op.attr("allowzero", 0))) != list(out_shape):
        return None
    return reshape_rule(op, in_shape, out_shape)


@register("Flatten", "Squeeze", "Unsqueeze")
def static_reshape(op: Op, graph: Graph) -> OpRule | None:
    """Reshapes fixed by attributes or axes: the factorization of the static shapes."""
    return reshape_rule(op, _shape(graph, op.inputs[0]), _shape(graph, op.outputs[0]))


@register("Transpose")
def transpose(op: Op, graph: Graph) -> OpRule | None:
    """Loops are the result's dims: result dim j reads input dim perm[j]."""
    shape = _shape(graph, op.inputs[0])
    perm = op.attr("perm", tuple(reversed(range(len(shape)))))
    if not isinstance(perm, tuple) or sorted(perm) != list(range(len(shape))):
        return None
    loop_of = {axis: j for j, axis in enumerate(perm)}
    return OpRule(
        parallel(*(shape[axis] for axis in perm)),
        (IndexingMap.of(*(loop_of[i] for i in range(len(shape)))),),
        (_identity(len(shape)),),
        partial=MOVES_PARTIALS,
    )


# ---- joins, splits, slices --------------------------------------------------------------------


def _with_invalid(shape: Sequence[int], axes: set[int]) -> tuple[Loop, ...]:
    return tuple(invalid(d) if k in axes else Loop(d) for k, d in enumerate(shape))


def axis_attr(op: Op, rank: int, default: int = 0) -> int | None:
    """The op's `axis` attribute in [0, rank); None if it is not an int or out of range."""
    axis = op.attr("axis", default)
    if not isinstance(axis, int):
        return None
    axes = normalize_axes((axis,), rank)
    return axes[0] if axes else None


@register("Concat")
def concat(op: Op, graph: Graph) -> OpRule | None:
    shape = _shape(graph, op.outputs[0])
    axis = axis_attr(op, len(shape))
    if axis is None:
        return None
    maps = tuple(_identity(len(shape)) if name else None for name in op.inputs)
    loops = _with_invalid(shape, {axis})
    return OpRule(loops, maps, (_identity(len(shape)),), partial=MOVES_PARTIALS)


@register("Split")
def split(op: Op, graph: Graph) -> OpRule | None:
    shape = _shape(graph, op.inputs[0])
    axis = axis_attr(op, len(shape))
    if axis is None:
        return None
    identity = _identity(len(shape))
    return OpRule(
        _with_invalid(shape, {axis}),
        (identity, *_params(op, 1)),
        tuple(identity for _ in op.outputs),
        partial=MOVES_PARTIALS,
    )


def _sliced_axes(op: Op, graph: Graph, shape: Sequence[int]) -> set[int] | None:
    """Axes a Slice changes: listed axes, except those whose slice is the whole dim, step 1."""
    inputs = [*op.inputs, "", ""]
    starts, ends = (constant_ints(graph, name) for name in inputs[1:3])
    count = len(starts) if starts is not None else len(ends) if ends is not None else None
    axes: Sequence[int] | None = range(count) if count is not None else None
    if inputs[3]:
        axes = constant_ints(graph, inputs[3])
    if axes is None:
        return None
    steps = constant_ints(graph, inputs[4]) if inputs[4] else (1,) * len(axes)
    axes = normalize_axes(axes, len(shape))
    if axes is None:
        return None
    touched = set(axes)
    if starts is not None and ends is not None and steps is not None:
        for axis, start, end, step in zip(axes, starts, ends, steps, strict=False):
            size = shape[axis]
            begin = min(max(start + size if start < 0 else start, 0), size)
            stop = min(max(end + size if end < 0 else end, 0), size)
            if step == 1 and begin == 0 and stop == size:
                touched.discard(axis)
    return touched


@register("Slice")
def slice_(op: Op, graph: Graph) -> OpRule | None:
    """Sliced axes invalid, others parallel; None if the sliced axes are not constants."""
    shape, out = _shape(graph, op.inputs[0]), _shape(graph, op.outputs[0])
    touched = _sliced_axes(op, graph, shape)
    if touched is None or len(out) != len(shape):
        return None
    if any(d != o for k, (d, o) in enumerate(zip(shape, out, strict=True)) if k not in touched):
        return None
    identity = _identity(len(shape))
    operands = (identity, *_params(op, 1))
    return OpRule(_with_invalid(shape, touched), operands, (identity,), partial=MOVES_PARTIALS)


# ---- gathers and scatters ---------------------------------------------------------------------


@register("Gather")
def gather(op: Op, graph: Graph) -> OpRule | None:
    """data [V, H] on axis 0 by ids [B, S] -> [B, S, H]:

    loops [d0: parallel(B), d1: parallel(S), d2: parallel(H), d3: reduction_sum(V)]
    maps  (d3, d2)  (d0, d1)  ->  (d0, d1, d2),  note "masked_lookup"
    """
    data, ids = _shape(graph, op.inputs[0]), _shape(graph, op.inputs[1])
    axis = axis_attr(op, len(data))
    if axis is None:
        return None
    out = _shape(graph, op.outputs[0])
    if out != (*data[:axis], *ids, *data[axis + 1 :]):
        return None
    rest = [d - 1 + len(ids) for d in range(axis + 1, len(data))]
    ids_map = IndexingMap.of(*range(axis, axis + len(ids)))
    values = constant(graph, op.inputs[1])
    local = _block_local(values, data[axis]) if values is not None else None
    if local is not None:
        dim, size = local
        shared = axis + dim
        loops = tuple(Loop(size) if k == shared else Loop(d) for k, d in enumerate(out))
        data_map = IndexingMap.of(*range(axis), shared, *rest)
        return OpRule(loops, (data_map, ids_map), (_identity(len(out)),), note=Note.MASKED_LOOKUP)
    return OpRule(
        (*parallel(*out), reduction(data[axis])),
        (IndexingMap.of(*range(axis), len(out), *rest), ids_map),
        (_identity(len(out)),),
        note=Note.MASKED_LOOKUP,
    )


def _block_local(
    ids: np.ndarray, rows: int, dims: Sequence[int] | None = None
) -> tuple[int, int] | None:
    """(dim j, g) for the largest g > 1 such that cutting dim j of the constant `ids` (one of
    `dims`, default all) and the `rows` gathered into g blocks, every id of block k is a row
    of block k; None if no dim has one. Any n dividing g then splits both alike (n blocks are
    unions of g blocks).

        ids [[0, 1, 2, 3], [4, 5, 6, 7]], rows 8: (0, 2), block 1 reads rows 4..7
    """
    ids = np.where(ids < 0, ids + rows, ids)
    best: tuple[int, int] | None = None
    for dim in range(ids.ndim) if dims is None else dims:
        size = ids.shape[dim]
        for g in range(math.gcd(size, rows), 1, -1):
            if size % g or rows % g or (best is not None and g <= best[1]):
                continue
            block = (np.arange(size) * g // size).reshape((-1,) + (1,) * (ids.ndim - dim - 1))
            if np.array_equal(np.broadcast_to(block, ids.shape), ids * g // rows):
                best = (dim, g)
                break
    return best


@register("GatherElements")
def gather_elements(op: Op, graph: Graph) -> OpRule | None:
    """Loops are the result's (= indices') dims; the axis is invalid, and so is any other dim
    where data and indices differ in size (positions there must line up)."""
    data, ids = _shape(graph, op.inputs[0]), _shape(graph, op.inputs[1])
    axis = axis_attr(op, len(data))
    if axis is None or len(ids) != len(data):
        return None
    bad = {k for k, (d, i) in enumerate(zip(data, ids, strict=True)) if k == axis or d != i}
    identity = _identity(len(ids))
    return OpRule(_with_invalid(ids, bad), (identity, identity), (identity,))


@register("GatherND")
def gather_nd(op: Op, graph: Graph) -> OpRule | None:
    """data [*batch, *indexed(k), *rest], indices [*batch, *rows, k] -> [*batch, *rows, *rest].

    Batch, row and rest loops are parallel; the k indexed data dims are invalid loops, except
    where constant indices are block-local (see Gather): an indexed dim whose component of the
    ids is local to blocks of a row dim shares that row's loop, and the note "masked_lookup"
    tells the partitioner to subtract the dim's local offset from that component. The dynamo
    BERT gathers its [batch, seq] mask by constant ids [batch, 1, 1, seq, 2] so.
    """
    data, ids = _shape(graph, op.inputs[0]), _shape(graph, op.inputs[1])
    batch = op.attr("batch_dims", 0)
    if not isinstance(batch, int) or not ids or data[:batch] != ids[:batch]:
        return None
    k = ids[-1]
    rows = len(ids) - 1 - batch
    rest = data[batch + k :]
    if _shape(graph, op.outputs[0]) != (*ids[:-1], *rest):
        return None
    out_rank = len(ids) - 1 + len(rest)
    sizes = [*ids[:-1], *rest]
    indexed: list[int] = []  # the loop of each indexed data dim
    values = constant(graph, op.inputs[1])
    for i, size in enumerate(data[batch : batch + k]):
        free = [d for d in range(batch, batch + rows) if d not in indexed]
        local = _block_local(values[..., i], size, free) if values is not None else None
        if local is None:
            indexed.append(len(sizes))
            sizes.append(size)
        else:  # constant ids local to blocks of a row dim: that row loop indexes this dim too
            indexed.append(local[0])
            sizes[local[0]] = local[1]
    loops = tuple(Loop(n) if j < out_rank else invalid(n) for j, n in enumerate(sizes))
    data_map = IndexingMap.of(*range(batch), *indexed, *range(batch + rows, out_rank))
    ids_map = IndexingMap.of(*range(batch + rows), None)
    note = Note.MASKED_LOOKUP if any(j < out_rank for j in indexed) else Note.NONE
    return OpRule(loops, (data_map, ids_map), (_identity(out_rank),), note=note)


@register("ScatterND")
def scatter_nd(op: Op, graph: Graph) -> OpRule | None:
    """data [*indexed(k), *rest], indices [*rows, k], updates [*rows, *rest] -> data's shape.

    The k indexed dims and the update rows are invalid; the rest is parallel.
    """
    data, ids = _shape(graph, op.inputs[0]), _shape(graph, op.inputs[1])
    updates = _shape(graph, op.inputs[2])
    if not ids:
        return None
    k, rows = ids[-1], ids[:-1]
    if updates != (*rows, *data[k:]):
        return None
    r = len(data)
    loops = (*_with_invalid(data, set(range(k))), *(invalid(d) for d in rows))
    row_loops = range(r, r + len(rows))
    return OpRule(
        loops,
        (
            _identity(r),
            IndexingMap.of(*row_loops, None),
            IndexingMap.of(*row_loops, *range(k, r)),
        ),
        (_identity(r),),
    )


@register("ScatterElements")
def scatter_elements(op: Op, graph: Graph) -> OpRule | None:
    """Loops are data's dims plus the indices' axis dim (invalid); data's axis is invalid, and
    so is any other dim where data and indices differ in size."""
    data, ids = _shape(graph, op.inputs[0]), _shape(graph, op.inputs[1])
    axis = axis_attr(op, len(data))
    if axis is None or len(ids) != len(data):
        return None
    bad = {k for k, (d, i) in enumerate(zip(data, ids, strict=True)) if k == axis or d != i}
    ids_map = IndexingMap.of(*(len(data) if k == axis else k for k in range(len(data))))
    return OpRule(
        (*_with_invalid(data, bad), invalid(ids[axis])),
        (_identity(len(data)), ids_map, ids_map),
        (_identity(len(data)),),
    )


# ---- the rest ---------------------------------------------------------------------------------


def _same_rank_rule(op: Op, bad: set[int], loop_shape: Sequence[int]) -> OpRule:
    """Input 0 and result 0 follow the loops dim for dim; later inputs are parameters."""
    identity = _identity(len(loop_shape))
    return OpRule(_with_invalid(loop_shape, bad), (identity, *_params(op, 1)), (identity,))


@register("Trilu")
def trilu(op: Op, graph: Graph) -> OpRule | None:
    shape = _shape(graph, op.inputs[0])
    return _same_rank_rule(op, {len(shape) - 2, len(shape) - 1}, shape)


@register("Tile")
def tile(op: Op, graph: Graph) -> OpRule | None:
    """Tiled axes (those whose size changes) are invalid."""
    shape, out = _shape(graph, op.inputs[0]), _shape(graph, op.outputs[0])
    if len(shape) != len(out):
        return None
    tiled = {k for k, (d, o) in enumerate(zip(shape, out, strict=True)) if d != o}
    return _same_rank_rule(op, tiled, out)


@register("Pad")
def pad(op: Op, graph: Graph) -> OpRule | None:
    """Padded axes invalid; None unless pads (and axes, opset 18) are constants."""
    shape, out = _shape(graph, op.inputs[0]), _shape(graph, op.outputs[0])
    pads = constant_ints(graph, op.inputs[1]) if len(op.inputs) > 1 and op.inputs[1] else None
    if pads is None or len(pads) % 2:
        return None
    axes: Sequence[int] | None = range(len(shape))
    if len(op.inputs) > 3 and op.inputs[3]:
        axes = constant_ints(graph, op.inputs[3])
    axes = normalize_axes(axes, len(shape)) if axes is not None else None
    if axes is None or len(axes) * 2 != len(pads):
        return None
    count = len(axes)
    padded = {a for k, a in enumerate(axes) if pads[k] or pads[k + count]}
    return _same_rank_rule(op, padded, out)


@register("Resize")
def resize(op: Op, graph: Graph) -> OpRule | None:
    """N and C parallel (when unscaled); spatial dims and any scaled dim invalid. A `sizes`
    input is the result shape: the partitioner rewrites it to the local shape."""
    shape, out = _shape(graph, op.inputs[0]), _shape(graph, op.outputs[0])
    if op.attr("coordinate_transformation_mode") == "tf_crop_and_resize" or len(shape) != len(out):
        return None
    bad = {k for k, (d, o) in enumerate(zip(shape, out, strict=True)) if k >= 2 or d != o}
    return _same_rank_rule(op, bad, out)


@register("CumSum")
def cumsum(op: Op, graph: Graph) -> OpRule | None:
    shape = _shape(graph, op.inputs[0])
    axis = constant_ints(graph, op.inputs[1])
    axes = normalize_axes(axis, len(shape)) if axis is not None and len(axis) == 1 else None
    return None if axes is None else _same_rank_rule(op, set(axes), shape)


@register("OneHot")
def one_hot(op: Op, graph: Graph) -> OpRule | None:
    """The depth axis is invalid (a split would need offset indices); index dims parallel."""
    out = _shape(graph, op.outputs[0])
    axis = axis_attr(op, len(out), default=-1)
    if axis is None:
        return None
    ids = [k for k in range(len(out)) if k != axis]
    return OpRule(
        _with_invalid(out, {axis}),
        (IndexingMap.of(*ids), *_params(op, 1)),
        (_identity(len(out)),),
    )


@register("ConstantOfShape")
def constant_of_shape(op: Op, graph: Graph) -> OpRule | None:
    """No data operand: every result loop parallel; the partitioner rewrites the shape input
    to the local shape, as for Expand."""
    out = _shape(graph, op.outputs[0])
    return OpRule(parallel(*out), _params(op, 0), (_identity(len(out)),))


@register("Shape", "Size", "Range", "NonZero")
def replicated(op: Op, graph: Graph) -> OpRule | None:
    """Computed replicated on purpose; see the module docstring."""
    return None
