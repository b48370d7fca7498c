"""What a plan's recomputation (`training.replay`) frees and costs: the bytes per device of
the forward values the backward reads recomputed (what keeping them would hold from their
forward to their backward) and the compute seconds of the recomputed ops beside the rest of
the step; and the story's sentence saying so. Before any search (`--recompute auto` ordering
and pruning its candidates): the recomputed ops' seconds unsharded, and the least memory any
plan of a step can hold (`memory_floor`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.cost.attention import attention_kernel
from autoshard.cost.cluster import Cluster
from autoshard.cost.compute import op_cost
from autoshard.cost.liveness import held_bytes
from autoshard.cost.price import Cost
from autoshard.ir import dtypes
from autoshard.ir.fused import Held
from autoshard.ir.graph import Graph
from autoshard.plan import Plan
from autoshard.rules.gradient import RECOMPUTE_OF, TrainOp
from autoshard.rules.registry import rule_for
from autoshard.sharding import ShardingOption
from autoshard.training.options import Recompute, Training
from autoshard.training.replay import replays
from autoshard.units import format_bytes


@dataclass(frozen=True)
class ReplayFigures:
    """What a plan's recomputation frees and costs per device: `freed_bytes` of forward
    values not kept for the backward, `added_s` compute seconds of the recomputed ops, over
    `base_s`, the compute seconds of the rest of the step."""

    freed_bytes: int
    added_s: float
    base_s: float

    @property
    def added_share(self) -> float:
        return self.added_s / self.base_s if self.base_s else 0.0


def replay_figures(graph: Graph, plan: Plan, cost: Cost) -> ReplayFigures:
    """The recomputation of training step `graph` priced under `plan` (module docstring): a
    recomputed value counts where a gradient op reads it, at the bytes its forward original
    is held in."""
    ops = graph.op_by_name
    recomputed = {
        new: original
        for op in graph.ops
        if op.attr(RECOMPUTE_OF, "")
        for new, original in zip(op.outputs, ops[str(op.attr(RECOMPUTE_OF))].outputs, strict=True)
        if new
    }
    read = {n for op in graph.ops if op.type == TrainOp.GRAD for n in op.inputs if n}
    freed = 0
    for new in sorted(read.intersection(recomputed)):
        value = graph.values[recomputed[new]]
        sharding = plan.values[value.name]
        freed += held_bytes(value.name, value.shape, value.dtype, sharding, plan.mesh, graph.fused)
    added = sum(c.seconds for name, c in cost.ops.items() if ops[name].attr(RECOMPUTE_OF, ""))
    return ReplayFigures(freed, added, cost.compute_time_s - added)


def replay_text(training: Training, figures: ReplayFigures, chosen: bool) -> str:
    """The story's sentence on recomputation: what was asked, or `chosen` by the search
    (`search.recompute` says why), and its figures."""
    what = {
        Recompute.SELECTIVE: "selective recompute (each attention core)",
        Recompute.SELECTIVE_OP: "op-level selective recompute (each layer but every other "
        "linear matmul and its attention kernel)",
        Recompute.LAYERS: "layer recompute ("
        + ("every layer" if training.every == 1 else f"every {training.every}th layer")
        + ")",
    }[training.recompute]
    why = "chosen by the search" if chosen else "as asked"
    freed, added = format_bytes(figures.freed_bytes), 100 * figures.added_share
    return f"Recomputation: {what}, {why}: frees {freed} per device for {added:.1f} % more compute."


def replayed_seconds(step: Graph, replayed: Collection[str], cluster: Cluster) -> float:
    """The seconds of forward ops `replayed` (their names) in training step `step`, each whole
    on one device of `cluster` (its rule's loops split over no axis): what orders
    recomputations by their compute before a search (sharding divides every op alike, to a
    first order). A recomputed op is a copy of its forward op, priced alike: `step` need not
    be the one recomputing them (`none`'s prices every recomputation)."""
    total = 0.0
    for op in step.ops:
        if op.name in replayed:
            rule = rule_for(op, step)
            whole = None if rule is None else ShardingOption(((),) * len(rule.loops))
            total += op_cost(op, rule, whole, step, cluster).seconds
    return total


def compute_floor(graph: Graph, cluster: Cluster) -> float:
    """Seconds below which no plan of training step `graph` on `cluster` computes: each op
    whole on one device (its rule's loops split over no axis), every run of it per step, its
    work split evenly over every device (at the cache's bandwidth where a shard over every
    device would fit the cache) and, an op that is a kernel of its own, its launch on each.
    No plan does better (a shard of k devices moves and computes at least 1/k of the op, and
    launches it once), and a step's critical path runs every op, so this bounds its step time
    too (`--recompute auto` prunes by it)."""
    device, devices = cluster.device, cluster.mesh.size
    fastest = max(device.hbm_bandwidth, device.cache_bandwidth)
    cached = dataclasses.replace(cluster, device=dataclasses.replace(device, hbm_bandwidth=fastest))
    total = 0.0
    for op in graph.ops:
        rule = rule_for(op, graph)
        whole = None if rule is None else ShardingOption(((),) * len(rule.loops))
        cost = op_cost(op, rule, whole, graph, cluster)
        if cost.bytes <= devices * device.cache_bytes:
            cost = op_cost(op, rule, whole, graph, cached)
        # A fused region's or attention's ops share kernels: their launches are not counted.
        own = graph.fused.kernel(op.name) is None and attention_kernel(op, graph) is None
        launch = device.launch_s if own and cost.seconds >= device.launch_s else 0.0
        total += graph.runs(op.name) * ((cost.seconds - launch) / devices + launch)
    return total


def memory_floor(graph: Graph, devices: int) -> int:
    """Bytes per device below which no plan of training step `graph` on `devices` devices
    fits: a value is live (as made, or in a reshard of it) from the op making it (inputs,
    weights and optimizer state: from the start) to its last reader (the step's outputs: to
    the end), and a device holds at least its 1/`devices` share of it, as `held_bytes` counts
    it (a fused kernel's inside nothing, its probabilities as row statistics): the most such
    shares live at one op. A bound, not a plan (no plan splits every value over every
    device), but no plan holds less."""
    last = {name: len(graph.ops) for name in graph.outputs}
    for index, op in enumerate(graph.ops):
        last.update((name, index) for name in op.inputs if name)
    change = np.zeros(len(graph.ops) + 3, np.int64)  # -1 (before any op) to the end
    made = [(name, -1) for name in (*graph.inputs, *graph.weights)]
    made += [(o, i) for i, op in enumerate(graph.ops) for o in op.outputs if o]
    for name, index in made:
        if name in last:
            change[index + 1] += _whole_bytes(graph, name)
            change[last[name] + 2] -= _whole_bytes(graph, name)
    return int(np.cumsum(change).max()) // devices


def _whole_bytes(graph: Graph, name: str) -> int:
    """Bytes of value `name` whole, as a device holds it (`held_bytes` unsplit)."""
    value, held = graph.values[name], graph.fused.held(name)
    if held is Held.NONE:
        return 0
    if held is Held.STATISTICS:
        return dtypes.nbytes("float32", math.prod(value.shape[:-1]))
    return dtypes.nbytes(value.dtype, math.prod(value.shape))


def recompute_ladder(training: Training) -> tuple[Training, ...]:
    """The recomputations `--recompute auto` may choose: none, selective (where attention is
    not fused: a fused kernel keeps no S x S tensor to free), selective-op, every 4th, every
    2nd, every layer (`recompute_order` orders them by their compute)."""
    selective = () if training.fused_attention else ((Recompute.SELECTIVE, 1),)
    ladder = (
        (Recompute.NONE, 1), *selective, (Recompute.SELECTIVE_OP, 1),
        *((Recompute.LAYERS, k) for k in (4, 2, 1)),
    )  # fmt: skip
    return tuple(training.but(recompute, every) for recompute, every in ladder)


def recompute_ranked(
    forward: Graph, step: Graph, ladder: Sequence[Training], cluster: Cluster
) -> tuple[Training, ...]:
    """The distinct recomputations of `ladder` (of `forward`), ordered by the compute
    they replay (`replayed_seconds`, priced in `step`, a training step of `forward`), the
    first in the ladder first where equal; one of those recomputing the same ops (`layers:2`
    and `layers:4` of two layers). No recomputation's step is built for it."""
    distinct: dict[frozenset[str], Training] = {}
    for training in ladder:
        replayed = frozenset(forward.ops[i].name for r in replays(forward, training) for i in r.ops)
        distinct.setdefault(replayed, training)
    seconds = {t: replayed_seconds(step, names, cluster) for names, t in distinct.items()}
    return tuple(sorted(distinct.values(), key=seconds.__getitem__))
