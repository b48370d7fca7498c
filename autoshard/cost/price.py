"""The price of a sharded program: its collectives' time, its ops' compute (`cost.compute`),
and its memory (`cost.liveness`), per device and per step of the model.

A collective over a group of n devices on links of bandwidth B and latency α runs a ring: it
takes `ring_steps` latency-bound steps and sends `bytes_per_device` bytes
(`autoshard.collectives.ring_bytes`: all_gather and reduce_scatter (n-1)/n·T, all_reduce twice
that, all_to_all (n-1)/n of the shard, a permute one whole shard per device it serves), so

    time = steps·α + bytes_per_device / B

A group within one node runs on its slowest axis's link: B = min, α = max over its axes
(every ring hop crosses some link of each axis in turn). A group across nodes, k of its n
devices in each of m nodes (`Cluster.stages`), runs as NCCL runs it, the faster of two
algorithms (NCCL's tuner picks per size):

- ring: NCCL builds one ring per channel, each leaving a node through a NIC of its own, so
  a ring step moves a node's share through k NICs at once (its k devices' shares, B_net
  each, of the node's aggregate) and through the in-node link B_in within:

      time = steps(n)·α_net + bytes / min(B_in, k·B_net)

- hierarchical: an in-node stage on the scale-up link and an across-node stage over the
  NICs, one after the other (reduce-scatter in the node, the collective across nodes on
  1/k of the data, all-gather in the node; an all_gather or reduce_scatter one stage
  each way). Of the ring's bytes, the across-node stage moves (m-1)/(n-1), the in-node
  stage the rest:

      time = steps(m)·α_net + steps(k)·α_in + bytes·(m-1)/(n-1) / B_net
             + bytes·(n-m)/(n-1) / B_in

An all_to_all sends (n-k)/(n-1) of its bytes across nodes and the rest within, at once; a
permute is as fast as its slowest axis. B_net is one device's share of its node's NICs
(`DeviceKind.network_bandwidth`: a DGX H100's 8 ConnectX-7 at 400 Gb/s = 50 GB/s each), so
a group with one device per node (k = 1) is priced as a plain ring over the network, and
every group within a node as before. Bytes come from the very collectives that
materialization emits (`plan_reshard`), so a plan's estimated bytes are its program's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import cast

from autoshard.collectives import Collective, CollectiveKind, ring_bytes, ring_steps
from autoshard.cost.cluster import Cluster
from autoshard.cost.compute import OpCost, op_cost
from autoshard.cost.liveness import MEMORY_KINDS, Memory, live_kinds, memory
from autoshard.cost.overlap import StepSchedule, step_schedule
from autoshard.cost.ring import send_time
from autoshard.ir.graph import PHASES, Graph
from autoshard.program import Communicate, Compute, Program, step_index
from autoshard.rules import rule_for
from autoshard.training.options import Overlap


def collective_time(collective: Collective, cluster: Cluster) -> float:
    """Seconds a collective takes on the cluster's links: its ring steps at the group's latency
    plus its bytes per device at the group's bandwidth, across nodes as NCCL runs it (the
    module's docstring)."""
    n = cluster.mesh.group_size(collective.mesh_axes)
    sent, kind = collective.bytes_per_device, collective.kind
    if sent == 0:
        return 0.0
    at = cluster.stages(collective.mesh_axes)
    if kind is CollectiveKind.PERMUTE:
        return send_time(sent, collective.mesh_axes, cluster)
    if at.nodes == 1:
        bandwidth, latency = cluster.link(collective.mesh_axes)
        return ring_steps(kind, n) * latency + sent / bandwidth
    k, m = at.per_node, at.nodes
    inside = at.inside_bandwidth if k > 1 else float("inf")
    across = sent * (m - 1) / (n - 1)
    if kind is CollectiveKind.ALL_TO_ALL:
        out = sent * (n - k) / (n - 1)
        return ring_steps(kind, n) * at.across_latency + max(
            out / at.across_bandwidth, (sent - out) / inside
        )
    ring = ring_steps(kind, n) * at.across_latency + sent / min(inside, k * at.across_bandwidth)
    staged = (
        ring_steps(kind, m) * at.across_latency
        + ring_steps(kind, k) * at.inside_latency
        + across / at.across_bandwidth
        + (sent - across) / inside
    )
    return min(ring, staged)


def tied_sync_time(held: int, copies: int, mesh_axes: tuple[int, ...], cluster: Cluster) -> float:
    """Seconds the pipeline stages holding a tied weight (an embedding and its LM head: the
    first stage and the last, `copies` 2) take to sum its gradient after the backward, `held`
    bytes of it per device: a ring all-reduce over the `copies` devices at one place in each
    of those stages (Megatron's embedding group), at the pipeline axis `mesh_axes`'s link."""
    if held == 0 or copies < 2:
        return 0.0
    bandwidth, latency = cluster.link(mesh_axes)
    kind = CollectiveKind.ALL_REDUCE
    return ring_steps(kind, copies) * latency + ring_bytes(kind, copies, held) / bandwidth


@dataclass(frozen=True)
class PhaseCost:
    """What one phase of a training step costs per device, every micro-batch counted."""

    compute_time_s: float = 0.0
    comm_time_s: float = 0.0
    comm_bytes_per_device: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "time_s": self.compute_time_s + self.comm_time_s,
            "compute_time_s": self.compute_time_s,
            "comm_time_s": self.comm_time_s,
            "comm_bytes_per_device": self.comm_bytes_per_device,
        }


@dataclass(frozen=True)
class CollectiveCost:
    """One collective of the program as priced: its place among the program's collectives
    (`index`), the value it moves, the op it is charged to (the next op, which it serves),
    and its bytes and seconds per device, times the runs per step."""

    index: int
    value: str
    kind: str
    mesh_axes: str
    op: str
    bytes_per_device: int
    seconds: float

    def to_json(self) -> dict[str, object]:
        return {"value": self.value, "kind": self.kind, "mesh_axes": self.mesh_axes,
                "op": self.op, "bytes_per_device": self.bytes_per_device,
                "time_s": self.seconds}  # fmt: skip


@dataclass(frozen=True)
class Cost:
    """What a program costs on a cluster (per device). A training step's also says what each
    phase costs and what the memory at the peak holds, by kind."""

    comm_bytes_per_device: int
    comm_time_s: float
    compute_time_s: float
    memory_bytes_per_device: int
    by_axes: Mapping[str, tuple[int, float]] = field(default_factory=dict)
    ops: Mapping[str, OpCost] = field(default_factory=dict)
    """Per op: its roofline, times the runs per step; `compute_time_s` is the sum of their
    seconds, in program order."""
    phases: Mapping[str, PhaseCost] = field(default_factory=dict)
    memory_by_kind: Mapping[str, int] = field(default_factory=dict)
    collectives: tuple[CollectiveCost, ...] = ()
    """Each collective, in program order; their seconds add up to `comm_time_s`."""
    schedule: StepSchedule | None = None
    """A training step's schedule (`cost.overlap`): its critical path, what overlaps."""

    @property
    def objective(self) -> float:
        """Seconds: compute plus communication, without overlap (what the search minimizes,
        an upper bound of the step's time)."""
        return self.compute_time_s + self.comm_time_s

    @property
    def step_time_s(self) -> float:
        """Seconds a step takes: a training step's schedule's critical path, communication
        overlapped with compute; a forward pass's objective (its collectives on its critical
        path)."""
        return self.schedule.step_time_s if self.schedule is not None else self.objective

    def to_json(self) -> dict[str, object]:
        found: dict[str, object] = {
            "objective": self.objective,
            "comm_bytes_per_device": self.comm_bytes_per_device,
            "comm_time_s": self.comm_time_s,
            "compute_time_s": self.compute_time_s,
            "memory_bytes_per_device": self.memory_bytes_per_device,
            "comm_by_mesh_axes": {
                axes: {"bytes_per_device": b, "time_s": t} for axes, (b, t) in self.by_axes.items()
            },
        }
        if self.phases:
            found["phases"] = {name: phase.to_json() for name, phase in self.phases.items()}
            found["memory_by_kind"] = dict(self.memory_by_kind)
        if self.schedule is not None:
            found |= {"step_time_s": self.schedule.step_time_s,
                      "overlap_slowdown_s": self.schedule.slowdown_s}  # fmt: skip
            for name, phase in self.schedule.phases.items():
                mine = cast(dict[str, object], cast(dict[str, object], found["phases"])[name])
                mine |= {"exposed_comm_s": phase.exposed_s, "hidden_comm_s": phase.hidden_s}
        return found


def price(
    program: Program, graph: Graph, cluster: Cluster, usage: Memory | None = None,
    overlap: Overlap | None = None,
) -> Cost:  # fmt: skip
    """The cost of a sharded program: its collectives, its ops' local compute, its memory
    (`usage`: `memory(program)`, when the caller has it already), and a training step's
    schedule (`cost.overlap`) as `overlap` runs it (None: not scheduled; its step time is
    its objective).
    Each step counts as many times as it runs per step of the model (`Graph.runs`: the
    forward and backward of a training step once per micro-batch); a collective runs with the
    op it serves (the next op), the ones after the last op with that one. Totals, per mesh
    axes and per phase are sums of the ops' and collectives' costs, in program order."""
    ops: dict[str, OpCost] = {}
    collectives: list[CollectiveCost] = []
    served, times = served_ops(program), list[float]()
    for step, op_name in zip(program.steps, served, strict=True):
        runs = graph.runs(op_name)
        if isinstance(step, Communicate):
            moved = step.collective
            collectives.append(CollectiveCost(
                len(collectives), program.tensors[step.source].value, str(moved.kind),
                str(list(moved.mesh_axes)), op_name, runs * moved.bytes_per_device,
                runs * collective_time(moved, cluster),
            ))  # fmt: skip
            times.append(collectives[-1].seconds)
        else:
            op = graph.op_by_name[step.op.name]
            rule = rule_for(op, graph) if step.option is not None else None
            once = op_cost(op, rule, step.option, graph, cluster)
            cost = OpCost(runs * once.flops, runs * once.bytes, runs * once.seconds)
            ops[op.name] = ops[op.name] + cost if op.name in ops else cost
            times.append(cost.seconds)
    by_axes: dict[str, tuple[int, float]] = {}
    for c in collectives:
        sent, seconds = by_axes.get(c.mesh_axes, (0, 0.0))
        by_axes[c.mesh_axes] = (sent + c.bytes_per_device, seconds + c.seconds)
    phases: dict[str, PhaseCost] = {}
    if graph.phases:
        for phase in PHASES:
            mine = [c for c in collectives if graph.phase(c.op) == phase]
            phases[phase] = PhaseCost(
                sum(cost.seconds for name, cost in ops.items() if graph.phase(name) == phase),
                sum(c.seconds for c in mine), sum(c.bytes_per_device for c in mine),
            )  # fmt: skip
    peak = usage if usage is not None else memory(program)
    scheduled = (
        step_schedule(program, graph, cluster, overlap, times, served)
        if graph.phases and overlap is not None
        else None
    )
    return Cost(
        sum(c.bytes_per_device for c in collectives), sum(c.seconds for c in collectives),
        sum(cost.seconds for cost in ops.values()), peak.peak, dict(sorted(by_axes.items())),
        ops, phases, _memory_by_kind(program, graph, peak) if graph.phases else {},
        tuple(collectives), scheduled,
    )  # fmt: skip


def served_ops(program: Program) -> list[str]:
    """The op each step serves: a compute step its own, a collective the next op (the ones
    after the last op, that one)."""
    computes = [s.op.name for s in program.steps if isinstance(s, Compute)]
    served, current = [], computes[-1] if computes else ""
    for step in reversed(program.steps):
        current = step.op.name if isinstance(step, Compute) else current
        served.append(current)
    return served[::-1]


def _memory_by_kind(program: Program, graph: Graph, peak: Memory) -> dict[str, int]:
    """The tensors live at the peak, by kind (`MEMORY_KINDS`)."""
    found = dict.fromkeys(MEMORY_KINDS, 0)
    for _, kind, size in live_kinds(program, graph, peak):
        found[kind] += size
    return found


def held_at_peak(
    graph: Graph, program: Program, peak: Memory | None = None
) -> tuple[dict[str, dict[str, int]], str | None]:
    """What each op holds at the program's peak (`peak`: its `memory`, when the caller has it),
    by kind: a tensor an op computes is that op's, a collective's result the op's it serves, a
    weight, input or state its first reader's; and the op running at the peak (None: the peak
    is before the first step)."""
    peak = memory(program) if peak is None else peak
    served = served_ops(program)
    defined = step_index(program.steps, program.outputs)[0]
    held: dict[str, dict[str, int]] = {}
    for tensor, kind, size in live_kinds(program, graph, peak):
        if tensor in defined:
            owner = served[defined[tensor]]
        else:  # a weight, input or state: its first reader's
            readers = graph.consumers(program.tensors[tensor].value)
            owner = readers[0].name if readers else ""
        mine = held.setdefault(owner, {})
        mine[kind] = mine.get(kind, 0) + size
    return held, served[peak.step] if peak.step >= 0 else None
