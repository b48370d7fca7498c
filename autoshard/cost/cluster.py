"""The cluster a plan is priced on: a mesh whose axes have their own links, and a device kind.

    --mesh 4x8 --bandwidth 25GB/s,450GB/s --latency 5us,1us --device h100 --memory 16GiB

Axis 0 (4 nodes) talks over 25 GB/s links with 5 us latency, axis 1 (8 GPUs in a node) over
450 GB/s NVLink with 1 us. One value applies to every axis. A cluster file (JSON or YAML) holds
the same keys: {"mesh": "4x8", "bandwidth": ["25GB/s", "450GB/s"], "latency": "1us",
"device": "h100", "memory": "16GiB"}; command-line flags override the file.

Device presets are dense (no sparsity) peak FLOP/s and memory from the vendors' datasheets.
Bandwidth defaults to the device's scale-up link, per direction.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh


class ClusterError(AutoshardError, ValueError):
    """A bad cluster description: the message names the flag or key and the valid choices."""


@dataclass(frozen=True)
class DeviceKind:
    """Peak dense FLOP/s per dtype (others fall back to `default_flops`), memory, link."""

    name: str
    flops: Mapping[str, float]
    default_flops: float
    memory: int
    link_bandwidth: float
    link_latency: float = 1e-6

    def __post_init__(self) -> None:
        object.__setattr__(self, "flops", MappingProxyType(dict(self.flops)))

    def peak(self, dtype: str) -> float:
        return self.flops.get(dtype, self.default_flops)


GiB = 1 << 30
DEVICES = {
    # H100 SXM5: 989 TFLOP/s bf16/fp16 dense, 67 fp32 (494 tf32), 80 GB HBM3, NVLink 450 GB/s.
    "h100": DeviceKind(
        "NVIDIA H100 SXM5 80GB",
        {"bfloat16": 989e12, "float16": 989e12, "float8e4m3fn": 1979e12, "int8": 1979e12},
        67e12,
        80 * 10**9,
        450e9,
    ),
    # A100 SXM4: 312 TFLOP/s bf16/fp16, 19.5 fp32 (156 tf32), 80 GB, NVLink 300 GB/s.
    "a100": DeviceKind(
        "NVIDIA A100 SXM4 80GB",
        {"bfloat16": 312e12, "float16": 312e12, "int8": 624e12},
        19.5e12,
        80 * 10**9,
        300e9,
    ),
    # MI300X: 1307 TFLOP/s bf16/fp16 dense, 163.4 fp32, 192 GB HBM3, Infinity Fabric 448 GB/s.
    "mi300x": DeviceKind(
        "AMD Instinct MI300X",
        {"bfloat16": 1307e12, "float16": 1307e12, "int8": 2615e12},
        163.4e12,
        192 * 10**9,
        448e9,
    ),
    # TPU v5e: 197 TFLOP/s bf16, 16 GB HBM2e, ICI 400 GB/s (1600 Gbps) per chip.
    "tpu-v5e": DeviceKind(
        "Google TPU v5e", {"bfloat16": 197e12, "int8": 394e12}, 98.5e12, 16 * GiB, 200e9
    ),  # fmt: skip
    # L4: 121 TFLOP/s bf16/fp16 dense, 30.3 fp32, 24 GB, PCIe Gen4 x16 32 GB/s.
    "l4": DeviceKind(
        "NVIDIA L4", {"bfloat16": 121e12, "float16": 121e12}, 30.3e12, 24 * 10**9, 32e9
    ),
}
DEFAULT_DEVICE = "h100"


@dataclass(frozen=True)
class Cluster:
    """A mesh with per-axis link bandwidth (bytes/s) and latency (s), and its device kind."""

    mesh: Mesh
    device: DeviceKind = DEVICES[DEFAULT_DEVICE]
    bandwidth: tuple[float, ...] = ()
    latency: tuple[float, ...] = ()
    memory: int = 0  # the budget per device, bytes; 0 = the device's memory
    source: Mapping[str, object] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.mesh.shape)
        bandwidth = self.bandwidth or (self.device.link_bandwidth,)
        latency = self.latency or (self.device.link_latency,)
        object.__setattr__(self, "bandwidth", _per_axis(bandwidth, n, "bandwidth"))
        object.__setattr__(self, "latency", _per_axis(latency, n, "latency"))
        if not self.memory:
            object.__setattr__(self, "memory", self.device.memory)
        if any(b <= 0 for b in self.bandwidth):
            raise ClusterError(f"bandwidth must be positive, got {self.bandwidth}")
        if any(t < 0 for t in self.latency) or self.memory <= 0:
            raise ClusterError("latency must be >= 0 and memory > 0")

    def link(self, mesh_axes: Sequence[int]) -> tuple[float, float]:
        """(bandwidth, latency) of a group over `mesh_axes`: its slowest axis bounds a ring."""
        if not mesh_axes:
            return float("inf"), 0.0
        return min(self.bandwidth[a] for a in mesh_axes), max(self.latency[a] for a in mesh_axes)

    def to_json(self) -> dict[str, object]:
        return {
            "mesh": str(self.mesh),
            "device": self.device.name,
            "bandwidth_bytes_per_s": list(self.bandwidth),
            "latency_s": list(self.latency),
            "memory_bytes": self.memory,
        }


def _per_axis(values: Sequence[float], n: int, what: str) -> tuple[float, ...]:
    if len(values) == 1:
        return tuple(values) * n
    if len(values) != n:
        raise ClusterError(f"{len(values)} {what} values for a mesh of {n} axes; give 1 or {n}")
    return tuple(values)


# ---- quantities with units ---------------------------------------------------------------------

_SIZE_UNITS = {
    "": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}  # fmt: skip
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"


def parse_size(text: str, what: str = "memory") -> int:
    """`16GiB`, `80GB`, `512MiB`, `1e9` -> bytes."""
    match = re.fullmatch(_NUMBER + r"([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise ClusterError(
            f"{what} {text!r} is not a size like 16GiB or 80GB (units: B, KB, MB, GB, TB, KiB, "
            "MiB, GiB, TiB)"
        )
    value = float(match.group(1)) * _SIZE_UNITS[unit]
    if not math.isfinite(value):
        raise ClusterError(f"{what} {text!r} is not a finite size")
    return int(value)


def format_bytes(count: float) -> str:
    """`85312` -> `83.31 KiB`; below 1 KiB exact: `100 B`."""
    sign, count = ("-" if count < 0 else ""), abs(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{sign}{count:.0f} {unit}" if unit == "B" else f"{sign}{count:.2f} {unit}"
        count /= 1024
    return f"{sign}{count:.2f} TiB"


def parse_bandwidth(text: str) -> float:
    """`25GB/s`, `450 GB/s`, `100Gbit/s` -> bytes per second."""
    match = re.fullmatch(_NUMBER + r"([a-zA-Z]*)(?:/s)?\s*", str(text))
    unit = match.group(2).lower() if match else ""
    bits = unit.endswith("bit") or unit.endswith("bps")
    if bits:
        unit = unit.removesuffix("bit").removesuffix("bps") + "b"
    if not match or unit not in _SIZE_UNITS:
        raise ClusterError(f"bandwidth {text!r} is not like 25GB/s, 450GB/s or 100Gbit/s")
    value = float(match.group(1)) * _SIZE_UNITS[unit]
    if not math.isfinite(value):
        raise ClusterError(f"bandwidth {text!r} is not a finite rate")
    return value / 8 if bits else value


def parse_latency(text: str) -> float:
    """`5us`, `1.5ms`, `0` -> seconds."""
    match = re.fullmatch(_NUMBER + r"([a-zA-Zµ]*)\s*", str(text))
    unit = (match.group(2) or "s").lower() if match else ""
    if not match or unit not in _TIME_UNITS:
        raise ClusterError(f"latency {text!r} is not like 5us, 1ms or 0 (units: s, ms, us, ns)")
    return float(match.group(1)) * _TIME_UNITS[unit]


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
        raise ClusterError(f"cannot read cluster file {path}: {error.strerror}") from None
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
    known = {"mesh", "bandwidth", "latency", "device", "memory"}
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
    keys: dict[str, object] = dict(load_cluster_file(file)) if file else {}
    given = {"mesh": mesh, "device": device, "bandwidth": bandwidth, "latency": latency}
    keys |= {k: v for k, v in given.items() if v is not None}
    if memory is not None:
        keys["memory"] = memory
    if "mesh" not in keys:
        raise ClusterError("no mesh: give --mesh (e.g. 4x8) or a cluster file with a mesh key")
    name = str(keys.get("device", DEFAULT_DEVICE)).lower()
    if name not in DEVICES:
        raise ClusterError(f"unknown device {name!r}; presets: {', '.join(sorted(DEVICES))}")
    return Cluster(
        Mesh.parse(str(keys["mesh"])),
        DEVICES[name],
        tuple(parse_bandwidth(b) for b in _list(keys["bandwidth"])) if "bandwidth" in keys else (),
        tuple(parse_latency(t) for t in _list(keys["latency"])) if "latency" in keys else (),
        _budget(str(keys["memory"])) if "memory" in keys else 0,
        keys,
    )


def _budget(text: str) -> int:
    """A memory budget: a size above zero (0 would otherwise read as "the device's memory")."""
    size = parse_size(text)
    if size <= 0:
        raise ClusterError(f"memory {text!r} is no budget: give a size above 0, like 16GiB")
    return size
