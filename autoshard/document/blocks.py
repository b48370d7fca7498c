"""The blocks of a plan document (`document.plan_document.PlanDocument`), each a frozen value
with the JSON it reads and writes: the model, how values are held and ops computed, the
collectives, the cost, the cluster, the solver's and the search's figures, the timing, a
training step's weight strategies; and `Decisions`, what decides a plan (its ops, values and
training step), which a partition's manifest also records.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from autoshard.errors import AutoshardError
from autoshard.sharding import Sharding
from autoshard.training import Training


class DocumentError(AutoshardError):
    """A plan file that cannot be read, is not a plan, or is for another model or mesh."""


# ---- the document's blocks ---------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    """`model`: what identifies the model a plan is for (its dims as `--dim` bound them)."""

    name: str | None
    file: str | None
    sha256: str | None
    dims: Mapping[str, int]

    @property
    def label(self) -> str:
        """`gpt2.onnx batch=8 seq=128`: the model file and its bound dims."""
        dims = " ".join(f"{k}={v}" for k, v in sorted(self.dims.items()))
        return f"{self.file or self.name}{' ' + dims if dims else ''}"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "file": self.file, "sha256": self.sha256,
                "dims": dict(self.dims)}  # fmt: skip

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> ModelInfo:
        return ModelInfo(data.get("name"), data.get("file"), data.get("sha256"),
                         dict(data.get("dims") or {}))  # fmt: skip


@dataclass(frozen=True)
class HeldValue:
    """An entry of `values`: how a value is held (`sharding`, `partial`); a graph input's or
    weight's also how each op reads it (`read_as`), a graph output returned otherwise than
    held how (`returned_as`)."""

    sharding: str
    partial: str | None = None
    read_as: Mapping[str, str] | None = None
    returned_as: str | None = None

    @property
    def held(self) -> str:
        """The sharding text with its partial reduction: `[[0], []] partial = sum[1]`."""
        return self.sharding + (f" partial = {self.partial}" if self.partial else "")

    @cached_property
    def held_sharding(self) -> Sharding:
        """How the value is held, parsed (once)."""
        return Sharding.parse(self.held)

    @cached_property
    def returned_sharding(self) -> Sharding | None:
        return Sharding.parse(self.returned_as) if self.returned_as is not None else None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"sharding": self.sharding, "partial": self.partial}
        if self.read_as is not None:
            data["read_as"] = dict(self.read_as)
        if self.returned_as is not None:
            data["returned_as"] = self.returned_as
        return data

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> HeldValue:
        return HeldValue(data["sharding"], data.get("partial"), data.get("read_as"),
                         data.get("returned_as"))  # fmt: skip


@dataclass(frozen=True)
class OpEntry:
    """An entry of `ops`: the op's type and sharding option (None: no rule, computed
    replicated); priced, what one device spends on it; in a training step, its phase."""

    type: str
    sharding_option: str | None
    flops: int | None = None
    bytes: int | None = None
    compute_s: float | None = None
    phase: str | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"type": self.type, "sharding_option": self.sharding_option}
        if self.compute_s is not None:
            data |= {"flops": self.flops, "bytes": self.bytes, "compute_s": self.compute_s}
        if self.phase is not None:
            data["phase"] = self.phase
        return data

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> OpEntry:
        return OpEntry(data["type"], data.get("sharding_option"), data.get("flops"),
                       data.get("bytes"), data.get("compute_s"), data.get("phase"))  # fmt: skip


@dataclass(frozen=True)
class CollectiveEntry:
    """An entry of `collectives` (`Program.collectives_json`): the value it moves, the op that
    reads its result (None: an output or another collective), its kind, mesh axes, shardings
    and bytes; `details` holds what only its kind has (axes, reduction, pairs), in order."""

    value: str
    user: str | None
    kind: str
    mesh_axes: tuple[int, ...]
    source: str
    target: str
    bytes_per_device: int
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value, "user": self.user, "kind": self.kind,
                "mesh_axes": list(self.mesh_axes), "from": self.source, "to": self.target,
                "bytes_per_device": self.bytes_per_device, **self.details}  # fmt: skip

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> CollectiveEntry:
        common = ("value", "user", "kind", "mesh_axes", "from", "to", "bytes_per_device")
        return CollectiveEntry(
            data["value"], data.get("user"), data["kind"], tuple(data["mesh_axes"]),
            data["from"], data["to"], data.get("bytes_per_device", 0),
            {k: v for k, v in data.items() if k not in common},
        )  # fmt: skip


@dataclass(frozen=True)
class Traffic:
    """What the collectives over some mesh axes move and take, per device."""

    bytes_per_device: int
    time_s: float

    def to_json(self) -> dict[str, Any]:
        return {"bytes_per_device": self.bytes_per_device, "time_s": self.time_s}


@dataclass(frozen=True)
class PhaseFigures:
    """What one phase of a training step costs (`cost.phases`): `time_s` its compute plus
    its communication; of that communication, the seconds exposed and hidden under compute
    in the step's schedule (`cost.overlap`; None in a plan from before it)."""

    time_s: float
    compute_time_s: float
    comm_time_s: float
    comm_bytes_per_device: int
    exposed_comm_s: float | None = None
    hidden_comm_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"time_s": self.time_s, "compute_time_s": self.compute_time_s,
                "comm_time_s": self.comm_time_s,
                "comm_bytes_per_device": self.comm_bytes_per_device}  # fmt: skip
        if self.exposed_comm_s is not None:
            data |= {"exposed_comm_s": self.exposed_comm_s, "hidden_comm_s": self.hidden_comm_s}
        return data


@dataclass(frozen=True)
class CostFigures:
    """`cost` (`Cost.to_json`): per device; a training step's also by phase, the memory at
    the peak by kind, and its schedule's critical path (`step_time_s`) with the seconds the
    overlap slowed its kernels by (None: a forward pass, or a plan from before the schedule;
    its step time is the objective)."""

    objective: float
    comm_bytes_per_device: int
    comm_time_s: float
    compute_time_s: float
    memory_bytes_per_device: int
    comm_by_mesh_axes: Mapping[str, Traffic] = field(default_factory=dict)
    phases: Mapping[str, PhaseFigures] | None = None
    memory_by_kind: Mapping[str, int] | None = None
    scheduled_s: float | None = None
    overlap_slowdown_s: float | None = None

    @property
    def step_time_s(self) -> float:
        """Seconds a step takes: the schedule's critical path, else the objective."""
        return self.scheduled_s if self.scheduled_s is not None else self.objective

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "objective": self.objective, "comm_bytes_per_device": self.comm_bytes_per_device,
            "comm_time_s": self.comm_time_s, "compute_time_s": self.compute_time_s,
            "memory_bytes_per_device": self.memory_bytes_per_device,
            "comm_by_mesh_axes": {k: t.to_json() for k, t in self.comm_by_mesh_axes.items()},
        }  # fmt: skip
        if self.phases is not None:
            data["phases"] = {name: p.to_json() for name, p in self.phases.items()}
        if self.memory_by_kind is not None:
            data["memory_by_kind"] = dict(self.memory_by_kind)
        if self.scheduled_s is not None:
            data |= {"step_time_s": self.scheduled_s,
                     "overlap_slowdown_s": self.overlap_slowdown_s}  # fmt: skip
        return data

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> CostFigures:
        phases = data.get("phases")
        kinds = data.get("memory_by_kind")
        return CostFigures(
            data["objective"], data["comm_bytes_per_device"], data["comm_time_s"],
            data["compute_time_s"], data["memory_bytes_per_device"],
            {k: Traffic(t["bytes_per_device"], t["time_s"])
             for k, t in (data.get("comm_by_mesh_axes") or {}).items()},
            None if phases is None else {
                name: PhaseFigures(p["time_s"], p["compute_time_s"], p["comm_time_s"],
                                   p["comm_bytes_per_device"], p.get("exposed_comm_s"),
                                   p.get("hidden_comm_s")) for name, p in phases.items()
            },
            None if kinds is None else dict(kinds),
            data.get("step_time_s"), data.get("overlap_slowdown_s"),
        )  # fmt: skip


@dataclass(frozen=True)
class ClusterInfo:
    """`cluster` (`Cluster.to_json`): what the plan was priced on. `reserve_bytes`: what the
    budget left of the device's memory to what is no tensor (0, and not written, where a
    budget was given and in plans written before it was recorded)."""

    mesh: str
    device: str
    bandwidth_bytes_per_s: tuple[float, ...]
    latency_s: tuple[float, ...]
    memory_bytes: int
    node_size: int
    in_node: tuple[bool, ...]
    hbm_bandwidth_bytes_per_s: float
    reserve_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"mesh": self.mesh, "device": self.device,
                "bandwidth_bytes_per_s": list(self.bandwidth_bytes_per_s),
                "latency_s": list(self.latency_s), "memory_bytes": self.memory_bytes,
                **({"reserve_bytes": self.reserve_bytes} if self.reserve_bytes else {}),
                "node_size": self.node_size, "in_node": list(self.in_node),
                "hbm_bandwidth_bytes_per_s": self.hbm_bandwidth_bytes_per_s}  # fmt: skip

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> ClusterInfo:
        return ClusterInfo(
            data["mesh"], data["device"], tuple(data["bandwidth_bytes_per_s"]),
            tuple(data["latency_s"]), data["memory_bytes"], data["node_size"],
            tuple(data["in_node"]), data["hbm_bandwidth_bytes_per_s"],
            int(data.get("reserve_bytes", 0)),
        )  # fmt: skip


@dataclass(frozen=True)
class SolverFigures:
    """`solver`: how the search ended. Only `status` is required: a plan written by hand for
    `autoshard report` may record no more."""

    status: str
    objective: float | None = None
    bound: float | None = None
    gap: float | None = None
    variables: int | None = None
    constraints: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "objective": self.objective, "bound": self.bound,
                "gap": self.gap, "variables": self.variables,
                "constraints": self.constraints}  # fmt: skip

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> SolverFigures:
        return SolverFigures(data["status"], data.get("objective"), data.get("bound"),
                             data.get("gap"), data.get("variables"),
                             data.get("constraints"))  # fmt: skip


@dataclass(frozen=True)
class RepeatedLayers:
    """`search.repeated_layers`: op `first_op + k*ops_per_layer + j` is op j of layer k."""

    first_op: int
    ops_per_layer: int
    layers: int

    def to_json(self) -> dict[str, Any]:
        return {"first_op": self.first_op, "ops_per_layer": self.ops_per_layer,
                "layers": self.layers}  # fmt: skip


@dataclass(frozen=True)
class Asked:
    """What the search was asked: `--why-not` asks it again. `annotations` stay as their JSON
    (`Annotation.to_json`): `parse_annotations` reads them, naming the plan in its errors."""

    objective: str
    time_limit: float
    annotations: tuple[Mapping[str, Any], ...]


@dataclass(frozen=True)
class SearchFigures:
    """`search`: the size of the search problem, its repeated layers and what it was asked
    (None in a plan made before the search recorded it)."""

    groups: int
    choices: int
    edges: int
    memory_rows: int
    repeated_layers: RepeatedLayers
    asked: Asked | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"groups": self.groups, "choices": self.choices,
                                "edges": self.edges, "memory_rows": self.memory_rows,
                                "repeated_layers": self.repeated_layers.to_json()}  # fmt: skip
        if self.asked is not None:
            data |= {"objective": self.asked.objective, "time_limit": self.asked.time_limit,
                     "annotations": list(self.asked.annotations)}  # fmt: skip
        return data

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> SearchFigures:
        layers = data["repeated_layers"]
        asked = (
            Asked(data["objective"], data["time_limit"], tuple(data["annotations"]))
            if "annotations" in data else None
        )  # fmt: skip
        return SearchFigures(
            data["groups"], data["choices"], data["edges"], data["memory_rows"],
            RepeatedLayers(layers["first_op"], layers["ops_per_layer"], layers["layers"]), asked,
        )  # fmt: skip


@dataclass(frozen=True)
class Timing:
    """`timing`: the wall-clock figures, the only part of a document that is not a function of
    its request."""

    build_s: float
    solve_s: float

    def to_json(self) -> dict[str, Any]:
        return {"build_s": self.build_s, "solve_s": self.solve_s}


@dataclass(frozen=True)
class WeightStrategy:
    """How a training step treats a weight (`training.strategy.weight_strategies`)."""

    stored: str
    used: str
    state: str
    strategy: str

    def to_json(self) -> dict[str, Any]:
        return {"stored": self.stored, "used": self.used, "state": self.state,
                "strategy": self.strategy}  # fmt: skip


BUFFERS_LISTED = 8
"""How many of its buffers a plan document names (a 70B decoder has one rotary table per layer;
the count says how many there are)."""


@dataclass(frozen=True)
class Strategy:
    """`strategy`: a training plan's weights by strategy (most first) and each weight's; and,
    where the step has any, its `buffers` (weights it does not train: `training.buffers`), their
    count and the first `BUFFERS_LISTED` names (`{"count": 80, "names": [...]}`)."""

    counts: Mapping[str, int]
    weights: Mapping[str, WeightStrategy]
    buffers: int = 0
    buffer_names: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        data = {"counts": dict(self.counts),
                "weights": {name: w.to_json() for name, w in self.weights.items()}}  # fmt: skip
        if self.buffers:
            data["buffers"] = {"count": self.buffers, "names": list(self.buffer_names)}
        return data

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> Strategy:
        weights, buffers = data.get("weights") or {}, data.get("buffers") or {}
        return Strategy(dict(data.get("counts") or {}), {
            name: WeightStrategy(w["stored"], w["used"], w["state"], w["strategy"])
            for name, w in weights.items()
        }, int(buffers.get("count") or 0), tuple(buffers.get("names") or ()))  # fmt: skip


@dataclass(frozen=True)
class Decisions:
    """What decides a plan: each op's sharding option (`ops`), how inputs and weights are held
    (`values`) and the training step planned (None: the forward pass); the rest follows from
    the rules (`plan_from_document`). A partition's manifest records them as its `plan`."""

    ops: Mapping[str, OpEntry]
    values: Mapping[str, HeldValue]
    training: Training | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "ops": {name: op.to_json() for name, op in self.ops.items()},
            "values": {name: v.to_json() for name, v in self.values.items()},
        }
        if self.training is not None:
            data["training"] = self.training.to_json()
        return data

    @staticmethod
    def from_json(data: Mapping[str, Any], source: str = "the plan") -> Decisions:
        try:
            return Decisions(
                {name: OpEntry.from_json(op) for name, op in (data.get("ops") or {}).items()},
                {name: HeldValue.from_json(v) for name, v in (data.get("values") or {}).items()},
                training_of(data, source),
            )
        except AutoshardError:  # a bad mesh, or training option: its own message
            raise
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise DocumentError(f"{source} is malformed: {error!r}") from None


def training_of(block: Mapping[str, Any], source: str = "the plan") -> Training | None:
    """The training step a plan (or manifest) decides, from its `training` block (None: the
    forward pass)."""
    training = block.get("training")
    if training is None:
        return None
    try:
        return Training.parse(**training)
    except TypeError as error:
        raise DocumentError(f"{source} has a malformed training block: {error}") from None
