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
ring crossing nodes is as slow as its slowest hop). So 4x8 H100 = 4 nodes of 8 (axis 0 at the
network's 50 GB/s, axis 1 at NVLink's 450 GB/s), 2x4 is one node, and a flat mesh of 16 is
two nodes, all of it at the network's speed.

Device presets are dense (no sparsity) peak FLOP/s, memory, HBM bandwidth and links from the
vendors' datasheets (cited at each), and the fractions of peak real kernels reach (typical
measured figures, not datasheet ones). A cluster file's `device` may instead describe a device
field by field, as `autoshard calibrate` writes it for the machine it measured. Link
bandwidths are per direction.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh


class ClusterError(AutoshardError, ValueError):
    """A bad cluster description: the message names the flag or key and the valid choices."""


class Transcendental(StrEnum):
    """The families of special functions an op evaluates per element, priced by their own
    rates (`DeviceKind.transcendental`). `int_pow` is a power by a constant 2 or 3: two
    multiplications, which some runtimes special-case without vectorizing (onnxruntime's CPU
    Pow: 4x slower than an Add)."""

    EXP = "exp"
    LOG = "log"
    ERF = "erf"
    TANH = "tanh"
    POW = "pow"
    INT_POW = "int_pow"
    SQRT = "sqrt"
    TRIG = "trig"


@dataclass(frozen=True)
class DeviceKind:
    """A device and the node it comes in.

    flops: peak dense FLOP/s of its matrix units per dtype; `default_flops` is the vector
    (non-tensor-core) rate, used for other dtypes and for every op that is not a contraction.
    hbm_bandwidth: bytes/s of its memory. matmul_efficiency / memory_efficiency: the fraction
    of those peaks a large matmul / a streaming kernel reaches. matmul_half_dim: the matmul
    dim at which a kernel reaches half its large-shape efficiency (`cost.model`). launch_s:
    the shortest time a kernel takes. node_size devices share the scale-up link
    (`link_bandwidth`, `link_latency`); nodes talk over the network (`network_bandwidth`,
    `network_latency`), per device. transcendental: evaluations per second of each family of
    special functions (`cost.model.Transcendental`: "exp", "erf", ...) where measured; a
    family not listed runs at `default_flops` over the instructions it takes
    (`cost.model.TRANSCENDENTAL_FLOPS`). cache_bytes, cache_bandwidth: an op moving at most
    cache_bytes streams from a cache at cache_bandwidth instead (0: not modelled; CPUs, whose
    last-level cache holds the activations a small forward passes from op to op, and GPUs'
    L2, where what the last kernel wrote is read by the next).
    misaligned_efficiency: what a matmul with a dim off 16-byte alignment keeps of its rate.
    strided_efficiency, transpose_efficiency: what a memory-bound kernel keeps of the
    streaming rate when it reads an operand broadcast or out of its result's order, and when
    that order moves the innermost axis (`cost.model.access`; 1: not modelled).
    matmul_cache_bytes, matmul_cache_speedup: a matmul whose operands and result fit in
    matmul_cache_bytes runs matmul_cache_speedup times faster (0, 1: not modelled; CPUs'
    private caches). pack_bandwidth: bytes/s at which a matmul re-lays out its second operand
    on every call (0: it does not; CPU BLAS packing).
    """

    name: str
    flops: Mapping[str, float]
    default_flops: float
    memory: int
    link_bandwidth: float
    link_latency: float = 1e-6
    hbm_bandwidth: float = 2e12
    matmul_efficiency: float = 0.8
    memory_efficiency: float = 0.85
    matmul_half_dim: int = 64
    launch_s: float = 2e-6
    node_size: int = 8
    network_bandwidth: float = 50e9
    network_latency: float = 5e-6
    link_name: str = "NVLink"
    transcendental: Mapping[str, float] = field(default_factory=dict)
    cache_bytes: int = 0
    cache_bandwidth: float = 0.0
    misaligned_efficiency: float = 0.5
    strided_efficiency: float = 1.0
    transpose_efficiency: float = 1.0
    matmul_cache_bytes: int = 0
    matmul_cache_speedup: float = 1.0
    pack_bandwidth: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "flops", MappingProxyType(dict(self.flops)))
        object.__setattr__(self, "transcendental", MappingProxyType(dict(self.transcendental)))

    def peak(self, dtype: str) -> float:
        return self.flops.get(dtype, self.default_flops)


GiB = 1 << 30
DEVICES = {
    # H100 SXM5 datasheet: 989 TFLOP/s bf16/fp16 dense (1979 fp8/int8), 67 fp32 (non-tensor),
    # 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s bidirectional = 450 per direction. DGX H100:
    # 8 GPUs, one ConnectX-7 400 Gb/s NIC each = 50 GB/s. cuBLAS bf16 GEMMs of 8192^3 reach
    # ~0.8 of peak; a streaming copy ~0.85 of HBM bandwidth. Measured on an H100 80GB HBM3
    # (torch 2.11 eager kernels, bfloat16, CUDA graphs: bench/kernel_access.py and
    # `autoshard calibrate --torch`): a matmul with a dim off alignment (4096x4096x4095) runs
    # at 0.19 of 4096^3's rate (cuBLAS's fallback kernels); an elementwise kernel reading an
    # operand broadcast (a bias, a mask, a norm's divisor) or permuted at 0.47-0.55 of a
    # contiguous Add's bytes per second, a transpose moving the innermost axis at 0.17; an op
    # moving at most half the 50 MB L2 (what its producer just wrote stays there) at 7.6-8.5
    # TB/s. The fidelity of this preset against those kernels: bench/data/h100.
    "h100": DeviceKind(
        "NVIDIA H100 SXM5 80GB",
        {"bfloat16": 989e12, "float16": 989e12, "float8e4m3fn": 1979e12, "int8": 1979e12},
        67e12,
        80 * 10**9,
        450e9,
        hbm_bandwidth=3.35e12,
        matmul_efficiency=0.8,
        memory_efficiency=0.85,
        misaligned_efficiency=0.2,
        strided_efficiency=0.5,
        transpose_efficiency=0.17,
        cache_bytes=25 << 20,
        cache_bandwidth=8e12,
    ),
    # A100 SXM4 80GB datasheet: 312 TFLOP/s bf16/fp16 (624 int8), 19.5 fp32, HBM2e at
    # 2.039 TB/s, NVLink 3 600 GB/s bidirectional = 300 per direction. DGX A100: 8 GPUs, one
    # ConnectX-6 200 Gb/s HDR NIC each = 25 GB/s. cuBLAS reaches ~0.85 of peak.
    "a100": DeviceKind(
        "NVIDIA A100 SXM4 80GB",
        {"bfloat16": 312e12, "float16": 312e12, "int8": 624e12},
        19.5e12,
        80 * 10**9,
        300e9,
        hbm_bandwidth=2.039e12,
        matmul_efficiency=0.85,
        network_bandwidth=25e9,
    ),
    # MI300X datasheet: 1307 TFLOP/s bf16/fp16 dense (2615 int8), 163.4 fp32, 192 GB HBM3 at
    # 5.3 TB/s, Infinity Fabric 7 links x 64 GB/s = 448 GB/s per GPU. 8-GPU OAM platform with
    # a 400 Gb/s NIC per GPU = 50 GB/s. hipBLASLt bf16 GEMMs reach ~0.6 of peak, copies ~0.8
    # of HBM bandwidth.
    "mi300x": DeviceKind(
        "AMD Instinct MI300X",
        {"bfloat16": 1307e12, "float16": 1307e12, "int8": 2615e12},
        163.4e12,
        192 * 10**9,
        448e9,
        hbm_bandwidth=5.3e12,
        matmul_efficiency=0.6,
        memory_efficiency=0.8,
        link_name="Infinity Fabric",
    ),
    # TPU v5e (Google Cloud docs): 197 TFLOP/s bf16 (394 int8), 16 GB HBM2e at 819 GB/s, ICI
    # 1600 Gbps per chip; a pod is 256 chips on ICI. Between slices (DCN) no per-chip figure is
    # published: 25 GB/s is an assumption, give --bandwidth for a multislice job.
    "tpu-v5e": DeviceKind(
        "Google TPU v5e",
        {"bfloat16": 197e12, "int8": 394e12},
        98.5e12,
        16 * GiB,
        200e9,
        hbm_bandwidth=819e9,
        matmul_efficiency=0.85,
        node_size=256,
        network_bandwidth=25e9,
        link_name="ICI",
    ),
    # L4 datasheet: 121 TFLOP/s bf16/fp16 dense, 30.3 fp32, 24 GB GDDR6 at 300 GB/s, PCIe
    # Gen4 x16 (~32 GB/s per direction). A g2-standard-96 node holds 8 L4s on PCIe and one
    # 100 Gb/s NIC shared by the 8 = 1.5625 GB/s per GPU. At 72 W it clocks down: ~0.7 of peak.
    "l4": DeviceKind(
        "NVIDIA L4",
        {"bfloat16": 121e12, "float16": 121e12},
        30.3e12,
        24 * 10**9,
        32e9,
        hbm_bandwidth=300e9,
        matmul_efficiency=0.7,
        network_bandwidth=12.5e9 / 8,
        link_name="PCIe",
    ),
}
DEFAULT_DEVICE = "h100"
CLUSTERS = {"dgx-h100": "h100", "dgx-a100": "a100", "mi300x-8": "mi300x",
            "tpu-v5e-256": "tpu-v5e", "g2-l4-8": "l4"}  # fmt: skip
"""`--cluster NAME`: the node each device preset describes (node size, scale-up link, NIC)."""


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
            object.__setattr__(self, "memory", self.device.memory)
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
            "node_size": self.device.node_size,
            "in_node": list(self.in_node),
            "hbm_bandwidth_bytes_per_s": self.device.hbm_bandwidth,
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


def format_seconds(seconds: float) -> str:
    """Three significant digits in the unit that fits: `0.00128` -> `1.28 ms`."""
    sign, seconds = ("-" if seconds < 0 else ""), abs(seconds)
    if seconds == 0:
        return "0 s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if seconds >= scale or unit == "ns":
            return f"{sign}{seconds / scale:.3g} {unit}"
    raise AssertionError  # pragma: no cover


def format_rate(bytes_per_s: float) -> str:
    """`450e9` -> `450 GB/s` (decimal units, like the datasheets)."""
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.4g} {unit}"
    return f"{bytes_per_s:.4g} B/s"


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
                         "matmul_cache_bytes"):  # fmt: skip
                values[key] = int(value)
            else:
                values[key] = float(value)
    except (TypeError, ValueError) as error:
        raise ClusterError(f"device key {key!r} has a bad value {value!r}: {error}") from None
    families = [str(f) for f in Transcendental]
    if bad := sorted(set(values.get("transcendental", {})) - set(families)):
        raise ClusterError(f"unknown transcendental families {bad}; valid: {families}")
    # times, and a cache not modelled, may be 0; the rest may not
    times = ("launch_s", "link_latency", "network_latency", "cache_bytes", "cache_bandwidth",
             "matmul_cache_bytes", "pack_bandwidth")  # fmt: skip
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
