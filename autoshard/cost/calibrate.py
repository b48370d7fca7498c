"""`autoshard calibrate`: measure the device this process runs on and describe it as a cluster
file that `autoshard plan --cluster FILE` reads.

What it measures, with numpy on the CPU (the kernels a CPU run of a plan would use):

- matmul throughput: float32 `A @ B` over square and thin shapes, the best of several runs
  each; fitted to the roofline's contraction model, rate = E · s(M) s(N) s(K) with
  s(d) = d / (d + h) (`cost.model`): h by a search over a grid minimising the squared error of
  log rates, E then in closed form (the mean of log rate - Σ log s). E becomes the device's
  float32 peak at efficiency 1, h its `matmul_half_dim`.
- memory bandwidth: `np.copyto` of a large array, read + written bytes over the best time.
- launch floor: the median time of `np.add` on one element (the per-op overhead).
- memory: the machine's physical memory.

What it does not measure: links. Processes on one host exchange data through its memory, so
the file gives the scale-up link the measured copy rate and calls the host one node; a
multi-host cluster needs `--bandwidth`/`--latency` (or the file's keys) from elsewhere.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SQUARE = (256, 512, 1024, 2048)
THIN = ((2048, 32, 2048), (2048, 2048, 32), (32, 2048, 2048), (2048, 128, 2048))
HALF_DIMS = tuple(range(1, 513))


@dataclass(frozen=True)
class Calibration:
    """The measurements: per matmul shape (M, K, N) its FLOP/s, the fit, copy and launch."""

    matmul: tuple[tuple[tuple[int, int, int], float], ...]
    peak: float
    half_dim: int
    copy_bandwidth: float
    launch_s: float
    memory: int

    def device(self, name: str) -> dict[str, object]:
        """The cluster file's `device` (`cost.cluster.device_kind` reads it)."""
        cores = os.cpu_count() or 1
        return {
            "name": name,
            "flops": {"float32": self.peak},
            "default_flops": self.peak,
            "memory": self.memory,
            "hbm_bandwidth": self.copy_bandwidth,
            "matmul_efficiency": 1.0,
            "memory_efficiency": 1.0,
            "matmul_half_dim": self.half_dim,
            "launch_s": self.launch_s,
            "link_bandwidth": self.copy_bandwidth,
            "link_latency": self.launch_s,
            "node_size": cores,
            "network_bandwidth": self.copy_bandwidth,
            "network_latency": self.launch_s,
            "link_name": "host memory",
        }

    def to_json(self) -> dict[str, object]:
        """The cluster file: the measured device, and the raw figures under `calibration`."""
        name = f"{processor_name()} (calibrated, numpy float32)"
        return {
            "device": self.device(name),
            "calibration": {
                "matmul_flops": [
                    {"m": m, "k": k, "n": n, "flops_per_s": rate} for (m, k, n), rate in self.matmul
                ],
                "copy_bytes_per_s": self.copy_bandwidth,
                "launch_s": self.launch_s,
                "links": "not measured: one host, the copy rate",
            },
        }


def best_time(run: Callable[[], object], repeats: int, budget: float = 0.05) -> float:
    """The fastest of at least `repeats` runs, and of as many as fit in `budget` seconds: on a
    shared machine the best run is the one least disturbed."""
    run()  # warm up: first-touch pages, thread pools
    times: list[float] = []
    spent = 0.0
    while len(times) < repeats or spent < budget:
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
        spent += times[-1]
    return min(times)


def processor_name() -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fit_half_dim(
    rates: Sequence[tuple[tuple[int, int, int], float]],
) -> tuple[float, int]:
    """(E, h) minimising Σ (log rate - log E - Σ log s(d))² over the grid of h (see the module's
    docstring); E in closed form for each h."""
    best: tuple[float, float, int] | None = None
    for h in HALF_DIMS:
        residuals = [
            math.log(rate) - sum(math.log(d / (d + h)) for d in shape) for shape, rate in rates
        ]
        log_e = statistics.fmean(residuals)
        error = sum((r - log_e) ** 2 for r in residuals)
        if best is None or error < best[0] - 1e-12:
            best = (error, math.exp(log_e), h)
    assert best is not None
    return best[1], best[2]


def calibrate(quick: bool = False, progress: Callable[[str], None] = lambda _: None) -> Calibration:
    """Measure this machine (`quick`: smaller shapes and fewer runs, a second or two)."""
    repeats = 3 if quick else 5
    scale = 2 if quick else 1  # quick: half the dims, an eighth of the work
    shapes = [(d // scale,) * 3 for d in SQUARE] + [
        (m // scale, k // scale, n // scale) for m, k, n in THIN
    ]
    rng = np.random.default_rng(0)
    rates: list[tuple[tuple[int, int, int], float]] = []
    for i, (m, k, n) in enumerate(shapes, 1):
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        seconds = best_time(functools.partial(np.matmul, a, b), repeats)
        rates.append(((m, k, n), 2 * m * k * n / seconds))
        progress(f"matmul {m}x{k}x{n}: {rates[-1][1] / 1e9:.1f} GFLOP/s ({i}/{len(shapes)})")
    peak, half = fit_half_dim(rates)
    progress(f"matmul fit: {peak / 1e9:.1f} GFLOP/s at large shapes, half speed at dim {half}")
    size = (16 if quick else 256) << 20
    src, dst = np.ones(size // 4, np.float32), np.empty(size // 4, np.float32)
    copy = 2 * size / best_time(lambda: np.copyto(dst, src), repeats)
    progress(f"memory: {copy / 1e9:.1f} GB/s (copy of {size >> 20} MiB, read + written)")
    one = np.ones(1, np.float32)
    launches = []
    for _ in range(200 if quick else 2000):
        started = time.perf_counter()
        np.add(one, one)
        launches.append(time.perf_counter() - started)
    launch = statistics.median(launches)
    progress(f"launch floor: {launch * 1e6:.2f} us per op")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Calibration(tuple(rates), peak, half, copy, launch, memory)
