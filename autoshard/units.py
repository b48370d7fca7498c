"""Sizes, rates and times as people write them: parsed from flags and cluster files
(`16GiB`, `450GB/s`, `5us`) and formatted for summaries, in one place."""

from __future__ import annotations

import math
import re

from autoshard.errors import ClusterError

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
    """Three significant digits in the unit that fits: `0.00128` -> `1.28 ms`. The unit is
    chosen after rounding, so `0.99999` is `1 s`, not `1e+03 ms`."""
    sign, seconds = ("-" if seconds < 0 else ""), float(f"{abs(seconds):.3g}")
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


def in_units(amount: float, unit: str) -> str:
    """An objective's value as progress shows it, in the unit that reads: `1.28 ms`,
    `83.31 KiB` (`unit`: `s` or `B`, as `Progress.unit`)."""
    return format_bytes(amount) if unit == "B" else format_seconds(amount)
