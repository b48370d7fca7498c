"""Hand-written sharding plans, as annotation generators: the baselines the search must beat.

Each baseline is a pure function of (graph, mesh, axes) returning `Annotation`s that
`propagate` completes without conflict:

- `data_parallel`: the batch dim of every graph input split over `axes`; the split follows the
  batch through the model, weights stay replicated, no op needs another device's data.
- `megatron`: Megatron-LM tensor parallelism (Shoeybi et al. 2019) found from the graph's
  structure. It annotates weights only (how each is held, required); propagation splits the
  activations between them and materialization inserts the all_reduces.
- `dp_tp`: both, the batch over `dp_axis`, the weights over `tp_axis`.

Megatron's patterns, over *projections*: a MatMul or Gemm of an activation (features on its
last dim) by a 2-D initializer reached directly or through Transpose/Cast, so `[in, out]`
MatMul weights, Gemm's transB `[out, in]` and transposed weights all count:

    MLP        A ─ ops local to each feature ─► B     A column-split (output features, with
                                                     its bias), B row-split (input features):
                                                     B's result is a partial sum, one
                                                     all_reduce closes the block. A is every
                                                     projection feeding the region (SwiGLU's
                                                     gate and up), B every one it feeds.
    attention  Q, K, V ─► Reshape [.., F] -> [.., heads, head_dim] ─► attention ─► O
                                                     Q, K, V column-split by heads, O
                                                     row-split: one all_reduce. Only when
                                                     every head count (GQA: K and V have
                                                     fewer) divides by the axis size.
    embedding  Gather of a [vocab, hidden] table by ids computed from a graph input: the
               table split on the vocabulary. The Gather rule's masked lookup gives a partial
               sum: one all_reduce.
    LM head    the projection back to the vocabulary (the tied table, or an untied
               [hidden, vocab] weight): column-split, so the logits are returned split over
               the vocabulary, as Megatron's vocab-parallel cross-entropy consumes them (a
               caller wanting whole logits annotates the output: one all_gather).

Worked example, GPT-2 (dynamo export, tied embedding) on mesh [2], axis 0:

    lm.lm_head.weight            [512, 64]   [[0]]        embedding and tied LM head
    h.0.attn.c_proj.weight       [64, 64]    [[0]]        attention output, row
    h.0.mlp.c_fc.weight          [64, 256]   [[], [0]]    MLP first, column
    h.0.mlp.c_fc.bias            [256]       [[0]]
    h.0.mlp.c_proj.weight        [256, 64]   [[0]]        MLP second, row
    (h.1 alike)

materializes as 5 all_reduces (the embedding's, then two per layer) and, per layer, three free
all_slices of the fused QKV (below).

Fused QKV (GPT-2's c_attn: one [h, 3h] weight, then Split into q, k, v): each device's heads
are three column blocks of the fused weight (a slice of q's, of k's and of v's columns), and a
sharding splits a dim into contiguous blocks only, so no sharding of the fused weight gives a
device its heads. Megatron-LM re-lays the weight out ([h, heads, 3, head_dim]), which is a
model rewrite, not a sharding. Here the fused projection stays replicated (each device computes
all of q, k and v: 3h² redundant multiply-adds per token and a replicated [h, 3h] weight) and
the output projection's row split propagates back through the attention to the Split's
results, which each device slices to its heads for free (all_slice). Communication is exactly
Megatron's; only the fused projection's compute and memory are not divided.

Layers that match no pattern are left alone (replicated): MoE experts gathered per token,
convolutions, routers.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from autoshard.annotations import Annotation
from autoshard.errors import AutoshardError
from autoshard.ir.graph import Graph, Op
from autoshard.mesh import Mesh
from autoshard.rules.elementwise import BROADCAST, UNARY
from autoshard.sharding import Sharding

_VIEWS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze"})
_WEIGHT_VIEWS = frozenset({"Transpose", "Cast", "Identity"})


class BaselineError(AutoshardError):
    """A baseline that cannot apply: unknown or repeated mesh axes, or a batch that does not
    divide over the data-parallel axes."""


@dataclass(frozen=True)
class Projection:
    """`op` multiplies the activation `data` (features on its last dim) by the initializer
    `weight`, whose dim `in_dim` holds the input features and `out_dim` the output features.
    `bias` is the [out] initializer added to the result (Gemm's C, or the only user's Add),
    or ""."""

    op: str
    data: str
    output: str
    weight: str
    in_dim: int
    out_dim: int
    in_features: int
    out_features: int
    bias: str = ""


def find_projections(graph: Graph) -> dict[str, Projection]:
    """Every projection of the graph, by op name, in graph order."""
    found = {}
    for op in graph.ops:
        projection = _projection(op, graph)
        if projection is not None:
            found[op.name] = projection
    return found


def _shape(graph: Graph, name: str) -> tuple[int, ...]:
    return graph.values[name].shape


def _projection(op: Op, graph: Graph) -> Projection | None:
    if op.type == "MatMul":
        operand_dims = (0, 1)
    elif op.type == "Gemm" and not op.attr("transA", 0):
        operand_dims = (1, 0) if op.attr("transB", 0) else (0, 1)
    else:
        return None
    data, rhs = op.inputs[0], op.inputs[1]
    if not _shape(graph, data) or len(_shape(graph, rhs)) != 2:
        return None
    if _weight_source(graph, data) is not None:
        return None
    source = _weight_source(graph, rhs)
    if source is None:
        return None
    weight, where = source
    in_dim, out_dim = where[operand_dims[0]], where[operand_dims[1]]
    shape = _shape(graph, weight)
    out_features = shape[out_dim]
    return Projection(
        op.name,
        data,
        op.outputs[0],
        weight,
        in_dim,
        out_dim,
        shape[in_dim],
        out_features,
        _bias(op, graph, out_features),
    )


def _weight_source(graph: Graph, name: str) -> tuple[str, tuple[int, ...]] | None:
    """The initializer `name` is a view of, and where each of `name`'s dims is in it."""
    where = list(range(len(_shape(graph, name))))
    while name not in graph.weights:
        op = graph.producer(name)
        if op is None or op.type not in _WEIGHT_VIEWS:
            return None
        if op.type == "Transpose":
            rank = len(_shape(graph, op.inputs[0]))
            perm = op.attr("perm", tuple(reversed(range(rank))))
            assert isinstance(perm, tuple)
            where = [int(perm[w]) for w in where]  # result dim j is input dim perm[j]
        name = op.inputs[0]
    return name, tuple(where)


def _bias(op: Op, graph: Graph, features: int) -> str:
    """Gemm's C, or the weight the result's only user adds, when it is one value per
    output feature ([F] or [1, F])."""
    candidates = []
    if op.type == "Gemm" and len(op.inputs) > 2:
        candidates.append(op.inputs[2])
    users = graph.consumers(op.outputs[0])
    if op.type == "MatMul" and len(users) == 1 and users[0].type == "Add":
        candidates += [name for name in users[0].inputs if name != op.outputs[0]]
    for name in candidates:
        shape = _shape(graph, name) if name else ()
        if name in graph.weights and shape[-1:] == (features,) == (math.prod(shape),):
            return name
    return ""


# ---- the feature dim through the graph --------------------------------------------------------


def _is_param(graph: Graph, name: str) -> bool:
    return not name or name in graph.weights or name in graph.constants


def _keeps_features(op: Op, graph: Graph, value: str, params_only: bool = False) -> bool:
    """Whether `op` computes each feature (last dim) of its results from the same feature of
    `value` alone: an elementwise op with results of `value`'s last dim, or a view that keeps
    the last dim whole. With `params_only`, the op's other data operands must be weights or
    constants (a bias, a scale), not activations."""
    results = [_shape(graph, name) for name in op.outputs if name]
    shape = _shape(graph, value)
    if not shape or not results or any(not r or r[-1] != shape[-1] for r in results):
        return False
    if op.type in _VIEWS:
        return op.inputs[0] == value and math.prod(results[0]) == math.prod(shape)
    if op.type in UNARY:
        return op.inputs[0] == value
    if op.type in BROADCAST:
        others = [name for name in op.inputs if name != value]
        return not params_only or all(_is_param(graph, name) for name in others)
    return False


def _head_reshapes(graph: Graph, projection: Projection) -> tuple[list[tuple[str, int]], bool]:
    """The Reshapes splitting the projection's features into [heads, head_dim], reached
    through feature-keeping ops (bias, scale) and Splits of the features (fused QKV), as
    (op name, heads); and whether a Split lies on the way."""
    found: list[tuple[str, int]] = []
    fused = False
    stack, seen = [projection.output], set()
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        shape = _shape(graph, value)
        for op in graph.consumers(value):
            if op.type == "Reshape" and op.inputs[0] == value:
                out = _shape(graph, op.outputs[0])
                if len(out) == len(shape) + 1 and out[:-2] == shape[:-1] and out[-2] > 1:
                    found.append((op.name, out[-2]))
                    continue
            last = op.attr("axis", 0) in (-1, len(shape) - 1)
            if op.type == "Split" and op.inputs[0] == value and last:
                fused = True
                stack += [name for name in op.outputs if name]
            elif _keeps_features(op, graph, value, params_only=True):
                stack += [name for name in op.outputs if name]
    return found, fused


# ---- patterns ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Attention:
    """An attention block: the projections splitting heads (`fused` those whose features a
    Split cuts first), the head count of each of their head Reshapes, the ops between
    (`region`) and the output projections the region ends in."""

    inputs: frozenset[str]
    fused: frozenset[str]
    heads: frozenset[int]
    region: frozenset[str]
    outputs: frozenset[str]

    def __or__(self, other: _Attention) -> _Attention:
        return _Attention(
            self.inputs | other.inputs,
            self.fused | other.fused,
            self.heads | other.heads,
            self.region | other.region,
            self.outputs | other.outputs,
        )


def _attentions(graph: Graph, projections: dict[str, Projection]) -> list[_Attention]:
    """Attention blocks: the ops reachable from a projection's head Reshapes without entering
    a projection are its region; projections whose regions share an op (Q and K meet in the
    scores, V joins at the weighted sum) are one block; the projections the region ends in
    are the block's output projections."""
    blocks: list[_Attention] = []
    for name, projection in projections.items():
        reshapes, fused = _head_reshapes(graph, projection)
        if not reshapes:
            continue
        region: set[str] = set()
        ends: set[str] = set()
        stack = [graph.op_by_name[op].outputs[0] for op, _ in reshapes]
        while stack:
            value = stack.pop()
            for op in graph.consumers(value):
                if op.name in projections and op.inputs[0] == value:
                    ends.add(op.name)
                elif op.name not in region:
                    region.add(op.name)
                    stack += [out for out in op.outputs if out]
        block = _Attention(
            frozenset({name}),
            frozenset({name} if fused else ()),
            frozenset(h for _, h in reshapes),
            frozenset(region),
            frozenset(ends),
        )
        for other in [b for b in blocks if b.region & block.region]:
            blocks.remove(other)
            block |= other
        blocks.append(block)
    return blocks


def _mlp(
    graph: Graph, start: Projection, projections: dict[str, Projection]
) -> tuple[list[Projection], list[Projection]] | None:
    """The MLP block whose first projections include `start`: (column, row) projections.

    From A's result, the region grows through ops that keep each feature local (activation,
    gating Mul, bias Add, views keeping the features) until it reaches projections reading it
    as their input features (B). The region must be closed: every user of every value in it is
    a region op or a B, and every other operand a parameter, a broadcast, or the result of
    another projection with the same features (SwiGLU's up projection joins A). A residual
    add, a norm, a graph output: not an MLP.
    """
    features = start.out_features
    by_output = {p.output: p for p in projections.values()}
    firsts, seconds = {start.op: start}, {}
    stack, region = [start.output], {start.output}
    foreign: set[str] = set()  # other operands, which must turn out to be in the region
    while stack:
        value = stack.pop()
        if value in graph.outputs:
            return None
        for op in graph.consumers(value):
            projection = projections.get(op.name)
            if projection is not None and op.inputs[0] == value:
                if projection.in_features != features:
                    return None
                seconds[op.name] = projection
                continue
            if not _keeps_features(op, graph, value):
                return None
            for name in op.inputs:
                if name in region or _is_param(graph, name) or op.type in _VIEWS | UNARY:
                    continue
                other = by_output.get(name)
                if other is not None and other.out_features == features:
                    firsts[other.op] = other
                else:
                    if _shape(graph, name)[-1:] not in ((), (1,)):
                        foreign.add(name)
                    continue
                region.add(name)
                stack.append(name)
            for name in op.outputs:
                if name and name not in region:
                    region.add(name)
                    stack.append(name)
    # An operand from outside with features of its own (a residual) makes it no MLP.
    if not seconds or set(firsts) & set(seconds) or foreign - region:
        return None
    return list(firsts.values()), list(seconds.values())


def _embeddings(graph: Graph) -> list[tuple[str, str]]:
    """(Gather op, table) of every lookup of a [vocab, hidden] table on axis 0 by ids
    computed from a graph input (position and type embeddings read constant ids)."""
    computed = set(graph.inputs)
    for op in graph.ops:
        if any(name in computed for name in op.inputs):
            computed.update(op.outputs)
    found = []
    for op in graph.ops:
        if op.type != "Gather" or op.attr("axis", 0) not in (0, -2):
            continue
        table, ids = op.inputs[0], op.inputs[1]
        if table in graph.weights and len(_shape(graph, table)) == 2 and ids in computed:
            found.append((op.name, table))
    return found


# ---- the baselines ----------------------------------------------------------------------------


def _axes(mesh: Mesh, axes: Iterable[int | str], what: str) -> tuple[int, ...]:
    try:
        checked = tuple(mesh.axis(a) for a in axes)
    except AutoshardError as error:
        raise BaselineError(f"{what}: {error}") from None
    if len(set(checked)) != len(checked):
        raise BaselineError(f"{what}: mesh axes {list(checked)} repeat an axis")
    return checked


def _split(rank: int, dim: int, axes: Sequence[int]) -> Sharding:
    return Sharding(tuple(tuple(axes) if d == dim else () for d in range(rank)))


def data_parallel(graph: Graph, mesh: Mesh, axes: Sequence[int | str] = (0,)) -> list[Annotation]:
    """Split the batch over `axes`: dim 0 of every graph input whose dim 0 is the batch (the
    leading dim most inputs share: token ids and attention masks, images).

    GPT-2, input_ids [8, 16], mesh 2x4: `input_ids=[[0]]`; with axes (0, 1): `[[0, 1]]`.
    """
    checked = _axes(mesh, axes, "data_parallel")
    ranked = [name for name in graph.inputs if _shape(graph, name)]
    if not ranked or not checked:
        return []
    batch = Counter(_shape(graph, name)[0] for name in ranked).most_common(1)[0][0]
    devices = mesh.group_size(checked)
    if batch % devices:
        raise BaselineError(
            f"data_parallel: batch {batch} does not divide over mesh axes {list(checked)} "
            f"({devices} devices); bind a batch that is a multiple of {devices}"
        )
    return [
        Annotation(name, _split(len(_shape(graph, name)), 0, checked))
        for name in ranked
        if _shape(graph, name)[0] == batch
    ]


def megatron(graph: Graph, mesh: Mesh, axis: int | str) -> list[Annotation]:
    """Megatron-LM tensor parallelism over one mesh axis (see the module docstring): required
    annotations on weights only, in graph order, each weight once."""
    (tp,) = _axes(mesh, (axis,), "megatron")
    n = mesh.shape[tp]
    projections = find_projections(graph)
    held: dict[str, Sharding] = {}

    def hold(weight: str, dim: int) -> None:
        # The first pattern to claim a weight wins; a weight used two ways is rare (a tied
        # table is claimed alike by the embedding and the LM head).
        held.setdefault(weight, _split(len(_shape(graph, weight)), dim, (tp,)))

    def column(p: Projection) -> None:
        hold(p.weight, p.out_dim)
        if p.bias:
            hold(p.bias, len(_shape(graph, p.bias)) - 1)

    claimed: set[str] = set()
    for block in _attentions(graph, projections):
        outputs = block.outputs - block.inputs
        if not outputs or any(h % n for h in block.heads):
            continue
        for name in projections:  # graph order
            if name in block.inputs - block.fused:  # fused QKV: see the module docstring
                column(projections[name])
            elif name in outputs:
                hold(projections[name].weight, projections[name].in_dim)
        claimed |= block.inputs | outputs
    for name, projection in projections.items():
        if name in claimed or projection.out_features % n:
            continue
        found = _mlp(graph, projection, projections)
        if found is None:
            continue
        firsts, seconds = found
        for p in firsts:
            column(p)
        for p in seconds:
            hold(p.weight, p.in_dim)
        claimed.update(p.op for p in firsts + seconds)
    tables = {}
    for _, table in _embeddings(graph):
        vocab, hidden = _shape(graph, table)
        if vocab % n == 0:
            hold(table, 0)
            tables[table] = (vocab, hidden)
    for name, projection in projections.items():
        if name in claimed:
            continue
        untied = (projection.out_features, projection.in_features) in tables.values()
        if projection.weight in tables or untied:
            column(projection)
    order: dict[str, tuple[int, int]] = {}
    for i, op in enumerate(graph.ops):
        for j, name in enumerate(op.inputs):
            order.setdefault(name, (i, j))
    return [Annotation(w, held[w]) for w in sorted(held, key=lambda w: (order[w], w))]


def dp_tp(
    graph: Graph, mesh: Mesh, dp_axis: int | str = 0, tp_axis: int | str = 1
) -> list[Annotation]:
    """Data parallel over `dp_axis` and Megatron over `tp_axis`: the two never annotate the
    same value (inputs vs weights), so they compose by concatenation."""
    dp, tp = _axes(mesh, (dp_axis, tp_axis), "dp_tp")
    return data_parallel(graph, mesh, (dp,)) + megatron(graph, mesh, tp)
