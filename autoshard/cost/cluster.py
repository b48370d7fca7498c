"""The cluster a plan is priced on: a mesh whose axes have their own links, and a device kind.

    --mesh 4x8 --bandwidth 50GB/s,450GB/s --latency 5us,1us --device h100 --memory 16GiB

Axis 0 (4 nodes) talks over 50 GB/s network links with 5 us latency, axis 1 (8 GPUs in a node)
over 450 GB/s NVLink with 1 us. One value applies to every axis. A cluster file (JSON or YAML)
holds the same keys: {"mesh": "4x8", "bandwidth": ["50GB/s", "450GB/s"], "latency": "1us",
"device": "h100", "memory": "16GiB"}; command-line flags override the file. `--cluster` also
takes a preset name (`dgx-h100`, ...: `CLUSTERS`), the node its device preset describes.

Default links: a mesh's last axis is the scale-up domain (NVLink within a node), outer axes the
scale-out network, as a job is laid out on nodes of `node_size` devices: walking the axes from
the last, an axis whose devices together with the inner axes' fit in one node
(cumulative size <= node_size) runs on the scale-up link, every other axis on the network (a
device's share of its node's NICs). So 4x8 H100 = 4 nodes of 8 (axis 0 at the network's
50 GB/s, axis 1 at NVLink's 450 GB/s), 2x4 is one node, and a flat mesh of 16 is two nodes,
its axis on the network. A collective across nodes is priced as NCCL runs it, over every NIC
of a node and NVLink within (`stages`, `cost.price.collective_time`).

Without `memory`, a device's budget is its memory less its `reserve` (the CUDA context, NCCL's
buffers, fragmentation); a `memory` given is the tensors' budget, nothing held back.

Device presets are dense (no sparsity) peak FLOP/s, memory, HBM bandwidth and links from the
vendors' datasheets (cited at each), and the fractions of peak real kernels reach (typical
measured figures, not datasheet ones). A cluster file's `device` may instead describe a device
field by field, as `autoshard calibrate` writes it for the machine it measured. Link
bandwidths are per direction.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoshard.cost.devices import CLUSTERS, DEFAULT_DEVICE, DEVICES, DeviceKind, Transcendental
from autoshard.errors import ClusterError
from autoshard.mesh import Mesh
from autoshard.units import (
    format_bytes,
    format_rate,
    parse_bandwidth,
    parse_latency,
    parse_size,
)


@dataclass(frozen=True)
class Cluster:
    """A mesh with per-axis link bandwidth (bytes/s) and latency (s), and its device kind."""

    mesh: Mesh
    device: DeviceKind = DEVICES[DEFAULT_DEVICE]
    bandwidth: tuple[float, ...] = ()
    latency: tuple[float, ...] = ()
    memory: int = 0  # the budget per device, bytes; 0 = the device's memory less its reserve
    source: Mapping[str, object] = field(default_factory=dict, compare=False, repr=False)
    reserve: int = field(init=False, default=0, compare=False, repr=False)
    """What the budget leaves of the device's memory to what is no tensor (`DeviceKind.reserve`)
    when no budget was given; 0 when one was (it is then the tensors' budget)."""

    def __post_init__(self) -> None:
        n = len(self.mesh.shape)
        in_node, device = self.in_node, self.device
        bandwidth = self.bandwidth or tuple(
            device.link_bandwidth if inside else device.network_bandwidth for inside in in_node
        )
        latency = self.latency or tuple(
            device.link_latency if inside else device.network_latency for inside in in_node
        )
        object.__setattr__(self, "bandwidth", _per_axis(bandwidth, n, "bandwidth"))
        object.__setattr__(self, "latency", _per_axis(latency, n, "latency"))
        if not self.memory:
            object.__setattr__(self, "reserve", device.reserve)
            object.__setattr__(self, "memory", device.memory - device.reserve)
        if any(b <= 0 for b in self.bandwidth):
            raise ClusterError(f"bandwidth must be positive, got {self.bandwidth}")
        if any(t < 0 for t in self.latency) or self.memory <= 0:
            raise ClusterError("latency must be >= 0 and memory > 0")

    @property
    def in_node(self) -> tuple[bool, ...]:
        """Per mesh axis: inside one node (the scale-up link) rather than across nodes. From
        the last axis out, an axis is in a node while the devices of it and of the axes
        inside it fit in one (the module's docstring)."""
        inside, fits = 1, []
        for size in reversed(self.mesh.shape):
            inside *= size
            fits.append(inside <= self.device.node_size)
        return tuple(reversed(fits))

    def describe_links(self) -> list[str]:
        """One line per mesh axis: its bandwidth, latency and which link the default is."""
        return [
            f"axis {a} ({size}): {format_rate(b)}, {t * 1e6:.3g} us "
            f"({self.device.link_name + ' in a node' if inside else 'network across nodes'})"
            for a, (size, b, t, inside) in enumerate(
                zip(self.mesh.shape, self.bandwidth, self.latency, self.in_node, strict=True)
            )
        ]

    def describe_budget(self) -> str:
        """The memory budget per device, and the reserve it leaves where it is the default."""
        text = f"memory budget {format_bytes(self.memory)} per device"
        if self.reserve:
            text += (
                f" ({format_bytes(self.device.memory)} - {format_bytes(self.reserve)} reserve: "
                "CUDA context, NCCL buffers, allocator fragmentation)"
            )
        return text

    def link(self, mesh_axes: Sequence[int]) -> tuple[float, float]:
        """(bandwidth, latency) of a group over `mesh_axes`: its slowest axis bounds a ring."""
        if not mesh_axes:
            return float("inf"), 0.0
        return min(self.bandwidth[a] for a in mesh_axes), max(self.latency[a] for a in mesh_axes)

    def stages(self, mesh_axes: Sequence[int]) -> Stages:
        """How a group over `mesh_axes` sits on the nodes (`Stages`)."""
        inner = [a for a in mesh_axes if self.in_node[a]]
        outer = [a for a in mesh_axes if not self.in_node[a]]
        per_node, nodes = _spread(self.mesh.shape, tuple(sorted(mesh_axes)), self.device.node_size)
        inside = (
            (min(self.bandwidth[a] for a in inner), max(self.latency[a] for a in inner))
            if inner
            else (self.device.link_bandwidth, self.device.link_latency)
        )
        across = (
            (min(self.bandwidth[a] for a in outer), max(self.latency[a] for a in outer))
            if outer
            else inside
        )
        return Stages(per_node, nodes, *inside, *across)

    def to_json(self) -> dict[str, object]:
        return {
            "mesh": str(self.mesh),
            "device": self.device.name,
            "bandwidth_bytes_per_s": list(self.bandwidth),
            "latency_s": list(self.latency),
            "memory_bytes": self.memory,
            **({"reserve_bytes": self.reserve} if self.reserve else {}),
            "node_size": self.device.node_size,
            "in_node": list(self.in_node),
            "hbm_bandwidth_bytes_per_s": self.device.hbm_bandwidth,
        }


@dataclass(frozen=True)
class Stages:
    """A group of devices as NCCL sees it: `per_node` of its devices in each of `nodes` nodes,
    the in-node link (`inside_bandwidth`, `inside_latency`: the group's slowest in-node axis,
    the device's scale-up link when none of its axes is in a node) and each device's share of
    its node's NICs (`across_bandwidth`, `across_latency`: the group's slowest axis across
    nodes). A group within one node has nodes == 1."""

    per_node: int
    nodes: int
    inside_bandwidth: float
    inside_latency: float
    across_bandwidth: float
    across_latency: float


@functools.lru_cache(maxsize=4096)
def _spread(shape: tuple[int, ...], axes: tuple[int, ...], node_size: int) -> tuple[int, int]:
    """(devices per node, nodes) of the groups over `axes` of a mesh laid out in row-major
    order on nodes of `node_size` consecutive devices: the fewest devices any group has in one
    of its nodes, and the most nodes any group spans (counted, so meshes that do not divide
    into nodes evenly are right too)."""
    strides = [math.prod(shape[a + 1 :]) for a in range(len(shape))]
    others = [a for a in range(len(shape)) if a not in axes]
    fewest, most = math.prod(shape[a] for a in axes), 1
    for fixed in itertools.product(*(range(shape[a]) for a in others)):
        base = sum(i * strides[a] for i, a in zip(fixed, others, strict=True))
        counts: dict[int, int] = {}
        for moving in itertools.product(*(range(shape[a]) for a in axes)):
            device = base + sum(i * strides[a] for i, a in zip(moving, axes, strict=True))
            counts[device // node_size] = counts.get(device // node_size, 0) + 1
        fewest, most = min(fewest, *counts.values()), max(most, len(counts))
    return fewest, most


def _per_axis(values: Sequence[float], n: int, what: str) -> tuple[float, ...]:
    if len(values) == 1:
        return tuple(values) * n
    if len(values) != n:
        raise ClusterError(f"{len(values)} {what} values for a mesh of {n} axes; give 1 or {n}")
    return tuple(values)


# ---- quantities with units ---------------------------------------------------------------------


def _list(value: object) -> list[str]:
    if isinstance(value, list | tuple):
        return [str(v) for v in value]
    return [v.strip() for v in str(value).split(",")]


def load_cluster_file(path: str | Path) -> dict[str, object]:
    """The keys of a JSON or YAML cluster file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ClusterError(
            f"cannot read cluster file {path}: {error.strerror} (presets: {', '.join(CLUSTERS)})"
        ) from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as error:  # yaml and json raise their own error types
        raise ClusterError(f"cluster file {path} is not valid JSON/YAML: {error}") from None
    if not isinstance(data, dict):
        raise ClusterError(f"cluster file {path} must hold a mapping of keys")
    known = {"mesh", "bandwidth", "latency", "device", "memory", "calibration"}
    if unknown := sorted(set(data) - known):
        raise ClusterError(f"unknown key(s) {unknown} in {path}; valid: {sorted(known)}")
    return data


def make_cluster(
    mesh: str | None = None,
    device: str | None = None,
    bandwidth: str | Sequence[str] | None = None,
    latency: str | Sequence[str] | None = None,
    memory: str | None = None,
    file: str | Path | None = None,
) -> Cluster:
    """A cluster from flag values, over the keys of a cluster file if given."""
    keys: dict[str, object] = {}
    if file and str(file) in CLUSTERS and not Path(file).exists():
        keys["device"] = CLUSTERS[str(file)]
    elif file:
        keys = dict(load_cluster_file(file))
    given = {"mesh": mesh, "device": device, "bandwidth": bandwidth, "latency": latency}
    keys |= {k: v for k, v in given.items() if v is not None}
    if memory is not None:
        keys["memory"] = memory
    if "mesh" not in keys:
        raise ClusterError("no mesh: give --mesh (e.g. 4x8) or a cluster file with a mesh key")
    return Cluster(
        Mesh.parse(str(keys["mesh"])),
        device_kind(keys.get("device", DEFAULT_DEVICE)),
        tuple(parse_bandwidth(b) for b in _list(keys["bandwidth"])) if "bandwidth" in keys else (),
        tuple(parse_latency(t) for t in _list(keys["latency"])) if "latency" in keys else (),
        _budget(str(keys["memory"])) if "memory" in keys else 0,
        keys,
    )


def recorded_flags(recorded: Mapping[str, Any]) -> dict[str, str] | None:
    """The flags (`device`, `bandwidth`, `latency`, `memory`) that make again a cluster as
    `Cluster.to_json` recorded it, each only where it differs from the preset's default; None
    when its device is no preset (a calibrated or described one: give its file again).

    A plan made with `--memory 2GiB` on an H100 gives {"memory": "2147483648"}."""
    device = next((k for k, kind in DEVICES.items() if kind.name == recorded.get("device")), None)
    if device is None or "mesh" not in recorded:
        return None
    preset = make_cluster(str(recorded["mesh"]), device).to_json()
    flags = {} if device == DEFAULT_DEVICE else {"device": device}
    for flag, key, unit in (
        ("bandwidth", "bandwidth_bytes_per_s", "B/s"),
        ("latency", "latency_s", "s"),
    ):
        if recorded.get(key) != preset[key]:
            flags[flag] = ",".join(f"{v!r}{unit}" for v in recorded.get(key) or ())
    if recorded.get("memory_bytes") != preset["memory_bytes"]:
        flags["memory"] = str(recorded.get("memory_bytes"))
    return flags


def device_kind(spec: object) -> DeviceKind:
    """A preset's name, or a device described field by field (what `autoshard calibrate`
    writes: `{"name": ..., "flops": {"float32": 1e12}, "default_flops": ..., ...}`)."""
    if not isinstance(spec, Mapping):
        name = str(spec).lower()
        if name not in DEVICES:
            raise ClusterError(f"unknown device {name!r}; presets: {', '.join(sorted(DEVICES))}")
        return DEVICES[name]
    fields = {f.name: f for f in dataclasses.fields(DeviceKind)}
    if unknown := sorted(set(spec) - set(fields)):
        raise ClusterError(f"unknown device key(s) {unknown}; valid: {sorted(fields)}")
    required = [
        n
        for n, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    required.append("hbm_bandwidth")  # its default is a placeholder, not this device's
    if missing := [n for n in required if n not in spec]:
        raise ClusterError(f"device is missing {missing}; a described device needs {required}")
    values: dict[str, Any] = {}
    try:
        for key, value in spec.items():
            if key in ("name", "link_name"):
                values[key] = str(value)
            elif key in ("flops", "transcendental"):
                values[key] = {str(d): float(v) for d, v in dict(value).items()}
            elif key in ("memory", "matmul_half_dim", "node_size", "cache_bytes",
                         "matmul_cache_bytes", "reserve"):  # fmt: skip
                values[key] = int(value)
            else:
                values[key] = float(value)
    except (TypeError, ValueError) as error:
        raise ClusterError(f"device key {key!r} has a bad value {value!r}: {error}") from None
    families = [str(f) for f in Transcendental]
    if bad := sorted(set(values.get("transcendental", {})) - set(families)):
        raise ClusterError(f"unknown transcendental families {bad}; valid: {families}")
    # times, and a cache or flash-attention kernel not modelled, may be 0; the rest may not
    times = ("launch_s", "link_latency", "network_latency", "cache_bytes", "cache_bandwidth",
             "matmul_cache_bytes", "pack_bandwidth", "attention_efficiency",
             "attention_backward_efficiency", "reserve")  # fmt: skip
    rates = [*values["flops"].values(), *values.get("transcendental", {}).values()] + [
        v
        for k, v in values.items()
        if k not in ("name", "link_name", "flops", "transcendental", *times)
    ]
    if any(v <= 0 for v in rates) or any(values.get(k, 0) < 0 for k in times):
        raise ClusterError(
            f"device {values['name']!r}: rates, sizes and efficiencies must be > 0, times >= 0"
        )
    return DeviceKind(**values)


def _budget(text: str) -> int:
    """A memory budget: a size above zero (0 would otherwise read as "the device's memory")."""
    size = parse_size(text)
    if size <= 0:
        raise ClusterError(f"memory {text!r} is no budget: give a size above 0, like 16GiB")
    return size
