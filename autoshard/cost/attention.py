"""Fused (flash) attention kernels: what one device spends on one over its local shard
(`attention_cost`), for a fused region of decomposed attention (`fused_cost`, `ir.fused`) and
for an attention op engines run as one kernel (`attention_op_cost`)."""

from __future__ import annotations

import math

from autoshard.cost.cluster import Cluster
from autoshard.cost.devices import DeviceKind
from autoshard.cost.kernel import OpCost, local_loops, local_shape
from autoshard.cost.ring import balanced_pairs, exposed_sends, is_backward, step_overhead
from autoshard.ir import dtypes
from autoshard.ir.fused import Kernel
from autoshard.ir.graph import Graph, Op
from autoshard.rules import OpRule
from autoshard.rules.base import ring_loops
from autoshard.rules.gradient import TRAIN, TrainOp
from autoshard.sharding import ShardingOption


def attention_flops(
    batch: int,
    heads: int,
    s_q: int,
    s_kv: int,
    head_dim: int,
    causal: bool,
    backward: bool,
    pairs: int | None = None,
) -> int:
    """FLOPs of a fused attention kernel (`attention_cost`): its matmuls over the pairs of
    query and key rows it computes, the causal triangle's alone when causal (or `pairs`, when
    its rows are not the last s_q: a load-balanced split, `cost.ring.balanced_pairs`)."""
    if pairs is None:
        pairs = s_q * s_kv
        if causal:
            pairs = s_q * max(0, s_kv - s_q) + min(s_q, s_kv) * (min(s_q, s_kv) + 1) // 2
    return (5 if backward else 2) * 2 * batch * heads * pairs * head_dim


def attention_cost(
    batch: int,
    heads: int,
    kv_heads: int,
    s_q: int,
    s_kv: int,
    head_dim: int,
    causal: bool,
    dtype: str,
    device: DeviceKind,
    backward: bool = False,
    pairs: int | None = None,
) -> OpCost:
    """What one device spends on a fused (flash) attention kernel over its local shard:
    `batch` x `heads` query heads of `s_q` rows, `kv_heads` key/value heads of `s_kv` rows,
    all of `head_dim` features, in `dtype`.

        pairs   = s_q · s_kv, or when causal the pairs on and below the diagonal (query row
                  i sees the first s_kv - s_q + i + 1 keys): s_q·(s_kv - s_q) + s_q·(s_q+1)/2
        FLOPs   = 2 matmuls (Q·Kᵀ, P·V) · 2 · batch · heads · pairs · head_dim forward; 5
                  (Q·Kᵀ again, dV, dP, dQ, dK) backward
        bytes   = Q, K, V read and O written, plus the softmax's row statistics (float32, one
                  per query row) forward; Q, K, V, O, dO and the statistics read and dQ, dK, dV
                  written backward: never an s_q x s_kv tensor
        time    = max(FLOPs / (peak(dtype) · attention efficiency), bytes / (HBM bandwidth ·
                  memory efficiency)) + launch

    The efficiencies are the fraction of peak measured flash-attention kernels reach
    (`DeviceKind.attention_efficiency`, `attention_backward_efficiency`; a device without
    them runs it at its matmul efficiency)."""
    flops = attention_flops(batch, heads, s_q, s_kv, head_dim, causal, backward, pairs)
    q = batch * heads * s_q * head_dim
    kv = batch * kv_heads * s_kv * head_dim
    statistics = dtypes.nbytes("float32", batch * heads * s_q)
    moved = dtypes.nbytes(dtype, 4 * q + 4 * kv if backward else 2 * q + 2 * kv) + statistics
    efficiency = device.attention_backward_efficiency if backward else device.attention_efficiency
    efficiency = efficiency or device.matmul_efficiency  # a device with no flash kernel
    seconds = max(
        flops / (device.peak(dtype) * efficiency),
        moved / (device.hbm_bandwidth * device.memory_efficiency),
    )
    return OpCost(flops, moved, seconds + device.launch_s)


def fused_cost(
    op: Op,
    kernel: Kernel,
    rule: OpRule | None,
    option: ShardingOption | None,
    graph: Graph,
    cluster: Cluster,
) -> OpCost:
    """An op of a fused attention region: the region's forward or backward kernel
    (`attention_cost`) over the local shard of the scores the op computes (its first result,
    [..., heads, s_q, s_kv], cut as its option cuts it), or nothing for the ops inside."""
    if kernel is Kernel.INSIDE:
        if rule is not None and option is not None and ring_loops(option):
            return _ring_matmul(op, rule, option, graph, cluster)
        return OpCost(0, 0, 0.0)
    region = graph.fused.region(op.name)
    value = graph.values[op.outputs[0]]
    local = list(value.shape)
    if rule is not None and option is not None:
        local = local_shape(value.shape, rule.results[0], option, cluster.mesh)
    heads = local[-3]
    kv_heads = max(1, heads * region.kv_heads // region.heads)
    batch, backward = math.prod(local[:-3]), kernel is Kernel.BACKWARD
    balanced = option is not None and bool(ring_loops(option))
    pairs = balanced_pairs(value.shape[-1], value.shape[-1] // local[-2]) if balanced else None
    cost = attention_cost(
        batch, heads, kv_heads, local[-2], local[-1], region.head_dim, region.causal,
        value.dtype, cluster.device, backward=backward, pairs=pairs,
    )  # fmt: skip
    return cost


def _ring_matmul(
    op: Op, rule: OpRule, option: ShardingOption, graph: Graph, cluster: Cluster
) -> OpCost:
    """A MatMul of a fused core (or its gradient) computed as ring attention: inside the
    region's kernel, it costs what its passed blocks expose beyond the kernel's step over one
    full block (`cost.ring`). Its loops are (batch..., heads, queries, n, k)."""
    region = graph.fused.region(op.name)
    loops = local_loops(rule, option, cluster.mesh)
    heads, block = loops[-4], loops[-3]
    dtype = graph.values[graph.op_by_name[region.ops[0]].outputs[0]].dtype
    step = attention_cost(
        math.prod(loops[:-4]), heads, max(1, heads * region.kv_heads // region.heads), block,
        block, region.head_dim, False, dtype, cluster.device, backward=is_backward(op),
        pairs=block * block // 2 if region.causal else None,
    )  # fmt: skip
    # The op passing K (the scores', or the gradient reading them) runs the kernel's steps.
    runs = graph.op_by_name[region.ops[0]].inputs[1] in op.inputs
    rows = math.prod(loops[:-4]) * heads * block * region.head_dim
    overhead = step_overhead(rows, cluster.device) if runs else 0.0
    return exposed_sends(op, rule, option, graph, cluster, step.seconds, overhead=overhead)


ATTENTION_OPS = frozenset({("", "Attention"), ("com.microsoft", "GroupQueryAttention"),
                           ("com.microsoft", "MultiHeadAttention")})  # fmt: skip
"""Attention ops an engine runs as one fused (flash) kernel (rules/attention.py's loops)."""


def attention_kernel(op: Op, graph: Graph) -> tuple[Op, Kernel] | None:
    """The attention op (`ATTENTION_OPS`) whose kernel `op` runs, and which kernel: the op
    itself (or its recomputation) the forward; the gradient of its query the backward, which
    computes dQ, dK and dV at once; its other gradients, inside that one. None for any other
    op."""
    forward, kernel = op, Kernel.FORWARD
    if op.domain == TRAIN and op.type == TrainOp.GRAD:
        forward = graph.op_by_name[str(op.attr("op"))]
        kernel = Kernel.BACKWARD if op.attr("operand", 0) == 0 else Kernel.INSIDE
    return (forward, kernel) if (forward.domain, forward.type) in ATTENTION_OPS else None


def attention_op_cost(
    op: Op,
    kernel: Kernel,
    rule: OpRule,
    option: ShardingOption | None,
    graph: Graph,
    cluster: Cluster,
) -> OpCost:
    """Attention op `op`'s `kernel` on a device with flash kernels: `attention_cost` over
    the local loops of `rule` (the op's, or its gradient's: batch, head groups, heads per
    group, queries, keys, head size), its key and value heads those of the group loop when
    its key follows it, else one (multi-query); causal when the op masks causally
    (GroupQueryAttention always does); nothing for a kernel inside another. A causal split
    of the queries is priced as its last shard, which sees the most keys; a ring option (its
    keys split with its queries) as the kernel over every key plus what its sends expose
    (`cost.ring`)."""
    device, mesh = cluster.device, cluster.mesh
    if kernel is Kernel.INSIDE:
        return OpCost(0, 0, 0.0)
    loops = local_loops(rule, option, mesh) if option else [loop.size for loop in rule.loops]
    batch, groups, per_group, s_q, s_kv, head_dim = loops
    ring = bool(option and ring_loops(option))
    pairs = None
    if ring:  # the keys pass around the axes: the kernel sees them all, a block at a time
        s_kv = rule.loops[4].size
        pairs = balanced_pairs(s_kv, s_kv // s_q) if _causal(op) else None
    key = rule.operands[1] if len(op.inputs) > 1 and op.inputs[1] else None
    follows = key is not None and any(1 in key.loops(d) for d in range(len(key.dims)))
    named = op.attr("kv_num_heads", 1)
    packed = named if key is None and isinstance(named, int) else 1  # QKV packed in the query
    causal = _causal(op)
    heads, kv_heads = groups * per_group, groups if follows else packed
    dtype, backward = graph.values[op.inputs[0]].dtype, kernel is Kernel.BACKWARD
    cost = attention_cost(batch, heads, kv_heads, s_q, s_kv, head_dim, causal, dtype, device,
                          backward=backward, pairs=pairs)  # fmt: skip
    if not ring or option is None:
        return cost
    step = attention_cost(batch, heads, kv_heads, s_q, s_q, head_dim, False, dtype, device,
                          backward=backward, pairs=s_q * s_q // 2 if causal else None)  # fmt: skip
    # The backward kernel passes dK and dV with K and V: two more blocks of their size.
    overhead = step_overhead(batch * heads * s_q * head_dim, device)
    sends = exposed_sends(op, rule, option, graph, cluster, step.seconds, 2 if backward else 0,
                          overhead=overhead)  # fmt: skip
    return OpCost(cost.flops, cost.bytes, cost.seconds + sends.seconds)


def _causal(op: Op) -> bool:
    causal = bool(op.attr("is_causal", 0) or op.attr("unidirectional", 0))
    return causal or op.type == "GroupQueryAttention"
