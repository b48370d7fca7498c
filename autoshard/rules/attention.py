"""Fused attention ops: ONNX Attention and RotaryEmbedding (opset 23), and onnxruntime's
com.microsoft GroupQueryAttention, MultiHeadAttention, RotaryEmbedding, and its packed-weight
Attention and EmbedLayerNormalization (BERT-style exports; these split the batch only).

Attention computes, per batch b, query head q, query position i and key position j,

    Y[b, q, i] = Σ_j softmax_j(Q[b, q, i] · K[b, q // G, j] · scale + mask[b, q, i, j])
                 · V[b, q // G, j]

where the Hq query heads come in Hkv groups of G = Hq / Hkv, each group sharing one key and
value head (grouped-query attention; G = 1 is multi-head attention). The loops:

    d0: parallel(B)     batch
    d1: parallel(H)     head groups: H = Hkv (H = Hq when Hkv = 1, multi-query)
    d2: invalid(G)      query heads inside a group (indexed by no tensor)
    d3: parallel(Sq)    query positions (invalid where no local mask places them: below)
    d4: invalid(T)      key positions, past and new (softmax reads them whole)
    d5: invalid(D)      the head size (contracted inside the softmax)

The query's head dim (Hq) and the key's and value's (Hkv) follow the group loop d1, like a
grouped Conv's channels (rules/nn.py): splitting d1 n ways (n | Hkv) gives each device Hq / n
contiguous query heads and exactly the Hkv / n key and value heads they read. A head split
finer than the key and value heads would need one key head on several devices while its
query heads are not a block of the device's own: it is not expressible, so a mesh with more
tensor-parallel devices than key-value heads splits the heads over fewer axes (the others
split the batch or the query). With one key-value head (multi-query) the key and value are
read whole and the query heads split alone.

The mask broadcasts onto (B, Hq, Sq, T) and splits with the dims it indexes; its key dim is
read whole (it may be shorter than T: the op pads it). A split of the query positions is exact
for a mask given as a tensor. A causal Attention (`is_causal`) places query i at key i + P (P
past keys), so a device holding queries [lo, hi) gets its causal mask written out, offset by
lo (note "local_heads", passes/local_rewrites.py), unless its mask is shorter than the keys.
A sliding window, opset 24's per-row `nonpad_kv_seqlen` of a causal op, GroupQueryAttention's
positions from `seqlens_k` (its keys come with its queries) and MultiHeadAttention's
`unidirectional` have no such rewrite: their query loop is invalid. Key positions are never
split alone (that needs the softmax statistics of every shard); ring attention splits them
with the queries over the same axes (`OpRule.ring`: self-attention with no mask tensor and no
cache), the key and value blocks passed around those axes (`cost/ring.py`). Past key and
value, and the present ones (past and new concatenated), follow the batch and head loops.

In the 3-D layout ([B, S, heads · head size], heads given by attributes) the hidden dim follows
the head loop, and the note "local_heads" tells the partitioner to count the heads a device
holds in the attributes. The loops price the op: on a device with flash kernels as one over
its local loops (`cost/attention.py`), else B·Hq·Sq·T·D iterations of two multiply-adds each
(Q·K and P·V, `cost/compute.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

from autoshard.ir.graph import Graph, Op
from autoshard.rules.base import IndexingMap, Loop, Note, OpRule, invalid
from autoshard.rules.registry import register

MICROSOFT = "com.microsoft"


def _shape(graph: Graph, op: Op, index: int) -> tuple[int, ...] | None:
    if index >= len(op.inputs) or not op.inputs[index]:
        return None
    return graph.values[op.inputs[index]].shape


def _int(op: Op, name: str, default: int = 0) -> int:
    value = op.attr(name, default)
    return value if isinstance(value, int) else default


def _heads(op: Op, name: str, rank: int, shape: Sequence[int]) -> int | None:
    """The heads of a tensor: its dim 1 in the 4-D layout, the attribute `name` in the 3-D."""
    if rank == 4:
        return shape[1]
    heads = _int(op, name)
    return heads if heads > 0 and shape[2] % heads == 0 else None


class _Loops:
    """Loop indices of an attention op (the module's docstring)."""

    BATCH, HEAD, GROUP, QUERY, KEY, SIZE = range(6)


def _attention_loops(
    batch: int, q_heads: int, kv_heads: int, query: int, keys: int, size: int, by_position: bool
) -> tuple[tuple[Loop, ...], bool] | None:
    """The six loops, and whether the key and value heads follow the head loop (False for one
    key-value head: they are then read whole). None when Hkv does not divide Hq."""
    if kv_heads < 1 or q_heads % kv_heads:
        return None
    shared = kv_heads == 1 and q_heads > 1
    groups = q_heads if shared else kv_heads
    loops = (
        Loop(batch),
        Loop(groups),
        invalid(q_heads // groups),
        invalid(query) if by_position else Loop(query),
        invalid(keys),
        invalid(size),
    )
    return loops, not shared


def _head_map(rank: int, sequence: int | None, heads: int | None) -> IndexingMap:
    """A Q / K / V / Y map: [B, H, S, D] or [B, S, H·D], with the loops of S and H."""
    if rank == 4:
        return IndexingMap.of(_Loops.BATCH, heads, sequence, None)
    return IndexingMap.of(_Loops.BATCH, sequence, heads)


def _cache_map(heads: int | None) -> IndexingMap:
    """Past and present key / value: [B, Hkv, positions, D]; positions are read whole."""
    return IndexingMap.of(_Loops.BATCH, heads, None, None)


def _bias_map(
    shape: Sequence[int] | None, full: Sequence[int], query: int | None
) -> IndexingMap | None:
    """A mask or bias broadcast onto [B, Hq, Sq, T] (right-aligned, size-1 dims broadcast):
    batch, head and query dims follow their loops, the key dim is read whole. None when a dim
    neither matches nor broadcasts."""
    if shape is None or len(shape) > 4:
        return None
    loops = (_Loops.BATCH, _Loops.HEAD, query, None)
    dims: list[int | None] = []
    for k, size in enumerate(shape):
        at = 4 - len(shape) + k
        if at < 3 and size not in (1, full[at]):
            return None
        dims.append(None if size == 1 or at == 3 else loops[at])
    return IndexingMap.of(*dims)


@register("Attention")
def attention(op: Op, graph: Graph) -> OpRule | None:
    """ONNX Attention (opset 23): Q, K, V, attn_mask, past_key, past_value (and opset 24's
    nonpad_kv_seqlen) -> Y, present_key, present_value, qk_matmul_output."""
    q, k, v = (_shape(graph, op, i) for i in range(3))
    if q is None or k is None or v is None or not len(q) == len(k) == len(v) in (3, 4):
        return None
    rank = len(q)
    q_heads, kv_heads = _heads(op, "q_num_heads", rank, q), _heads(op, "kv_num_heads", rank, k)
    if q_heads is None or kv_heads is None:
        return None
    past = _shape(graph, op, 4)
    keys = k[1 if rank == 3 else 2] + (past[2] if past is not None else 0)
    size = q[3] if rank == 4 else q[2] // q_heads
    causal = bool(_int(op, "is_causal"))
    windowed = _int(op, "left_window_size", -1) >= 0 or _int(op, "right_window_size", -1) >= 0
    # The causal rewrite writes the mask out over every key; opset 24's nonpad_kv_seqlen
    # places a causal op's queries per batch row, which it does not rewrite.
    mask_shape = _shape(graph, op, 3)
    short = mask_shape is not None and mask_shape[-1] != keys
    by_position = windowed or (causal and (short or _shape(graph, op, 6) is not None))
    query_size = q[2] if rank == 4 else q[1]
    found = _attention_loops(q[0], q_heads, kv_heads, query_size, keys, size, by_position)
    if found is None:
        return None
    loops, kv_split = found
    query = None if by_position else _Loops.QUERY
    kv = _Loops.HEAD if kv_split else None
    mask = _bias_map(mask_shape, (q[0], q_heads, loops[3].size, keys), query)
    if mask is None and mask_shape is not None:
        return None
    # Ring attention (keys split with the queries, passed around: `rules.base.ring_loops`) for
    # self-attention over its own keys alone: no mask tensor, no cache in or out.
    ring = (
        query is not None and mask_shape is None and past is None and keys == query_size
        and not any(op.outputs[1:3])
    )  # fmt: skip
    key = _Loops.KEY if ring else None
    operands: list[IndexingMap | None] = [_head_map(rank, query, _Loops.HEAD)]
    operands += [
        _head_map(rank, key, kv),
        _head_map(rank, key, kv),
        mask,
        _cache_map(kv),
        _cache_map(kv),
    ]
    operands += [IndexingMap.of(_Loops.BATCH)]  # nonpad_kv_seqlen [B]
    results = (
        _head_map(rank, query, _Loops.HEAD),
        _cache_map(kv),
        _cache_map(kv),
        IndexingMap.of(_Loops.BATCH, _Loops.HEAD, query, None),
    )
    note = Note.LOCAL_HEADS if rank == 3 or causal else Note.NONE
    rings = ((_Loops.QUERY, _Loops.KEY),) if ring else ()
    return OpRule(loops, tuple(operands[: len(op.inputs)]), results[: len(op.outputs)], note, rings)


@register("GroupQueryAttention", domain=MICROSOFT)
def group_query_attention(op: Op, graph: Graph) -> OpRule | None:
    """onnxruntime's GroupQueryAttention: query [B, S, Hq·D], key and value [B, S, Hkv·D] (or
    absent: QKV packed in the query, whose heads then stay whole), past and present caches,
    seqlens_k [B]. Always causal from `seqlens_k`: the query positions are not split."""
    q = _shape(graph, op, 0)
    q_heads, kv_heads = _int(op, "num_heads"), _int(op, "kv_num_heads")
    if q is None or len(q) != 3 or q_heads < 1 or kv_heads < 1:
        return None
    if any(_shape(graph, op, i) is not None for i in (12, 13, 16)):
        return None  # quantized caches (k_scale, v_scale), packed queries (query_seqlens)
    packed = _shape(graph, op, 1) is None
    size = q[2] // (q_heads + 2 * kv_heads) if packed else q[2] // q_heads
    past = _shape(graph, op, 3)
    keys = (past[2] if past is not None else 0) + q[1]
    found = _attention_loops(q[0], q_heads, kv_heads, q[1], keys, size, True)
    if found is None:
        return None
    loops, kv_split = found
    if packed:  # [Q | K | V] heads side by side: no block of the dim is a block of heads
        loops = (loops[0], invalid(loops[1].size), *loops[2:])
    kv = _Loops.HEAD if kv_split else None
    token = _head_map(3, None, _Loops.HEAD)
    bias = _bias_map(_shape(graph, op, 10), (q[0], q_heads, q[1], keys), None)
    operands: list[IndexingMap | None] = [
        token, _head_map(3, None, kv), _head_map(3, None, kv), _cache_map(kv), _cache_map(kv),
        IndexingMap.of(_Loops.BATCH), None, None, None, IndexingMap.of(_Loops.BATCH, None),
        bias, IndexingMap.of(_Loops.HEAD), None, None, None, None,
    ]  # fmt: skip
    results = (token, _cache_map(kv), _cache_map(kv), _cache_map(_Loops.HEAD))
    return OpRule(
        loops, tuple(operands[: len(op.inputs)]), results[: len(op.outputs)], Note.LOCAL_HEADS
    )


@register("MultiHeadAttention", domain=MICROSOFT)
def multi_head_attention(op: Op, graph: Graph) -> OpRule | None:
    """onnxruntime's MultiHeadAttention: query [B, S, N·D]; key and value [B, L, N·D] or
    [B, N, L, D] (cross attention's cache); key_padding_mask [B] or [B, T]; attention_bias;
    past and present caches. Packed QKV / KV layouts, beam search's cache_indirection and
    past_sequence_length get None; a bias (Q, K and V biases concatenated) keeps heads whole."""
    q, k = _shape(graph, op, 0), _shape(graph, op, 1)
    heads = _int(op, "num_heads")
    if q is None or len(q) != 3 or k is None or len(k) not in (3, 4) or heads < 1:
        return None
    if any(_shape(graph, op, i) is not None for i in (8, 9)) or q[2] % heads:
        return None
    past = _shape(graph, op, 6)
    keys = (past[2] if past is not None else 0) + (k[1] if len(k) == 3 else k[2])
    causal = bool(_int(op, "unidirectional"))
    found = _attention_loops(q[0], heads, heads, q[1], keys, q[2] // heads, causal)
    if found is None:
        return None
    loops, _ = found
    if _shape(graph, op, 3) is not None:
        loops = (loops[0], invalid(loops[1].size), *loops[2:])
    query = None if causal else _Loops.QUERY
    padding = _shape(graph, op, 4)
    if padding is not None and len(padding) not in (1, 2):
        return None
    bias = _bias_map(_shape(graph, op, 5), (q[0], heads, q[1], keys), query)
    if bias is None and _shape(graph, op, 5) is not None:
        return None
    token = _head_map(3, query, _Loops.HEAD)
    kv = _head_map(len(k), None, _Loops.HEAD)
    pad = IndexingMap.of(_Loops.BATCH, *((None,) if padding and len(padding) == 2 else ()))
    operands = (token, kv, kv, None, pad, bias, _cache_map(_Loops.HEAD), _cache_map(_Loops.HEAD))
    results = (
        token,
        _cache_map(_Loops.HEAD),
        _cache_map(_Loops.HEAD),
        IndexingMap.of(_Loops.BATCH, _Loops.HEAD, query, None),
    )
    return OpRule(loops, operands[: len(op.inputs)], results[: len(op.outputs)], Note.LOCAL_HEADS)


# ---- rotary embeddings ------------------------------------------------------------------------


def _rotary(op: Op, x: Sequence[int], offset: bool) -> tuple[OpRule, IndexingMap] | None:
    """Loops b, h, s over X ([B, H, S, D] or [B, S, H·D]) and its head size, invalid; the
    rule of X alone, and the map of position ids [B, S] (absolute: a split needs no offset).
    With an `offset` (positions counted from one scalar) the sequence is read whole."""
    rank = len(x)
    if rank not in (3, 4):
        return None
    heads = x[1] if rank == 4 else _heads(op, "num_heads", 3, x) if _int(op, "num_heads") else 0
    if heads is None:
        return None
    seq = x[2] if rank == 4 else x[1]
    size = x[3] if rank == 4 else x[2] // (heads or 1)
    loops = (
        Loop(x[0]),
        Loop(heads) if heads else invalid(1),
        invalid(seq) if offset else Loop(seq),
        invalid(size),
    )
    data = IndexingMap.of(0, 1, 2, 3) if rank == 4 else IndexingMap.of(0, 2, 1 if heads else None)
    note = Note.LOCAL_HEADS if rank == 3 and heads else Note.NONE
    return OpRule(loops, (data,), (data,), note), IndexingMap.of(0, None if offset else 2)


@register("RotaryEmbedding")
def rotary_embedding(op: Op, graph: Graph) -> OpRule | None:
    """ONNX RotaryEmbedding (opset 23): X, cos_cache, sin_cache, position_ids. With position
    ids the caches ([max positions, D/2]) are read whole; without, they are [B, S, D/2] and
    follow b and s."""
    x, cache, positions = (_shape(graph, op, i) for i in (0, 1, 3))
    if x is None or cache is None:
        return None
    found = _rotary(op, x, False)
    if found is None:
        return None
    rule, ids = found
    if positions is not None:
        if tuple(positions) != (x[0], rule.loops[2].size):
            return None
        table = IndexingMap.of(None, None)
    elif tuple(cache[:2]) == (x[0], rule.loops[2].size) and len(cache) == 3:
        table = IndexingMap.of(0, 2, None)
    else:
        return None
    operands = (*rule.operands, table, table, ids)[: len(op.inputs)]
    return OpRule(rule.loops, operands, rule.results, rule.note)


@register("RotaryEmbedding", domain=MICROSOFT)
def microsoft_rotary_embedding(op: Op, graph: Graph) -> OpRule | None:
    """onnxruntime's RotaryEmbedding: input, position_ids ([B, S], or [1]: an offset), cos_cache,
    sin_cache ([max positions, D/2], read whole). Packed batching gets None."""
    x, positions = _shape(graph, op, 0), _shape(graph, op, 1)
    if x is None or positions is None or _int(op, "is_packed_batching"):
        return None
    offset = len(positions) != 2
    found = _rotary(op, x, offset)
    if found is None:
        return None
    rule, ids = found
    if not offset and tuple(positions) != (x[0], rule.loops[2].size):
        return None
    table = IndexingMap.of(None, None)
    operands = (*rule.operands, None if offset else ids, table, table)
    return OpRule(rule.loops, operands, rule.results, rule.note)


# ---- onnxruntime's packed-weight ops ------------------------------------------------------------


def _batch_leading(shape: Sequence[int] | None, batch: int) -> IndexingMap | None:
    """A tensor whose dim 0 is the batch (a mask [B, ...], a bias [B or 1, ...]): dim 0 follows
    the batch loop, the rest is read whole. None when dim 0 is something else."""
    if shape is None or not shape or shape[0] not in (1, batch):
        return None
    return IndexingMap.of(None if shape[0] == 1 and batch > 1 else 0, *(None for _ in shape[1:]))


@register("Attention", domain=MICROSOFT)
def packed_attention(op: Op, graph: Graph) -> OpRule | None:
    """onnxruntime's Attention: the input [B, S, hidden] projected by packed weights
    [hidden, Q | K | V] (+ bias) into heads, attended, with mask_index, past [2, B, N, P, H]
    and attention_bias. Only the batch splits: the packed columns are no block of heads, and
    the keys come from the same input as the queries, so the sequence is read whole."""
    x, weights = _shape(graph, op, 0), _shape(graph, op, 1)
    heads = _int(op, "num_heads")
    if x is None or weights is None or len(x) != 3 or len(weights) != 2 or heads < 1:
        return None
    if any(_shape(graph, op, i) is not None for i in (6,)):  # past_sequence_length
        return None
    past = _shape(graph, op, 4)
    keys = x[1] + (past[3] if past is not None and len(past) == 5 else 0)
    size = weights[1] // (3 * heads)
    loops = (Loop(x[0]), invalid(heads), invalid(1), invalid(x[1]), invalid(keys), invalid(size))
    mask = _batch_leading(_shape(graph, op, 3), x[0])
    if _shape(graph, op, 3) is not None and (mask is None or _shape(graph, op, 3) == (2 * x[0],)):
        return None  # [2B]: end and start positions of each batch row, not [B]
    cache = IndexingMap.of(None, _Loops.BATCH, None, None, None)
    token = IndexingMap.of(_Loops.BATCH, None, None)
    bias = _batch_leading(_shape(graph, op, 5), x[0])
    operands = (token, IndexingMap.of(None, None), IndexingMap.of(None), mask, cache, bias)
    return OpRule(loops, operands[: len(op.inputs)], (token, cache)[: len(op.outputs)])


@register("EmbedLayerNormalization", domain=MICROSOFT)
def embed_layer_norm(op: Op, graph: Graph) -> OpRule | None:
    """onnxruntime's BERT embedding: word, position and segment lookups summed and normalized.
    Only the batch splits: positions default to the token's index in the sequence, and the
    tables and the hidden dim are read whole. Results: output [B, S, H], mask_index [B],
    embedding_sum [B, S, H]."""
    ids = _shape(graph, op, 0)
    if ids is None or len(ids) != 2:
        return None
    hidden = graph.values[op.outputs[0]].shape[-1]
    loops = (Loop(ids[0]), invalid(ids[1]), invalid(hidden))
    tokens = IndexingMap.of(0, None)
    table = IndexingMap.of(None, None)
    vector = IndexingMap.of(None)
    positions = _shape(graph, op, 8)
    position_map = _batch_leading(positions, ids[0]) if positions is not None else None
    operands = (tokens, tokens, table, table, table, vector, vector, tokens, position_map)
    results = (IndexingMap.of(0, None, None), IndexingMap.of(0), IndexingMap.of(0, None, None))
    return OpRule(loops, operands[: len(op.inputs)], results[: len(op.outputs)])
