"""A training step as it runs: one compute stream and one communication stream per link class
(the scale-up link, the network), the step's time the schedule's critical path.

The program's steps run in program order on the compute stream; each collective runs on the
stream of its link class (`link_class`) and, on it, in the first gap at or after the moment it
is issued (a stream runs one collective at a time). An op waits for the collectives whose
results it reads. When a collective is issued (`Overlap`, `training.options`):

- a weight's all_gather (FSDP) in the forward or the backward, `prefetch` ≥ 1: when the
  compute stream reaches the op that reads the weights gathered `prefetch` gathering ops
  earlier in the phase (the first `prefetch` gathering ops' weights: at the phase's first
  op), as FSDP2 prefetches modules ahead;
- a gradient's sync (DDP's all_reduce, ZeRO's and FSDP's reduce_scatter): with the others of
  its bucket, once the backward has computed the bucket's last gradient; a bucket closes at
  `bucket_mb` MB of gradients (the gradient that crosses the size is its last) or where an op
  reads a synchronized gradient (the optimizer), as DDP's buckets do;
- with `async_tp`, a tensor-parallel all_gather read by a matmul, and a reduce_scatter of a
  matmul's result: with the matmul, which runs beside it (async TP's pipelined matmul; the
  matmul's readers wait for both);
- any other (tensor-parallel collectives without async TP, reshards, the optimizer's): where
  the program places it, once its input is computed: on the critical path.

A kernel that runs while a collective runs takes `DeviceKind.overlap_slowdown` (s) longer for
the time they overlap: a kernel of d seconds starting at t ends at t + d + s·o, o the time in
[t, t + d) that some collective runs. A collective's seconds under compute are *hidden*, the
rest *exposed*; per phase (the phase of the op each collective serves) they add up to the
phase's communication time. `Overlap(enabled=False)`: nothing overlaps; the step is its
compute plus its communication, all of it exposed.

Worked example (s = 0.1, one stream): forward ops A (4 s) and B (4 s) read weights gathered by
G_A (3 s) and G_B (3 s), prefetch 1. G_A and G_B are both issued at A's phase start (t = 0):
G_A runs 0-3, G_B 3-6; A waits for G_A, runs from 3 overlapping G_B for its first 3 s, ends
3 + 4 + 0.1·3 = 7.3; B runs 7.3-11.3. Step 11.3 s; G_A exposed 3, G_B hidden 3. Prefetch 0:
G_A 0-3, A 3-7, G_B 7-10, B 10-14: the serial 14 s.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from autoshard.collectives import CollectiveKind
from autoshard.cost.cluster import Cluster
from autoshard.cost.liveness import shard_bytes
from autoshard.ir.graph import PHASES, Graph
from autoshard.program import Communicate, Compute, Program
from autoshard.rules.gradient import TRAIN, TrainOp
from autoshard.training.options import Overlap

MATMULS = frozenset({"MatMul", "Gemm", "Einsum", "FusedMatMul"})
"""Op types async TP runs a collective inside of (and their gradients)."""

_PREFETCHED = PHASES[:2]  # FSDP gathers weights ahead in the forward and the backward


class Role(enum.StrEnum):
    """When a collective is issued (the module's docstring)."""

    PREFETCH = "prefetch"  # a weight's all_gather: issued ahead where prefetch >= 1
    GRADIENT = "gradient"  # a gradient's sync, in a bucket
    ASYNC_TP = "async_tp"  # a TP all_gather or reduce_scatter: beside its matmul with async TP
    IN_PLACE = "in_place"  # where the program places it


class Link(enum.StrEnum):
    SCALE_UP = "scale_up"
    NETWORK = "network"


def link_class(mesh_axes: Sequence[int], cluster: Cluster) -> Link:
    """The stream a collective runs on: the network where its group spans nodes."""
    return Link.NETWORK if cluster.stages(mesh_axes).nodes > 1 else Link.SCALE_UP


@dataclass(frozen=True)
class Kernel:
    """A compute step: `seconds` at full speed (every run per step), the tensors it reads and
    writes; `passthrough` ops (a gradient's sync: its scaling) run where the program places
    them without waiting for the sync, their results ready with it; `matmul`: async TP may run
    a collective inside it."""

    name: str
    phase: str
    seconds: float
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    matmul: bool = False
    passthrough: bool = False


@dataclass(frozen=True)
class Transfer:
    """A collective: its seconds, stream, role, the phase of the op it serves, and `size`, the
    bytes of a gradient it syncs (its bucket's measure). `joined`: the kernel an async-TP
    collective runs inside of; `issuer`: the kernel at whose turn a prefetch is issued;
    `reader`: the first kernel reading its result ("" none)."""

    source: str
    target: str
    seconds: float
    link: Link
    role: Role = Role.IN_PLACE
    phase: str = PHASES[0]
    size: int = 0
    joined: str = ""
    issuer: str = ""
    reader: str = ""


@dataclass(frozen=True)
class PhaseOverlap:
    """A phase's communication seconds under compute (`hidden_s`) and not (`exposed_s`)."""

    exposed_s: float = 0.0
    hidden_s: float = 0.0


@dataclass(frozen=True)
class StepSchedule:
    """A step's schedule: its critical path (`step_time_s`), the compute seconds overlap
    slowed kernels by (`slowdown_s`), per phase the exposed and hidden communication, and each
    collective's (start, end) in program order."""

    step_time_s: float
    slowdown_s: float
    phases: Mapping[str, PhaseOverlap] = field(default_factory=dict)
    spans: tuple[tuple[float, float], ...] = ()

    @property
    def exposed_s(self) -> float:
        return sum(p.exposed_s for p in self.phases.values())

    @property
    def hidden_s(self) -> float:
        return sum(p.hidden_s for p in self.phases.values())


def step_schedule(
    program: Program, graph: Graph, cluster: Cluster, overlap: Overlap,
    seconds: Sequence[float], served: Sequence[str],
) -> StepSchedule:  # fmt: skip
    """The schedule of training step `program` (`seconds`: each step's, `served`: the op each
    serves, as `cost.price` prices them, collectives and ops alike)."""
    steps = tasks(program, graph, cluster, seconds, served)
    return schedule(steps, overlap, cluster.device.overlap_slowdown)


def tasks(
    program: Program, graph: Graph, cluster: Cluster, seconds: Sequence[float],
    served: Sequence[str],
) -> list[Kernel | Transfer]:  # fmt: skip
    """The program's steps as the schedule sees them, in program order; a collective's phase
    is its served op's, as `cost.price` splits the communication by phase."""
    producer = {
        out: s.op.name for s in program.steps if isinstance(s, Compute) for out in s.outputs
    }
    found: list[Kernel | Transfer] = [
        _kernel(s, graph, t) if isinstance(s, Compute) else _transfer(s, program, cluster, t)
        for s, t in zip(program.steps, seconds, strict=True)
    ]
    kernels = {k.name: k for k in found if isinstance(k, Kernel)}
    readers: dict[str, str] = {}
    for task in reversed(found):
        if isinstance(task, Kernel):
            readers.update(dict.fromkeys(task.reads, task.name))
    for i, (task, op) in enumerate(zip(found, served, strict=True)):
        if isinstance(task, Transfer):
            reader = kernels.get(readers.get(task.target, ""))
            step = program.steps[i]
            assert isinstance(step, Communicate)
            role, joined = _role(step, program, graph, producer, kernels, reader)
            found[i] = dataclasses.replace(
                task, role=role, phase=graph.phase(op), joined=joined,
                reader=reader.name if reader is not None else "",
            )  # fmt: skip
    return found


def _transfer(step: Communicate, program: Program, cluster: Cluster, seconds: float) -> Transfer:
    tensor = program.tensors[step.source]
    size = shard_bytes(tensor.shape, tensor.dtype, tensor.sharding, program.mesh)
    return Transfer(step.source, step.target, seconds,
                    link_class(step.collective.mesh_axes, cluster), size=size)  # fmt: skip


def _kernel(step: Compute, graph: Graph, seconds: float) -> Kernel:
    op = step.op
    forward = graph.op_by_name.get(str(op.attr("op", ""))) if op.domain == TRAIN else None
    kind = forward.type if forward is not None and op.type == TrainOp.GRAD else op.type
    sync = op.domain == TRAIN and op.type == TrainOp.GRAD_SYNC
    return Kernel(op.name, graph.phase(op.name), seconds, tuple(i for i in op.inputs if i),
                  tuple(o for o in op.outputs if o), kind in MATMULS, sync)  # fmt: skip


def _role(
    step: Communicate, program: Program, graph: Graph, producer: Mapping[str, str],
    kernels: Mapping[str, Kernel], reader: Kernel | None,
) -> tuple[Role, str]:  # fmt: skip
    """A collective's role and the kernel it would join (async TP)."""
    if reader is not None and reader.passthrough:
        return Role.GRADIENT, ""
    value = program.tensors[step.source].value
    weight = step.source not in producer and value in graph.weights
    if weight and reader is not None and reader.phase in _PREFETCHED:
        return Role.PREFETCH, ""
    kind, made = step.collective.kind, kernels.get(producer.get(step.source, ""))
    if kind is CollectiveKind.ALL_GATHER and reader is not None and reader.matmul:
        return Role.ASYNC_TP, reader.name
    if kind is CollectiveKind.REDUCE_SCATTER and made is not None and made.matmul:
        return Role.ASYNC_TP, made.name
    return Role.IN_PLACE, ""


def _as_run(task: Kernel | Transfer, overlap: Overlap) -> Kernel | Transfer:
    """A task as `overlap` runs it: a prefetch without prefetching, a TP collective without
    async TP, where the program places it."""
    if isinstance(task, Transfer) and (
        (task.role is Role.PREFETCH and not overlap.prefetch)
        or (task.role is Role.ASYNC_TP and not overlap.async_tp)
    ):
        return dataclasses.replace(task, role=Role.IN_PLACE, joined="")
    return task


def _issuers(found: list[Kernel | Transfer], depth: int) -> list[Kernel | Transfer]:
    """Each prefetch's issuer: the kernel reading the weights gathered `depth` gathering ops
    earlier in its phase, or the phase's first kernel."""
    first: dict[str, str] = {}
    gatherers: dict[str, list[str]] = {}
    for task in found:
        if isinstance(task, Kernel):
            first.setdefault(task.phase, task.name)
        elif task.role is Role.PREFETCH:
            mine = gatherers.setdefault(task.phase, [])
            if task.reader not in mine:
                mine.append(task.reader)
    out: list[Kernel | Transfer] = []
    for task in found:
        if isinstance(task, Transfer) and task.role is Role.PREFETCH:
            order = gatherers[task.phase]
            at = order.index(task.reader) - depth
            task = dataclasses.replace(task, issuer=order[at] if at >= 0 else first[task.phase])
        out.append(task)
    return out


class _Timeline:
    """A stream's busy spans: disjoint, sorted (so their ends are too)."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def take(self, issued: float, seconds: float) -> tuple[float, float]:
        """The first gap of `seconds` at or after `issued`, taken."""
        i, start = bisect.bisect_right(self.ends, issued), issued
        while i < len(self.starts) and self.starts[i] < start + seconds:
            start, i = max(start, self.ends[i]), i + 1
        self.starts.insert(i, start)
        self.ends.insert(i, start + seconds)
        return start, start + seconds

    def pieces(self, start: float, end: float) -> list[tuple[float, float]]:
        """The parts of [start, end) the spans cover."""
        found, i = [], bisect.bisect_right(self.ends, start)
        while i < len(self.starts) and self.starts[i] < end:
            found.append((max(self.starts[i], start), min(self.ends[i], end)))
            i += 1
        return found


class _Streams:
    """The communication streams, one `_Timeline` per link class."""

    def __init__(self) -> None:
        self.busy: dict[Link, _Timeline] = {}

    def place(self, link: Link, issued: float, seconds: float) -> tuple[float, float]:
        """The first gap of `seconds` at or after `issued` on the link's stream, taken."""
        return self.busy.setdefault(link, _Timeline()).take(issued, seconds)

    def overlap(self, start: float, end: float) -> float:
        """Seconds of [start, end) during which some collective runs."""
        spans = sorted(p for line in self.busy.values() for p in line.pieces(start, end))
        return _covered(spans, start, end)


def _covered(spans: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end) that the union of sorted `spans` covers."""
    covered, reached = 0.0, start
    for a, b in spans:
        a, b = max(a, reached), min(b, end)
        if b > a:
            covered += b - a
            reached = b
    return covered


def schedule(found: Sequence[Kernel | Transfer], overlap: Overlap, slowdown: float) -> StepSchedule:
    """Run the tasks (module docstring): the step's critical path and its overlap."""
    if not overlap.enabled:
        return _serial(found)
    found = _issuers([_as_run(t, overlap) for t in found], overlap.prefetch)
    transfers = [t for t in found if isinstance(t, Transfer)]
    run = _Run(found, overlap, slowdown)
    for task in found:
        if isinstance(task, Kernel):
            run.kernel(task)
        elif task.role is Role.GRADIENT:
            run.bucket(task)
        elif task.role is Role.IN_PLACE:
            run.put(task, max(run.free, run.ready(task.source)))
    run.flush()
    spans = tuple(run.spans[t.target] for t in transfers)
    phases: dict[str, PhaseOverlap] = {}
    for task, (a, b) in zip(transfers, spans, strict=True):
        hidden = sum(y - x for x, y in run.computing.pieces(a, b))
        mine = phases.get(task.phase, PhaseOverlap())
        phases[task.phase] = PhaseOverlap(mine.exposed_s + (b - a) - hidden, mine.hidden_s + hidden)
    end = max([run.free, *(b for _, b in spans)])
    return StepSchedule(end, run.slowed, _in_order(phases, found), spans)


def _in_order(
    phases: Mapping[str, PhaseOverlap], found: Sequence[Kernel | Transfer]
) -> dict[str, PhaseOverlap]:
    """The phases in step order, each with a kernel or a collective."""
    names = [p for p in PHASES if any(isinstance(t, Kernel) and t.phase == p for t in found)]
    return {p: phases.get(p, PhaseOverlap()) for p in dict.fromkeys([*names, *phases])}


def _serial(found: Sequence[Kernel | Transfer]) -> StepSchedule:
    """Nothing overlapped: each step after the one before."""
    at, spans, phases = 0.0, [], dict[str, PhaseOverlap]()
    for task in found:
        if isinstance(task, Transfer):
            spans.append((at, at + task.seconds))
            mine = phases.get(task.phase, PhaseOverlap())
            phases[task.phase] = PhaseOverlap(mine.exposed_s + task.seconds, 0.0)
        at += task.seconds
    return StepSchedule(at, 0.0, _in_order(phases, found), tuple(spans))


class _Run:
    """The schedule being built: the compute stream's time (`free`), the collectives' spans
    by target, the compute spans, the open gradient bucket."""

    def __init__(self, found: Sequence[Kernel | Transfer], overlap: Overlap, slowdown: float):
        self.overlap, self.slowdown = overlap, slowdown
        self.free, self.slowed = 0.0, 0.0
        self.streams = _Streams()
        self.spans: dict[str, tuple[float, float]] = {}
        self.alias: dict[str, str] = {}
        self.computing = _Timeline()
        self.bucket_open: list[Transfer] = []
        self.early: dict[str, list[Transfer]] = {}
        for task in found:
            if isinstance(task, Transfer) and task.role is Role.PREFETCH:
                self.early.setdefault(task.issuer, []).append(task)
        self.inside: dict[str, list[Transfer]] = {}
        for task in found:
            if isinstance(task, Transfer) and task.role is Role.ASYNC_TP:
                self.inside.setdefault(task.joined, []).append(task)

    def ready(self, tensor: str) -> float:
        """When a tensor is ready: a collective's result at its end, a kernel's output once
        computed (never later than `free`)."""
        tensor = self.alias.get(tensor, tensor)
        return self.spans[tensor][1] if tensor in self.spans else 0.0

    def put(self, task: Transfer, issued: float) -> None:
        self.spans[task.target] = self.streams.place(task.link, issued, task.seconds)

    def kernel(self, task: Kernel) -> None:
        if task.passthrough:
            self.alias.update(dict.fromkeys(task.writes, task.reads[0] if task.reads else ""))
        pending = {t.target for t in self.bucket_open}
        if not task.passthrough and any(self.alias.get(r, r) in pending for r in task.reads):
            self.flush()
        for early in self.early.get(task.name, ()):
            self.put(early, self.free)
        mine = [t for t in self.inside.get(task.name, ()) if t.source not in task.writes]
        beside = {t.target for t in mine} | set(task.reads if task.passthrough else ())
        start = max([self.free, *(self.ready(r) for r in task.reads if r not in beside)])
        for t in mine:  # an all_gather a matmul reads runs beside it
            self.put(t, start)
        for t in self.inside.get(task.name, ()):
            if t.source in task.writes:  # a reduce_scatter of the matmul's result, likewise
                self.put(t, start)
        extra = self.slowdown * self.streams.overlap(start, start + task.seconds)
        end = max([start + task.seconds + extra, *(self.spans[t.target][1] for t in mine)])
        self.slowed += extra
        self.computing.take(start, task.seconds + extra)
        self.free = end

    def bucket(self, task: Transfer) -> None:
        self.bucket_open.append(task)
        if sum(t.size for t in self.bucket_open) >= self.overlap.bucket_bytes:
            self.flush()

    def flush(self) -> None:
        """Launch the open bucket: each of its syncs once its gradient and the compute before
        it are done."""
        issued = max([self.free, *(self.ready(t.source) for t in self.bucket_open)])
        for t in self.bucket_open:
            self.put(t, issued)
        self.bucket_open = []
