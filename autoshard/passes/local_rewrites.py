"""Partition's per-op local rewrites (passes/partition.py), as tables of (pattern, handler).

Most ops compute on their shards exactly what they compute on whole tensors. Some do not, and
partition rewrites them; two tables say which and how:

- `SHAPE_REWRITES`, keyed by op type: operands and attributes that carry shapes are rewritten to
  the local ones, as explicit constants (no 0 / -1 of Reshape). Reshape targets, Expand and
  ConstantOfShape shapes, Resize sizes become the local result shape; Slice bounds on split dims
  become the local range; a Squeeze without axes gets the global size-1 dims written out. The
  handler returns the program's op, reading per-device constants.
- `NOTE_REWRITES`, keyed by the rule's note and the op type: the rule notes that need a local
  rewrite get one. A vocabulary-split Gather ("masked_lookup") looks up `ids - lo` among its
  rows [lo, hi) and zeroes the rows it does not hold, giving the partial sums its result
  sharding says (with block-local constant ids every id is its own device's: no mask, nothing
  partial); a GatherND whose indexed dims are split subtracts each dim's start from its id
  component; a bias of a Gemm or Conv whose reduction is split ("bias_once") is added by the
  first device of each reduction group only; Conv / GroupNormalization group counts
  ("local_group") count the groups a device holds, and so do the head counts of attention and
  rotary ops in the 3-D layout ("local_heads"). The handler returns each device's local ops.

A handler is a function of the partition in progress (`Partitioning`: local shapes, fresh
names, per-device constants) and the op. It adds the constants and temporaries its rewrite
needs there and raises the partition's error for a split no local op computes exactly.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

import numpy as np

from autoshard.errors import AutoshardError
from autoshard.ir import dtypes
from autoshard.ir.graph import Attrs, AttrValue, Graph, Op
from autoshard.mesh import Mesh
from autoshard.program import Tensor
from autoshard.rules import Note
from autoshard.rules.shape import normalize_axes
from autoshard.sharding import Sharding, Slice

Shape = tuple[int, ...]


class Partitioning(Protocol):
    """What a rewrite may ask of the partition in progress (passes/partition.py)."""

    @property
    def graph(self) -> Graph: ...

    @property
    def mesh(self) -> Mesh: ...

    @property
    def count(self) -> int: ...

    @property
    def tensors(self) -> Mapping[str, Tensor]: ...

    @property
    def dtypes(self) -> Mapping[str, str]: ...

    def local(self, name: str) -> tuple[Shape, ...]:
        """Each device's local shape of a program tensor, in linear device order."""
        ...

    def regions(self, name: str) -> tuple[tuple[Slice, ...], ...]:
        """Each device's region of a program tensor, in linear device order."""
        ...

    def sharding(self, name: str) -> Sharding: ...

    def fresh(self, base: str) -> str:
        """A name no tensor has yet."""
        ...

    def temporary(self, name: str, dtype: str, shapes: Sequence[Shape]) -> None:
        """A tensor only device programs have (a local rewrite's intermediate)."""
        ...

    def device_constant(
        self,
        base: str,
        dtype: str,
        values: Sequence[np.ndarray],
        global_value: np.ndarray | None = None,
    ) -> str:
        """A constant every device holds its own value of; with a `global_value`, the program
        gets it too."""
        ...

    def shared_constant(self, base: str, value: np.ndarray, dtype: str, in_program: bool) -> str:
        """A constant with one value on every device."""
        ...

    def replace_operand(
        self, op: Op, index: int, values: Sequence[np.ndarray], global_value: np.ndarray
    ) -> Op:
        """`op` reading a per-device constant at operand `index`."""
        ...

    def constant_value(self, name: str) -> np.ndarray | None:
        """The value of a parameter operand known at compile time."""
        ...

    def fail(self, op: Op, why: str) -> AutoshardError:
        """The error refusing `op`, naming it."""
        ...


ShapeRewrite = Callable[[Partitioning, Op], Op]
"""The program's op with its shape-carrying operands rewritten (per-device constants)."""

LocalRewrite = Callable[[Partitioning, Op], list[list[Op]]]
"""Each device's local ops of the program's op, in linear device order."""


# ---- shape-carrying operands ------------------------------------------------------------------

_SHAPE_OPERAND = {"Reshape": 1, "Expand": 1, "ConstantOfShape": 0, "Resize": 3}
"""Op type -> the operand that is the result's shape: rewritten to the local result shape."""


def local_result_shape(p: Partitioning, op: Op) -> Op:
    """The operand that is the result's shape becomes each device's local shape of result 0."""
    index = _SHAPE_OPERAND[op.type]
    if index >= len(op.inputs) or not op.inputs[index]:
        return op
    result = op.outputs[0]
    shapes = p.local(result)
    global_shape = p.tensors[result].shape
    if all(s == global_shape for s in shapes):
        return op
    values = [np.array(s, np.int64) for s in shapes]
    op = p.replace_operand(op, index, values, np.array(global_shape, np.int64))
    if op.type == "Reshape" and any(0 in s for s in shapes):
        # An explicit 0 (an empty shard) means "copy the input dim" unless allowzero.
        if p.graph.opset and p.graph.opset < 14:
            raise p.fail(op, "an empty shard needs Reshape's allowzero (opset >= 14)")
        op = dataclasses.replace(op, attrs=Attrs({**op.attrs, "allowzero": 1}))
    return op


def local_slice_bounds(p: Partitioning, op: Op) -> Op:
    """Slice bounds on split dims become [0, local size): the rule only lets a Slice keep
    whole (step 1, full range) the dims it splits."""
    data = op.inputs[0]
    split_dims = p.sharding(data).sharded_dims
    if not split_dims:
        return op
    inputs = [*op.inputs, "", "", ""]
    starts, ends = p.constant_value(inputs[1]), p.constant_value(inputs[2])
    rank = len(p.tensors[data].shape)
    if starts is None or ends is None:
        raise p.fail(op, "its bounds are not constants but a split dim needs them local")
    raw_axes = p.constant_value(inputs[3]) if inputs[3] else np.arange(len(starts))
    axes = normalize_axes([int(a) for a in np.asarray(raw_axes).reshape(-1)], rank)
    if axes is None:
        raise p.fail(op, f"axes {np.asarray(raw_axes).tolist()} are out of range")
    listed = [k for k, a in enumerate(axes) if a in split_dims]
    if not listed:
        return op
    steps = p.constant_value(inputs[4]) if inputs[4] else np.ones(len(axes), np.int64)
    global_shape = p.tensors[data].shape
    for k in listed:
        size = global_shape[axes[k]]
        start, end, stride = int(starts[k]), int(ends[k]), int(steps[k])  # type: ignore[index]
        begin = min(max(start + size if start < 0 else start, 0), size)
        stop = min(max(end + size if end < 0 else end, 0), size)
        if (begin, stop, stride) != (0, size, 1):
            raise p.fail(op, f"it slices dim {axes[k]}, which is split")
    locals_ = p.local(data)
    new_starts, new_ends = [], []
    for shape in locals_:
        s = np.array(starts, np.int64).reshape(-1).copy()
        e = np.array(ends, np.int64).reshape(-1).copy()
        for k in listed:
            s[k], e[k] = 0, shape[axes[k]]
        new_starts.append(s)
        new_ends.append(e)
    g_starts = np.array(starts, np.int64).reshape(-1)
    g_ends = np.array(ends, np.int64).reshape(-1).copy()
    for k in listed:
        g_ends[k] = global_shape[axes[k]]
    op = p.replace_operand(op, 1, new_starts, g_starts)
    return p.replace_operand(op, 2, new_ends, g_ends)


def explicit_squeeze_axes(p: Partitioning, op: Op) -> Op:
    """A Squeeze without axes squeezes every size-1 dim: a split can make a local dim 1,
    so the global size-1 dims are written out."""
    if len(op.inputs) > 1 and op.inputs[1] or "axes" in op.attrs:
        return op
    data = op.inputs[0]
    if not p.sharding(data).sharded_dims:
        return op
    axes = [d for d, size in enumerate(p.tensors[data].shape) if size == 1]
    name = p.shared_constant(f"{op.name}.axes", np.array(axes, np.int64), "int64", True)
    return dataclasses.replace(op, inputs=(data, name))


# ---- rule notes -------------------------------------------------------------------------------

_GROUPS = {"Conv": "group", "GroupNormalization": "num_groups"}
"""Op type -> its group-count attribute (rule note "local_group")."""

_BIAS = {"Gemm": 2, "Conv": 2}
"""Op type -> its bias operand, added once per reduction group when the reduction is split."""


def local_groups(p: Partitioning, op: Op) -> list[list[Op]]:
    """Conv `group` / GroupNormalization `num_groups`: the groups a device holds."""
    attr = _GROUPS[op.type]
    groups = op.attr(attr, 1)
    x = op.inputs[0]
    channels = p.tensors[x].shape[1] if len(p.tensors[x].shape) > 1 else 0
    if not isinstance(groups, int) or groups <= 1 or 1 not in p.sharding(x).sharded_dims:
        return [[op] for _ in range(p.count)]
    per_group = channels // groups
    out = []
    for shape in p.local(x):
        if shape[1] % per_group:
            raise p.fail(
                op,
                f"a device holds {shape[1]} of {channels} channels, not whole groups of "
                f"{per_group}",
            )
        out.append(
            [dataclasses.replace(op, attrs=Attrs({**op.attrs, attr: shape[1] // per_group}))]
        )
    return out


_HEADS: Mapping[str, tuple[tuple[str, int], ...]] = {
    "Attention": (("q_num_heads", 0), ("kv_num_heads", 1)),
    "GroupQueryAttention": (("num_heads", 0), ("kv_num_heads", 1)),
    "MultiHeadAttention": (("num_heads", 0),),
    "RotaryEmbedding": (("num_heads", 0),),
}
"""Op type -> its head-count attributes and the 3-D operand whose last dim holds those heads
(rule note "local_heads"; the same for the ONNX and the com.microsoft op of one name)."""


def local_heads(p: Partitioning, op: Op) -> list[list[Op]]:
    """Head counts of the 3-D layout ([B, S, heads · head size]): the heads a device holds,
    from its local hidden dim (the rule splits it by whole heads: rules/attention.py)."""
    out: list[list[Op]] = [[] for _ in range(p.count)]
    counts: list[dict[str, AttrValue]] = [{} for _ in range(p.count)]
    for attr, index in _HEADS[op.type]:
        heads = op.attr(attr, 0)
        name = op.inputs[index] if index < len(op.inputs) else ""
        if not isinstance(heads, int) or heads < 1 or not name:
            continue
        hidden = p.tensors[name].shape[-1]
        for k, shape in enumerate(p.local(name)):
            if shape[-1] % (hidden // heads):
                raise p.fail(op, f"a device holds {shape[-1]} of {hidden} of {name}, not whole "
                             f"heads of {hidden // heads}")  # fmt: skip
            counts[k][attr] = shape[-1] // (hidden // heads)
    for k in range(p.count):
        out[k].append(dataclasses.replace(op, attrs=Attrs({**op.attrs, **counts[k]})))
    return out


def local_attention(p: Partitioning, op: Op) -> list[list[Op]]:
    """ONNX Attention: its head counts (`local_heads`) and, when causal with its queries
    split, its causal mask written out. The op places query i at key position i + P (P past
    keys); a device holding queries [lo, hi) needs them at lo + i + P, which no attribute
    says, so it gets `is_causal = 0` and the boolean mask `key <= lo + i + P`, combined with
    its own mask if it has one: `And` for a boolean mask, `Where(allowed, mask, lowest)` for an
    additive one (onnxruntime's causal mask puts the lowest finite number there, over the
    mask's value)."""
    per_device = local_heads(p, op)
    query = op.inputs[0]
    dim = 2 if len(p.tensors[query].shape) == 4 else 1
    if not op.attr("is_causal", 0) or not p.sharding(query).axes_of(dim):
        return per_device
    inputs = [*op.inputs, "", "", ""]
    past = p.tensors[inputs[4]].shape[2] if inputs[4] else 0
    keys = p.tensors[inputs[1]].shape[dim] + past
    mask = inputs[3]
    if mask and p.tensors[mask].shape[-1] != keys:
        raise p.fail(op, f"its mask covers {p.tensors[mask].shape[-1]} of {keys} keys, and a "
                     "split causal op needs its mask written out over all of them")  # fmt: skip
    values = []
    for region in p.regions(query):
        lo, hi = region[dim]
        values.append(np.arange(keys)[None, :] <= np.arange(lo, hi)[:, None] + past)
    allowed = p.device_constant(f"{op.name}.causal", "bool", values)
    combined, joined = allowed, []
    if mask:
        dtype = p.dtypes[mask]
        combined = p.fresh(f"{mask}.causal")
        shapes = [
            np.broadcast_shapes(m, v.shape) for m, v in zip(p.local(mask), values, strict=True)
        ]
        p.temporary(combined, dtype, shapes)
        if dtype == "bool":
            joined = [_node(op.name, "causal", "And", (mask, allowed), combined)]
        else:
            lowest = np.array(np.finfo(dtypes.numpy_dtype(dtype)).min)
            floor = p.shared_constant(f"{op.name}.lowest", lowest, dtype, False)
            joined = [_node(op.name, "causal", "Where", (allowed, mask, floor), combined)]
    out = []
    for ops in per_device:
        attention = ops[-1]
        rewritten = [*attention.inputs, "", "", ""][: max(4, len(attention.inputs))]
        rewritten[3] = combined
        attrs = Attrs({**attention.attrs, "is_causal": 0})
        local = dataclasses.replace(attention, inputs=tuple(rewritten), attrs=attrs)
        out.append([*ops[:-1], *joined, local])
    return out


def bias_once(p: Partitioning, op: Op) -> list[list[Op]]:
    """With its reduction split, the bias is added by each reduction group's first device
    only (the others drop the optional operand): the partial sums then count it once."""
    index = _BIAS[op.type]
    partial = p.sharding(op.outputs[0]).partial_axes
    if not partial or len(op.inputs) <= index or not op.inputs[index]:
        return [[op] for _ in range(p.count)]
    out = []
    for k in range(p.count):
        device = p.mesh.multi_index(k)
        dropped = any(device[a] for a in partial)
        out.append([dataclasses.replace(op, inputs=op.inputs[:index]) if dropped else op])
    return out


def masked_lookup(p: Partitioning, op: Op) -> list[list[Op]]:
    """Gather from a table split along the gathered axis (rule note "masked_lookup").

    A device holding rows [lo, hi) of the V rows computes

        ids'  = (ids < 0 ? ids + V : ids) - lo
        hit   = 0 <= ids' < hi - lo
        out   = hit ? Gather(table, hit ? ids' : 0) : 0

    so the devices' results are partial sums of the global lookup. A device holding no rows
    gets zeros (a Gather from an empty table would fail even where masked). When the result
    is not partial, the ids are block-local (rules/shape.py): every id of a device falls in
    its rows, and `out = Gather(table, ids')` is all it takes.
    """
    data, ids = op.inputs[0], op.inputs[1]
    rank = len(p.tensors[data].shape)
    axis = op.attr("axis", 0)
    assert isinstance(axis, int)
    axis %= rank
    if not p.sharding(data).axes_of(axis):
        return [[op] for _ in range(p.count)]
    out = op.outputs[0]
    vocab = p.tensors[data].shape[axis]
    id_type, table_type = p.dtypes[ids], p.dtypes[data]
    bounds = [region[axis] for region in p.regions(data)]
    out_shapes, id_shapes = p.local(out), p.local(ids)
    base = op.name
    # The rewrite's constants are the devices' own: the program keeps its one Gather.
    lo = p.device_constant(f"{base}.lo", id_type, [np.array(a) for a, _ in bounds])
    scalar = functools.partial(p.shared_constant, dtype=id_type, in_program=False)
    zero, size = scalar(f"{base}.zero", np.array(0)), scalar(f"{base}.vocab", np.array(vocab))
    t = {
        key: p.fresh(f"{out}.{key}")
        for key in ("negative", "wrapped", "normal", "shifted", "low", "high", "hit",
                    "safe", "rows_read", "mask")
    }  # fmt: skip
    for key in ("negative", "low", "high", "hit"):
        p.temporary(t[key], "bool", id_shapes)
    for key in ("wrapped", "normal", "shifted", "safe"):
        p.temporary(t[key], id_type, id_shapes)
    lookup = _local_ids(base, ids, zero, size, lo, t, "shifted", "shift")
    if not p.sharding(out).partial_axes:
        lookup.append(_node(base, "gather", "Gather", (data, t["shifted"]), out, axis=axis))
        return [lookup] * p.count
    p.temporary(t["rows_read"], table_type, out_shapes)
    rows = p.device_constant(f"{base}.rows", id_type, [np.array(b - a) for a, b in bounds])
    lookup += [
        _node(base, "low", "GreaterOrEqual", (t["shifted"], zero), t["low"]),
        _node(base, "high", "Less", (t["shifted"], rows), t["high"]),
        _node(base, "hit", "And", (t["low"], t["high"]), t["hit"]),
        _node(base, "safe", "Where", (t["hit"], t["shifted"], zero), t["safe"]),
        _node(base, "gather", "Gather", (data, t["safe"]), t["rows_read"], axis=axis),
    ]
    mask = t["hit"]
    id_rank = len(p.tensors[ids].shape)
    unsqueeze = [*range(axis), *range(axis + id_rank, rank - 1 + id_rank)]
    if unsqueeze:  # the hit mask broadcast over the looked-up rows
        mask = t["mask"]
        shapes = [(1,) * axis + shape + (1,) * (rank - axis - 1) for shape in id_shapes]
        p.temporary(mask, "bool", shapes)
        axes = scalar(f"{base}.mask_axes", np.array(unsqueeze), dtype="int64")
        lookup.append(_node(base, "mask", "Unsqueeze", (t["hit"], axes), mask))
    if table_type == "bool":  # (onnxruntime has no boolean Where)
        lookup.append(_node(base, "select", "And", (mask, t["rows_read"]), out))
    else:
        nothing = scalar(f"{base}.nothing", np.array(0), dtype=table_type)
        lookup.append(_node(base, "select", "Where", (mask, t["rows_read"], nothing), out))
    if all(b > a for a, b in bounds):
        return [lookup] * p.count
    out_shape = p.device_constant(
        f"{base}.out_shape", "int64", [np.array(s, np.int64) for s in out_shapes]
    )
    zeros = np.zeros((1,), dtypes.numpy_dtype(table_type))
    empty = [_node(base, "zeros", "ConstantOfShape", (out_shape,), out, value=zeros)]
    return [lookup if b > a else empty for a, b in bounds]


def local_positions(p: Partitioning, op: Op) -> list[list[Op]]:
    """GatherND whose indexed data dims are split (rule note "masked_lookup": constant ids
    local to blocks of a row dim): each device subtracts its rows' start from that
    component of the ids, after normalizing negative ids by the dim's size.

        ids'  = (ids < 0 ? ids + sizes : ids) - starts       (per component, last dim)
        out   = GatherND(data, ids')
    """
    data, ids = op.inputs[0], op.inputs[1]
    batch = op.attr("batch_dims", 0)
    assert isinstance(batch, int)
    k = p.tensors[ids].shape[-1]
    indexed = range(batch, batch + k)
    sharding = p.sharding(data)
    if not any(sharding.axes_of(d) for d in indexed):
        return [[op] for _ in range(p.count)]
    shape = p.tensors[data].shape
    regions = p.regions(data)
    id_type, base = p.dtypes[ids], op.name
    starts = p.device_constant(
        f"{base}.starts", id_type, [np.array([r[d][0] for d in indexed]) for r in regions]
    )
    sizes = p.shared_constant(
        f"{base}.sizes", np.array([shape[d] for d in indexed]), id_type, False
    )
    zero = p.shared_constant(f"{base}.zero", np.array(0), id_type, False)
    t = {key: p.fresh(f"{ids}.{key}") for key in ("negative", "wrapped", "normal", "local")}
    id_shapes = p.local(ids)
    p.temporary(t["negative"], "bool", id_shapes)
    for key in ("wrapped", "normal", "local"):
        p.temporary(t[key], id_type, id_shapes)
    rewritten = [
        *_local_ids(base, ids, zero, sizes, starts, t, "local", "local"),
        dataclasses.replace(op, inputs=(data, t["local"], *op.inputs[2:])),
    ]
    return [rewritten] * p.count


def _local_ids(
    base: str,
    ids: str,
    zero: str,
    sizes: str,
    starts: str,
    t: Mapping[str, str],
    result: str,
    suffix: str,
) -> list[Op]:
    """Ids as positions in a device's rows: `(ids < 0 ? ids + sizes : ids) - starts`.

    ONNX ids may count from the end of their dim (-1 is the last row), and only the global
    size says where that is: negative ids are normalized first, then the device's start (a
    per-device constant) is subtracted. Temporaries `t["negative"]`, `t["wrapped"]`,
    `t["normal"]` and `t[result]` are the caller's; the last op is named `{base}/{suffix}`.
    """
    return [
        _node(base, "negative", "Less", (ids, zero), t["negative"]),
        _node(base, "wrap", "Add", (ids, sizes), t["wrapped"]),
        _node(base, "normal", "Where", (t["negative"], t["wrapped"], ids), t["normal"]),
        _node(base, suffix, "Sub", (t["normal"], starts), t[result]),
    ]


def _node(
    base: str, suffix: str, kind: str, inputs: Sequence[str], output: str, **attrs: AttrValue
) -> Op:
    """A local op of a rewrite, named after the program's op it implements."""
    return Op(f"{base}/{suffix}", kind, "", tuple(inputs), (output,), Attrs(attrs))


# ---- the tables -------------------------------------------------------------------------------

SHAPE_REWRITES: Mapping[str, ShapeRewrite] = MappingProxyType(
    {
        **dict.fromkeys(_SHAPE_OPERAND, local_result_shape),
        "Slice": local_slice_bounds,
        "Squeeze": explicit_squeeze_axes,
    }
)
"""Op type -> the rewrite of its shape-carrying operands (the program's op)."""

NOTE_REWRITES: Mapping[tuple[Note, str], LocalRewrite] = MappingProxyType(
    {
        (Note.MASKED_LOOKUP, "Gather"): masked_lookup,
        (Note.MASKED_LOOKUP, "GatherND"): local_positions,
        (Note.BIAS_ONCE, "Gemm"): bias_once,
        (Note.BIAS_ONCE, "Conv"): bias_once,
        (Note.LOCAL_GROUP, "Conv"): local_groups,
        (Note.LOCAL_GROUP, "GroupNormalization"): local_groups,
        **{(Note.LOCAL_HEADS, t): local_heads for t in _HEADS if t != "Attention"},
        (Note.LOCAL_HEADS, "Attention"): local_attention,
    }
)
"""(rule note, op type) -> each device's local ops. An op whose split needs no rewrite runs
as it is; every note a rule gives is here (tests/e2e/test_partition.py)."""
