"""The cost model: every formula the planner prices with, written once.

Communication. A collective over a group of n devices on links of bandwidth B and latency α
runs a ring: it takes `ring_steps` latency-bound steps and sends `bytes_per_device` bytes
(`autoshard.reshard.ring_bytes`: all_gather and reduce_scatter (n-1)/n·T, all_reduce twice
that, all_to_all (n-1)/n of the shard, a permute one whole shard per device it serves), so

    time = steps·α + bytes_per_device / B

A group over several mesh axes is as fast as its slowest axis: B = min, α = max over its axes
(every ring hop crosses some link of each axis in turn). Bytes come from the very collectives
that materialization emits (`plan_reshard`), so a plan's estimated bytes are its program's.

Compute. An op with loops of sizes s_i split over g_i devices each runs Π ceil(s_i / g_i)
iterations per device, 2 FLOPs (multiply and add) when it has a reduction loop, else 1; its
time is FLOPs / the device's peak for the result dtype. An op without a rule runs whole on
every device (its result elements, once each).

Memory. A tensor takes, per device, the bytes of its largest shard: Π ceil(d_i / g_i) elements.
Walking the program in order, a tensor is live from the step defining it to the last step
reading it; program inputs, weights and constants are live throughout. The peak over steps is
the memory per device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from autoshard.cost.cluster import Cluster
from autoshard.ir import dtypes
from autoshard.ir.graph import PHASES, Graph, Op
from autoshard.mesh import Mesh
from autoshard.plan import ShardingOption
from autoshard.program import Communicate, Compute, Program, Tensor
from autoshard.reshard import Collective, ring_steps
from autoshard.rules import IteratorType, OpRule, rule_for
from autoshard.rules.gradient import TRAIN, TrainOp
from autoshard.sharding import Sharding, shard_size


def collective_time(collective: Collective, cluster: Cluster) -> float:
    n = cluster.mesh.group_size(collective.mesh_axes)
    bandwidth, latency = cluster.link(collective.mesh_axes)
    if collective.bytes_per_device == 0:
        return 0.0
    return ring_steps(collective.kind, n) * latency + collective.bytes_per_device / bandwidth


def op_flops(
    op: Op, rule: OpRule | None, option: ShardingOption | None, graph: Graph, mesh: Mesh
) -> int:
    """FLOPs one device runs for `op` computed with `option` (None: whole on every device)."""
    if rule is None or option is None:
        return sum(math.prod(graph.values[o].shape) for o in op.outputs if o)
    per_device = 1
    for loop, axes in zip(rule.loops, option.loops, strict=True):
        per_device *= shard_size(loop.size, mesh.group_size(axes))
    multiply_add = any(loop.kind is IteratorType.REDUCTION for loop in rule.loops)
    return per_device * (2 if multiply_add else 1)


def compute_time(
    op: Op, rule: OpRule | None, option: ShardingOption | None, graph: Graph, cluster: Cluster
) -> float:
    """Seconds one device computes `op` with `option`, at the peak for its result dtype."""
    flops = op_flops(op, rule, option, graph, cluster.mesh)
    dtype = graph.values[op.outputs[0]].dtype if op.outputs and op.outputs[0] else "float32"
    return flops / cluster.device.peak(dtype)


def shard_bytes(shape: Sequence[int], dtype: str, sharding: Sharding, mesh: Mesh) -> int:
    """Bytes of the largest shard of a tensor."""
    elements = 1
    for dim, size in enumerate(shape):
        elements *= shard_size(size, sharding.shard_count(mesh, dim))
    return dtypes.nbytes(dtype, elements)


@dataclass(frozen=True)
class Memory:
    """Peak bytes per device, the program step where it is reached (-1: before any), and the
    tensors live there, largest first."""

    peak: int
    step: int
    live: tuple[tuple[str, int], ...]


def memory(program: Program) -> Memory:
    mesh = program.mesh

    def size(t: Tensor) -> int:
        return shard_bytes(t.shape, t.dtype, t.sharding, mesh)

    resident = [n for n in (*program.inputs, *program.constants) if n not in program.replaced]
    last: dict[str, int] = {}
    for i, step in enumerate(program.steps):
        for name in step.inputs:
            if name:
                last[name] = i
    for name in program.outputs:
        last[name] = len(program.steps)
    # Replaced inputs and accumulated gradients: live from the start until their last reader.
    early = sorted(program.replaced | program.accumulated)
    live = {n: size(program.tensors[n]) for n in early}
    current = sum(size(program.tensors[n]) for n in resident) + sum(live.values())
    peak, where, at_peak = current, -1, dict(live) | dict.fromkeys(resident, 0)
    freed: dict[int, list[str]] = {}  # step -> tensors dead after it
    for name in live:
        freed.setdefault(last.get(name, -1), []).append(name)
    for i, step in enumerate(program.steps):
        if isinstance(step, Compute):  # an update writes over what it replaces
            for name in [n for n in freed.get(i, ()) if n in program.replaced]:
                freed[i].remove(name)
                current -= live.pop(name)
        for name in step.outputs:
            if name and name not in live and name not in resident:
                live[name] = size(program.tensors[name])
                current += live[name]
                freed.setdefault(max(last.get(name, i), i), []).append(name)
        if current > peak:
            peak, where, at_peak = current, i, dict(live) | dict.fromkeys(resident, 0)
        for name in freed.pop(i, []) + freed.pop(-1, []):
            current -= live.pop(name)
    sizes = {n: size(program.tensors[n]) for n in at_peak}
    top = sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))
    return Memory(peak, where, tuple(top))


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
class Cost:
    """What a program costs on a cluster (per device). A training step's also says what each
    phase costs and what the memory at the peak holds, by kind."""

    comm_bytes_per_device: int
    comm_time_s: float
    compute_time_s: float
    memory_bytes_per_device: int
    by_axes: Mapping[str, tuple[int, float]] = field(default_factory=dict)
    phases: Mapping[str, PhaseCost] = field(default_factory=dict)
    memory_by_kind: Mapping[str, int] = field(default_factory=dict)

    @property
    def objective(self) -> float:
        """Seconds: compute plus communication, without overlap."""
        return self.compute_time_s + self.comm_time_s

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
        return found


MEMORY_KINDS = ("weights", "gradients", "optimizer_state", "activations", "inputs", "buffers")
"""What a device holds, by kind: `buffers` are the results of collectives (a gathered weight,
a resharded activation)."""


def memory_kinds(graph: Graph) -> dict[str, str]:
    """The kind of every graph value (`MEMORY_KINDS` but buffers, which are program tensors):
    weights and their next values; optimizer state and its next; gradients (what the loss
    gradient, gradient ops, their sums and syncs make); inputs; every other value an
    activation."""
    kinds = dict.fromkeys(graph.values, "activations")
    kinds |= dict.fromkeys(graph.inputs, "inputs")
    kinds |= dict.fromkeys(graph.weights, "weights")
    for op in graph.ops:
        if op.domain == TRAIN and op.type == TrainOp.UPDATE:
            weight, state = op.inputs[1], op.inputs[2]
            kinds |= {weight: "weights", op.outputs[0]: "weights"}
            kinds |= {state: "optimizer_state", op.outputs[1]: "optimizer_state"}
        elif (op.domain == TRAIN) or (
            op.type == "Sum" and all(kinds.get(i) == "gradients" for i in op.inputs)
        ):
            kinds |= dict.fromkeys(op.outputs, "gradients")
    return kinds


def price(program: Program, graph: Graph, cluster: Cluster) -> Cost:
    """The cost of a sharded program: its collectives, its ops' local compute, its memory.
    Each step counts as many times as it runs per step of the model (`Graph.runs`: the
    forward and backward of a training step once per micro-batch); a collective runs with the
    op it serves (the next op), the ones after the last op with that one."""
    comm_bytes, comm_time, compute = 0, 0.0, 0.0
    by_axes: dict[str, tuple[int, float]] = {}
    phases: dict[str, PhaseCost] = {}
    serves, served = [""] * len(program.steps), _last_op(program)
    for i in reversed(range(len(program.steps))):
        step = program.steps[i]
        served = step.op.name if isinstance(step, Compute) else served
        serves[i] = served
    for step, op_name in zip(program.steps, serves, strict=True):
        runs, phase = graph.runs(op_name), graph.phase(op_name)
        spent = phases.get(phase, PhaseCost())
        if isinstance(step, Communicate):
            c = step.collective
            seconds = runs * collective_time(c, cluster)
            sent = runs * c.bytes_per_device
            comm_bytes += sent
            comm_time += seconds
            key = str(list(c.mesh_axes))
            b, t = by_axes.get(key, (0, 0.0))
            by_axes[key] = (b + sent, t + seconds)
            spent = PhaseCost(
                spent.compute_time_s, spent.comm_time_s + seconds,
                spent.comm_bytes_per_device + sent,
            )  # fmt: skip
        else:
            op = graph.op_by_name[step.op.name]
            rule = rule_for(op, graph) if step.option is not None else None
            seconds = runs * compute_time(op, rule, step.option, graph, cluster)
            compute += seconds
            spent = PhaseCost(
                spent.compute_time_s + seconds, spent.comm_time_s, spent.comm_bytes_per_device
            )
        phases[phase] = spent
    peak = memory(program)
    by_kind: dict[str, int] = {}
    if graph.phases:
        kinds = memory_kinds(graph)
        by_kind = dict.fromkeys(MEMORY_KINDS, 0)
        for name, size in peak.live:
            tensor = program.tensors[name]
            kind = "buffers" if tensor.name != tensor.value else kinds[tensor.value]
            by_kind[kind] += size
    return Cost(
        comm_bytes, comm_time, compute, peak.peak, dict(sorted(by_axes.items())),
        {p: phases[p] for p in PHASES if p in phases} if graph.phases else {}, by_kind,
    )  # fmt: skip


def _last_op(program: Program) -> str:
    computes = [s for s in program.steps if isinstance(s, Compute)]
    return computes[-1].op.name if computes else ""
