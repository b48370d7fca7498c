"""Hand-written sharding plans, as annotation generators: the baselines the search must beat.

Each baseline is a pure function of (graph, mesh, axes) returning `Annotation`s that
`propagate` completes without conflict:

- `data_parallel`: the batch dim of every graph input split over `axes`; the split follows the
  batch through the model, weights stay replicated, no op needs another device's data.
- `megatron`: Megatron-LM tensor parallelism (Shoeybi et al. 2019) found from the graph's
  structure. It annotates weights only (how each is held, required); propagation splits the
  activations between them and materialization inserts the all_reduces.
- `dp_tp`: both, the batch over `dp_axis`, the weights over `tp_axis`.

Megatron's patterns (found by `autoshard.analysis.patterns`), over *projections*: a MatMul or
Gemm of an activation (features on its last dim) by a 2-D initializer reached directly or
through Transpose/Cast, so `[in, out]` MatMul weights, Gemm's transB `[out, in]` and
transposed weights all count:

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
    MoE        experts [E, a, b] gathered per token, the FFN as batched MatMuls: the second
               matmul's table split on the dim it contracts (row), the first following by
               propagation: one all_reduce per MoE layer (`patterns.expert_downs`).
    CNN        Conv (output channels) ─ channel-local ops ─► Conv (input channels): the MLP
               pattern on channels, one all_reduce per pair (`patterns.conv_pairs`).

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

Layers that match no pattern are left alone (replicated): routers, grouped convolutions,
convolutions followed by a residual add or a concatenation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from autoshard.analysis.patterns import (
    Projection,
    attention_blocks,
    conv_pairs,
    embedding_tables,
    expert_downs,
    find_projections,
    mlp_block,
    shape_of,
)
from autoshard.annotations import Annotation
from autoshard.errors import AutoshardError
from autoshard.ir.graph import Graph
from autoshard.mesh import Mesh
from autoshard.sharding import Sharding


class BaselineError(AutoshardError):
    """A baseline that cannot apply: unknown or repeated mesh axes, or a batch that does not
    divide over the data-parallel axes."""


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
    # A training step's optimizer state is an input too, but no batch (`Graph.replaced`).
    ranked = [n for n in graph.inputs if shape_of(graph, n) and n not in graph.replaced]
    if not ranked or not checked:
        return []
    batch = Counter(shape_of(graph, name)[0] for name in ranked).most_common(1)[0][0]
    devices = mesh.group_size(checked)
    if batch % devices:
        raise BaselineError(
            f"data_parallel: batch {batch} does not divide over mesh axes {list(checked)} "
            f"({devices} devices); bind a batch that is a multiple of {devices}"
        )
    return [
        Annotation(name, _split(len(shape_of(graph, name)), 0, checked))
        for name in ranked
        if shape_of(graph, name)[0] == batch
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
        held.setdefault(weight, _split(len(shape_of(graph, weight)), dim, (tp,)))

    def column(p: Projection) -> None:
        hold(p.weight, p.out_dim)
        if p.bias:
            hold(p.bias, len(shape_of(graph, p.bias)) - 1)

    claimed: set[str] = set()
    for block in attention_blocks(graph, projections):
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
        found = mlp_block(graph, projection, projections)
        if found is None:
            continue
        firsts, seconds = found
        for p in firsts:
            column(p)
        for p in seconds:
            hold(p.weight, p.in_dim)
        claimed.update(p.op for p in firsts + seconds)
    for conv, row_convs in conv_pairs(graph):
        if shape_of(graph, conv.inputs[1])[0] % n == 0:
            hold(conv.inputs[1], 0)  # [out, in, kh, kw]: output channels
            if len(conv.inputs) > 2 and conv.inputs[2] in graph.weights:
                hold(conv.inputs[2], 0)
            for row in row_convs:
                hold(row.inputs[1], 1)  # input channels; its bias is added once (bias_once)
    for table, dim in expert_downs(graph):
        if shape_of(graph, table)[dim] % n == 0:
            hold(table, dim)
    tables = {}
    for table in embedding_tables(graph):
        vocab, hidden = shape_of(graph, table)
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
