"""Megatron's patterns, found from a graph's structure (see `baselines` for the plan).

A *projection* is a MatMul or Gemm of an activation (features on its last dim) by a 2-D
initializer reached directly or through Transpose/Cast: `[in, out]` MatMul weights, Gemm's
transB `[out, in]` and transposed torch weights all count, and `Projection` says which weight
dim holds which features. On top of them: attention blocks (projections splitting heads, the
projections their attention ends in), MLP blocks (projections joined by feature-local ops),
embedding tables, MoE expert tables and channel-split conv pairs. Each finder is a pure
function of the graph; none sees the mesh.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from autoshard.ir.graph import Graph, Op
from autoshard.rules.elementwise import BROADCAST, ELEMENTWISE, UNARY

_VIEWS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze"})
_WEIGHT_VIEWS = frozenset({"Transpose", "Cast", "Identity"})


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


def shape_of(graph: Graph, name: str) -> tuple[int, ...]:
    return graph.values[name].shape


def _projection(op: Op, graph: Graph) -> Projection | None:
    if op.type == "MatMul":
        operand_dims = (0, 1)
    elif op.type == "Gemm" and not op.attr("transA", 0):
        operand_dims = (1, 0) if op.attr("transB", 0) else (0, 1)
    else:
        return None
    data, rhs = op.inputs[0], op.inputs[1]
    if not shape_of(graph, data) or len(shape_of(graph, rhs)) != 2:
        return None
    if weight_source(graph, data) is not None:
        return None
    source = weight_source(graph, rhs)
    if source is None:
        return None
    weight, where = source
    in_dim, out_dim = where[operand_dims[0]], where[operand_dims[1]]
    shape = shape_of(graph, weight)
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


def weight_source(graph: Graph, name: str) -> tuple[str, tuple[int, ...]] | None:
    """The initializer `name` is a view of, and where each of `name`'s dims is in it."""
    where = list(range(len(shape_of(graph, name))))
    while name not in graph.weights:
        op = graph.producer(name)
        if op is None or op.type not in _WEIGHT_VIEWS:
            return None
        if op.type == "Transpose":
            rank = len(shape_of(graph, op.inputs[0]))
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
        shape = shape_of(graph, name) if name else ()
        if name in graph.weights and shape[-1:] == (features,) == (math.prod(shape),):
            return name
    return ""


# ---- walks ------------------------------------------------------------------------------------


def _walk(starts: Iterable[str], step: Callable[[str], list[str] | None]) -> bool:
    """Walk values depth first from `starts`, each once: `step(value)` looks at the ops around
    `value` and names the values to go on to (the last named is walked first), or returns None
    to stop the walk there. True when the walk ran out of values, False when a step stopped it.

    Every finder below is one such walk: forward through a value's consumers (head Reshapes,
    attention regions, MLP and conv regions) or back through its producer (MoE experts)."""
    stack, seen = list(starts), set()
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        following = step(value)
        if following is None:
            return False
        stack += following
    return True


# ---- the feature dim through the graph --------------------------------------------------------


def _is_param(graph: Graph, name: str) -> bool:
    return not name or name in graph.weights or name in graph.constants


def _keeps_features(op: Op, graph: Graph, value: str, params_only: bool = False) -> bool:
    """Whether `op` computes each feature (last dim) of its results from the same feature of
    `value` alone: an elementwise op with results of `value`'s last dim, or a view that keeps
    the last dim whole. With `params_only`, the op's other data operands must be weights or
    constants (a bias, a scale), not activations."""
    results = [shape_of(graph, name) for name in op.outputs if name]
    shape = shape_of(graph, value)
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

    def step(value: str) -> list[str]:
        nonlocal fused
        shape = shape_of(graph, value)
        following = []
        for op in graph.consumers(value):
            if op.type == "Reshape" and op.inputs[0] == value:
                out = shape_of(graph, op.outputs[0])
                if len(out) == len(shape) + 1 and out[:-2] == shape[:-1] and out[-2] > 1:
                    found.append((op.name, out[-2]))
                    continue
            last = op.attr("axis", 0) in (-1, len(shape) - 1)
            if op.type == "Split" and op.inputs[0] == value and last:
                fused = True
                following += [name for name in op.outputs if name]
            elif _keeps_features(op, graph, value, params_only=True):
                following += [name for name in op.outputs if name]
        return following

    _walk([projection.output], step)
    return found, fused


# ---- patterns ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionBlock:
    """An attention block: the projections splitting heads (`fused` those whose features a
    Split cuts first), the head count of each of their head Reshapes, the ops between
    (`region`) and the output projections the region ends in."""

    inputs: frozenset[str]
    fused: frozenset[str]
    heads: frozenset[int]
    region: frozenset[str]
    outputs: frozenset[str]

    def __or__(self, other: AttentionBlock) -> AttentionBlock:
        return AttentionBlock(
            self.inputs | other.inputs,
            self.fused | other.fused,
            self.heads | other.heads,
            self.region | other.region,
            self.outputs | other.outputs,
        )


def attention_blocks(graph: Graph, projections: dict[str, Projection]) -> list[AttentionBlock]:
    """Attention blocks: the ops reachable from a projection's head Reshapes without entering
    a projection are its region; projections whose regions share an op (Q and K meet in the
    scores, V joins at the weighted sum) are one block; the projections the region ends in
    are the block's output projections."""
    blocks: list[AttentionBlock] = []
    for name, projection in projections.items():
        reshapes, fused = _head_reshapes(graph, projection)
        if not reshapes:
            continue
        starts = [graph.op_by_name[op].outputs[0] for op, _ in reshapes]
        region, ends = _attention_region(graph, projections, starts)
        block = AttentionBlock(
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


def _attention_region(
    graph: Graph, projections: dict[str, Projection], starts: list[str]
) -> tuple[set[str], set[str]]:
    """The ops reachable from `starts` without entering a projection, and the projections
    reached (reading the region as their input features)."""
    region: set[str] = set()
    ends: set[str] = set()

    def step(value: str) -> list[str]:
        following = []
        for op in graph.consumers(value):
            if op.name in projections and op.inputs[0] == value:
                ends.add(op.name)
            elif op.name not in region:
                region.add(op.name)
                following += [out for out in op.outputs if out]
        return following

    _walk(starts, step)
    return region, ends


def mlp_block(
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
    firsts, seconds = {start.op: start}, {}
    region = {start.output}  # the values reached, walked or still to walk
    foreign: set[str] = set()  # other operands, which must turn out to be in the region

    def ends(value: str) -> bool:
        """Whether `value` ends every MLP it is in: a graph output, or read by an op that
        neither keeps its features nor projects them from `features`. A property of the value
        alone, so the walk checks it on each value it is about to take (a residual stream's
        norm stops the walk at once, not after the stream's remaining layers)."""
        if value in graph.outputs:
            return True
        for op in graph.consumers(value):
            projection = projections.get(op.name)
            if projection is not None and op.inputs[0] == value:
                if projection.in_features != features:
                    return True
            elif not _keeps_features(op, graph, value):
                return True
        return False

    def step(value: str) -> list[str] | None:
        if ends(value):
            return None
        following = []
        for op in graph.consumers(value):
            projection = projections.get(op.name)
            if projection is not None and op.inputs[0] == value:
                seconds[op.name] = projection
                continue
            for name in op.inputs:
                if name in region or _is_param(graph, name) or op.type in _VIEWS | UNARY:
                    continue
                producer = graph.producer(name)
                other = projections.get(producer.name) if producer is not None else None
                if other is not None and other.output == name and other.out_features == features:
                    firsts[other.op] = other
                else:
                    if shape_of(graph, name)[-1:] not in ((), (1,)):
                        foreign.add(name)
                    continue
                region.add(name)
                following.append(name)
            for name in op.outputs:
                if name and name not in region:
                    region.add(name)
                    following.append(name)
        return None if any(ends(name) for name in following) else following

    if not _walk([start.output], step):
        return None
    # An operand from outside with features of its own (a residual) makes it no MLP.
    if not seconds or set(firsts) & set(seconds) or foreign - region:
        return None
    return list(firsts.values()), list(seconds.values())


_CHANNEL_LOCAL = UNARY | {
    "BatchNormalization", "InstanceNormalization", "MaxPool", "AveragePool", "LpPool"
}  # fmt: skip
"""Ops computing each channel (dim 1) of their result from the same channel of input 0."""


def _plain_conv(op: Op, graph: Graph) -> bool:
    return op.type == "Conv" and op.attr("group", 1) == 1 and op.inputs[1] in graph.weights


def conv_pairs(graph: Graph) -> list[tuple[Op, list[Op]]]:
    """Convolutions as Megatron MLPs: a Conv (output channels split, column) whose result
    reaches other Convs (input channels split, row) only through ops local to each channel
    (activation, batch norm, pooling, per-channel scale), with no other user: a closed region
    as in `mlp_block`. A residual add, a concatenation or a global pool ends it. Greedy, in graph
    order: VGG's conv chain pairs up as (1, 2), (3, 4)..."""
    pairs: list[tuple[Op, list[Op]]] = []
    claimed: set[str] = set()
    for op in graph.ops:
        if not _plain_conv(op, graph) or op.name in claimed:
            continue
        seconds = _row_convs(graph, op)
        if seconds and not claimed & {s.name for s in seconds}:
            pairs.append((op, seconds))
            claimed |= {op.name, *(s.name for s in seconds)}
    return pairs


def _row_convs(graph: Graph, conv: Op) -> list[Op] | None:
    """The Convs `conv`'s result reaches through channel-local ops, or None when the region
    between is not closed."""
    channels = shape_of(graph, conv.inputs[1])[0]
    seconds: list[Op] = []

    def step(value: str) -> list[str] | None:
        if value in graph.outputs:
            return None
        following = []
        for user in graph.consumers(value):
            if _plain_conv(user, graph) and user.inputs[0] == value:
                seconds.append(user)
                continue
            others = [name for name in user.inputs[1:] if not _is_param(graph, name)]
            local = user.type in _CHANNEL_LOCAL or user.type in BROADCAST and not others
            results = [name for name in user.outputs if name]
            if not local or user.inputs[0] != value or len(results) != 1:
                return None
            if shape_of(graph, results[0])[1:2] != (channels,):
                return None
            following.append(results[0])
        return following

    return seconds if _walk([conv.outputs[0]], step) else None


def _computed(graph: Graph) -> set[str]:
    """The values that depend on a graph input."""
    computed = set(graph.inputs)
    for op in graph.ops:
        if any(name in computed for name in op.inputs):
            computed.update(op.outputs)
    return computed


def _lookup(op: Op, graph: Graph, rank: int, computed: set[str]) -> str:
    """The table `op` looks rows up in along its dim 0 by computed ids, when the table is an
    initializer of `rank` dims (Gather on axis 0, or GatherND by one index per row); or ""."""
    table, ids = (op.inputs + ("", ""))[:2]
    if table not in graph.weights or len(shape_of(graph, table)) != rank or ids not in computed:
        return ""
    if op.type == "Gather" and op.attr("axis", 0) in (0, -rank):
        return table
    one_index = shape_of(graph, ids)[-1:] == (1,)
    return table if op.type == "GatherND" and not op.attr("batch_dims", 0) and one_index else ""


def embedding_tables(graph: Graph) -> list[str]:
    """The [vocab, hidden] tables looked up by ids computed from a graph input (position and
    type embeddings read constant ids), once each."""
    computed = _computed(graph)
    tables = (_lookup(op, graph, 2, computed) for op in graph.ops if op.type == "Gather")
    return list(dict.fromkeys(t for t in tables if t))


def expert_downs(graph: Graph) -> list[tuple[str, int]]:
    """MoE experts: (table, dim) of every [experts, a, b] table whose rows are gathered per
    token and multiplied (batched MatMul) with the output of another such expert matmul
    (through ops local to each feature: activation, gating, the Slice/Split of a fused
    gate_up, squeezes). `dim` is the table dim that matmul contracts: split, it makes the
    expert FFN's second matmul row-parallel, one all_reduce per MoE layer. The first matmul
    follows by propagation (a fused gate_up stays replicated and is sliced, as fused QKV)."""
    computed = _computed(graph)
    experts: dict[str, tuple[str, int, str]] = {}  # matmul -> (table, contracted dim, input)
    for op in graph.ops:
        table = _lookup(op, graph, 3, computed) if op.type in ("Gather", "GatherND") else ""
        rows = op.outputs[0] if table else ""
        if not rows or len(shape_of(graph, rows)) != 3:
            continue
        for user in graph.consumers(rows):
            if user.type == "MatMul" and user.inputs[0] != user.inputs[1]:
                lhs = user.inputs[0] == rows  # W[t] @ x[t]: contracts the table's last dim
                experts[user.name] = (table, 2 if lhs else 1, user.inputs[1 if lhs else 0])
    outputs = {graph.op_by_name[name].outputs[0] for name in experts}
    local = ELEMENTWISE | _VIEWS | {"Slice", "Split"}

    def step(value: str) -> list[str] | None:
        """Back through feature-local producers; None (stop) at another expert matmul."""
        if value in outputs:
            return None
        producer = graph.producer(value)
        if producer is None or producer.type not in local:
            return []
        return [name for name in producer.inputs if name and not _is_param(graph, name)]

    # A walk stopped by `step` reached the output of another expert matmul.
    return [(table, dim) for table, dim, data in experts.values() if not _walk([data], step)]
