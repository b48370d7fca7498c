"""Ring attention (Liu, Zaharia and Abbeel 2023, arXiv:2310.01889): an attention kernel's query
rows and its keys split together over some mesh axes (`rules.base.ring_loops`), each device
keeping its block of queries while the key and value blocks pass around the axes, one
neighbour to the next, and the blockwise kernel runs over the block it holds while the next
one arrives. The backward passes K and V again and dK and dV with them, summed as they go.

With p devices on the axes, each kernel runs p steps: its own block, then p - 1 steps in which
it computes over the block it holds while sending it on (`ring_permute`, a permute of one
block per device along the ring). A step takes the longer of its compute and its sends; the
first step has nothing to wait for. The kernel's compute over all its blocks is priced as the
kernel is (`cost.attention`), so the ring adds what its sends expose and what its steps cost:

    added = Σ over the blocks passed  (p - 1) · max(0, send(block) - step / n)
            + (p - 1) · (launch + the running output read and written, float32)

where step is the kernel over one block (s/p queries by s/p keys; half of them under a
causal mask: load-balanced, every step's block is half masked) and n the blocks passed per
step: 2 forward (K, V), 4 backward (K, V, dK, dV). The blocks of one step go out together, so
each has its share of the step to hide in (for equal blocks this is max(0, n · send - step),
the step's own max); a send takes `send_time` on the axes' links (a permute: one exchange at
the slowest axis's latency and bandwidth). The blocks are those the program passes (a
decomposed core's K and V as it reads them: after GQA's repeat, where the graph repeats).

Assumptions: the kernel and the sends overlap perfectly (the sends on their own stream, the
kernel not slowed by them); each device holds its own K and V blocks and receives the next
into a second pair (the receive buffer, a kernel workspace, not counted with the program's
tensors). A causal kernel split over the ring runs load-balanced (`balanced_pairs`: each
device the two opposite chunks i and 2p-1-i of the rows), its tokens in that order from the
data loader as Megatron-LM's and Llama 3's context parallelism feed them (every op but the
attention is per token, and the loss a sum), so no relayout is priced; the partitioned
program computes the same numbers over contiguous rows.
"""

from __future__ import annotations

import math

from autoshard.collectives import Collective, CollectiveKind, ring_steps
from autoshard.cost.cluster import Cluster
from autoshard.cost.devices import DeviceKind
from autoshard.cost.kernel import OpCost, local_shape
from autoshard.ir import dtypes
from autoshard.ir.graph import Graph, Op
from autoshard.mesh import Mesh
from autoshard.rules import OpRule
from autoshard.rules.base import ring_loops
from autoshard.rules.gradient import TRAIN, TrainOp
from autoshard.sharding import Sharding, ShardingOption


def send_time(sent: int, mesh_axes: tuple[int, ...], cluster: Cluster) -> float:
    """Seconds a point-to-point send of `sent` bytes per device takes between neighbours over
    `mesh_axes` (a permute, a ring attention block, a pipeline stage's boundary): one exchange
    at the link's latency and bandwidth."""
    if sent == 0:
        return 0.0
    bandwidth, latency = cluster.link(mesh_axes)
    return ring_steps(CollectiveKind.PERMUTE, 2) * latency + sent / bandwidth


def ring_permute(
    mesh_axes: tuple[int, ...], mesh: Mesh, shape: tuple[int, ...], sharding: Sharding, sent: int
) -> Collective:
    """One step of the ring over `mesh_axes`: every device sends the block it holds (of a
    tensor of global `shape`, split as `sharding`: `sent` bytes) to the next device of its
    group, in the order the groups number their shards, the last to the first."""
    pairs = []
    for group in mesh.device_groups(mesh_axes):
        for rank, device in enumerate(group):
            after = group[(rank + 1) % len(group)]
            pairs.append((mesh.linear_index(device), mesh.linear_index(after)))
    return Collective(
        CollectiveKind.PERMUTE, tuple(mesh_axes), sharding, sharding, tuple(shape), sent,
        pairs=tuple(sorted(pairs)),
    )  # fmt: skip


def passed(rule: OpRule, option: ShardingOption) -> list[int]:
    """The tensors a ring option passes around (`rules.base.ring_loops`): the operands and
    results indexed by a ring loop and not its home loop, by index among the operands then
    the results."""
    maps = [*rule.operands, *rule.results]
    found = []
    for home, ring in ring_loops(option):
        for index, indexing in enumerate(maps):
            if indexing is None:
                continue
            loops = {loop for dim in range(len(indexing.dims)) for loop in indexing.loops(dim)}
            if ring in loops and home not in loops:
                found.append(index)
    return found


def is_backward(op: Op) -> bool:
    """Whether `op` runs in a kernel's backward (a gradient op): its ring passes K, V, dK, dV."""
    return op.domain == TRAIN and op.type == TrainOp.GRAD


def balanced_pairs(s: int, p: int) -> int:
    """The query-key pairs each of `p` devices computes of a causal kernel over `s` rows split
    load-balanced: the rows in 2p chunks of c = s/2p, device i holding chunks i and 2p-1-i.
    Chunk q sees q whole chunks and its own triangle, so device i computes (i + 2p-1-i)·c² +
    2·c(c+1)/2 = 2p·c² + c pairs, the same on every device: s(s+1)/2p, the triangle's 1/p.
    A contiguous split's last block computes (2p-1)/p² of it, about twice as much."""
    return s * (s + 1) // (2 * p)


def step_overhead(rows: int, device: DeviceKind) -> float:
    """Seconds each ring step adds beyond its share of the kernel: a kernel launched per
    block, and the running output (float32, `rows` query rows by the head size, forward; dQ
    backward) read and written to fold the block's result in by its log-sum-exp."""
    moved = 2 * dtypes.nbytes("float32", rows)
    return device.launch_s + moved / (device.hbm_bandwidth * device.memory_efficiency)


def exposed_sends(
    op: Op,
    rule: OpRule,
    option: ShardingOption,
    graph: Graph,
    cluster: Cluster,
    step_s: float,
    extra: int = 0,
    overhead: float = 0.0,
) -> OpCost:
    """What the ring sends of op `op` computed with ring option `option` expose beyond a kernel
    step of `step_s` seconds (the module's docstring): each tensor it passes, and `extra`
    more blocks the size of the first (a fused op's gradients passed with its backward
    kernel), each (p - 1) times; plus `overhead` a step (`step_overhead`) for the op that
    runs the kernel's steps."""
    inputs = [*op.inputs, *("",) * len(rule.operands)][: len(rule.operands)]
    values = [*inputs, *op.outputs]
    maps = [*rule.operands, *rule.results]
    share = step_s / (4 if is_backward(op) else 2)
    seconds, blocks = 0.0, []
    for index in passed(rule, option):
        name, indexing = values[index] if index < len(values) else "", maps[index]
        if not name or indexing is None:
            continue
        value = graph.values[name]
        local = local_shape(value.shape, indexing, option, cluster.mesh)
        blocks.append(dtypes.nbytes(value.dtype, math.prod(local)))
    blocks += blocks[:1] * extra
    axes = option.loops[ring_loops(option)[0][0]]
    p = cluster.mesh.group_size(axes)
    for sent in blocks:
        seconds += (p - 1) * max(0.0, send_time(sent, axes, cluster) - share)
    return OpCost(0, 0, seconds + (p - 1) * overhead)
