"""`autoshard calibrate`: measure the device this process runs on and describe it as a cluster
file that `autoshard plan --cluster FILE` reads.

What it measures, with the kernels a plan's program runs on (`cost.probes`): onnxruntime on
the CPU in float32 (how `autoshard run` and `verify` execute it), or torch (`--torch`: bfloat16
kernels on CUDA, bursts of them in CUDA graphs timed with CUDA events; float32 on the CPU),
each time the median of several runs on CUDA, the fastest on a CPU (`cost.probes`):

- matmul throughput: `A @ B` over square and thin shapes (on CUDA also 4096^3 and 8192^3,
  where a GPU reaches its peak, and a transformer layer's shapes, `LAYERS`); fitted to the
  roofline's contraction model,
  rate = E · s(M) s(N) s(K) with s(d) = d / (d + h) (`cost.compute`): h by a search over a grid
  minimising the squared error of log rates, E then in closed form (the mean of
  log rate - Σ log s). E becomes the device's peak for that dtype at efficiency 1, h its
  `matmul_half_dim`. On a CPU the shapes whose operands and result fit in its caches get
  their own E (small matmuls run from the caches at several times the rate): the ratio is
  `matmul_cache_speedup`, the largest working set that still runs fast (chosen by the fit,
  `fit_packing`) `matmul_cache_bytes`. onnxruntime's CPU matmul packs B on every call, a
  pass over its bytes at `pack_bandwidth`, fitted with the rest (on thin shapes packing takes
  as long as the multiplication). On CUDA the fit takes the launch floor off each time and
  leaves out shapes its setup or their bytes bound (`kernel_rates`), so only the shapes that
  tell the tensor cores' rate remain. A 1024x1024x1023 matmul against 1024^3 (on CUDA
  4096x4096x4095 against 4096^3) gives `misaligned_efficiency`.
- the vector rate (every op but a contraction): on CUDA a float32 matmul without TF32 (the
  FMA units); on a CPU a Softmax in the cache at the 5 flops an element the model counts for
  it (what onnxruntime's softmax and normalization kernels reach, well below the matmul's
  FMA rate).
- memory bandwidth: an elementwise Add of two large arrays, the bytes read + written over the
  time.
- access: an Add of a row to rows (an operand read broadcast) and a transpose moving the
  innermost axis, each against that Add's bytes per second: `strided_efficiency` and
  `transpose_efficiency` (`cost.compute.access`).
- cache: the same Add with a working set of a quarter of half the last-level cache (on CUDA
  the L2), less the launch floor: the rate of an op moving at most half that cache (the rate
  stays flat up to about half the cache and is several times the rate from memory).
- launch floor: the same Add on one element (the shortest time a kernel takes).
- special functions: per family (exp, log, erf, tanh, pow, sqrt, trig:
  `cost.cluster.Transcendental`), evaluations per second of one op over an array the cache
  holds (64 Ki elements on a CPU, 4 Mi on a GPU: the function's rate, not the memory's),
  less the launch floor (Exp, Log, Erf, Tanh, Pow by 1.7, Sqrt, Sin): the device's
  `transcendental` rates, which the roofline takes where they bound an op
  (`cost.compute.special_rate`).
- fused attention (CUDA): torch's `scaled_dot_product_attention`, causal, at a 7B layer's
  shape (`ATTENTION`), forward and backward (forward and backward less the forward): its
  FLOPs as the cost model counts them (`cost.attention.attention_flops`) over its time, against
  the matmul peak, become `attention_efficiency` and `attention_backward_efficiency` (0 on a
  CPU: no flash kernel).
- memory: the machine's physical memory, or the GPU's.
- on a GPU with FP8 tensor cores (compute capability 8.9 and up), an e4m3 matmul of 8192^3
  with a bf16 result (`torch._scaled_mm`, as Float8Linear runs it): its rate over the bf16
  fit's s(M) s(N) s(K) is the device's `float8_e4m3fn` peak (`fp8_peak`).
- on a GPU, the reserve: what the process holds outside torch's allocator once the probes
  ran (the CUDA context, the kernels' modules, cuBLAS's workspace), plus NCCL's and the
  fragmentation's shares of `cost.devices.gpu_reserve`.

- links (`autoshard.run.measure`, with torch): all_gather, all_reduce, reduce_scatter and
  all_to_all over N local processes on torch.distributed (gloo on CPU, nccl on GPUs), at
  several sizes, fitted to the α–β model the planner prices collectives with
  (`cost.price.collective_time`): a collective of kind k over n ranks, each holding `local`
  bytes, takes

      t = ring_steps(k, n) · α + ring_bytes(k, n, local) / β

  so every sample is a row (steps, bytes) · (α, 1/β) = t, solved by least squares on relative
  errors (`fit_link`: a sample of 10 us weighs as much as one of 10 ms). The fit becomes the
  file's `bandwidth` and `latency` and the device's scale-up link (the N processes are one
  node); the samples and the fit of each kind alone are kept under `calibration.links`.
  Without torch (or with `--ranks 0`) the links are not measured: the host's copy rate
  stands in, as one node.

What it does not measure: the network between hosts; a multi-host cluster needs
`--bandwidth`/`--latency` (or the file's keys) from elsewhere.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from autoshard.collectives import CollectiveKind, ring_bytes, ring_steps
from autoshard.cost.attention import attention_flops
from autoshard.cost.devices import Transcendental, gpu_reserve
from autoshard.cost.measure.probes import OnnxRuntimeProbe, TorchProbe
from autoshard.errors import ClusterError
from autoshard.units import parse_size

SQUARE = (128, 256, 512, 1024, 2048)
BIG_SQUARE = (4096, 8192)  # a GPU reaches its peak only on these
THIN = ((2048, 32, 2048), (2048, 2048, 32), (32, 2048, 2048), (2048, 128, 2048), (128, 4096, 4096))
LAYERS = ((512, 4096, 4096), (4096, 4096, 1024), (16384, 1024, 4096), (16384, 4096, 4096),
          (2048, 2048, 128))  # fmt: skip
"""On a GPU also a transformer layer's shapes (tokens x hidden x hidden, an attention's
context): the squares' curve alone leaves the matrix units' rate at such shapes to chance."""
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
    links: Links | None = None
    dtype: str = "float32"
    vector_flops: float = 0.0
    """Other ops' rate (0: the matmul peak, as on a CPU)."""
    transcendental: tuple[tuple[str, float], ...] = ()
    """Per family of special functions (`cost.cluster.Transcendental`): evaluations per s."""
    probe: str = "onnxruntime float32"
    cache_bytes: int = 0
    cache_bandwidth: float = 0.0
    misaligned_efficiency: float = 0.5
    matmul_cache_bytes: int = 0
    matmul_cache_speedup: float = 1.0
    pack_bandwidth: float = 0.0
    strided_efficiency: float = 1.0
    transpose_efficiency: float = 1.0
    attention_efficiency: float = 0.0
    attention_backward_efficiency: float = 0.0
    fp8_peak: float = 0.0
    """FP8 FLOP/s of the matrix units at efficiency 1 (0: not measured, or no FP8)."""
    reserve: int = 0
    """Bytes of the GPU no tensor can use (`cost.devices.gpu_reserve` over the measured
    context; 0 on a CPU)."""

    @property
    def processor(self) -> str:
        if self.probe.endswith("bfloat16"):
            import torch

            return str(torch.cuda.get_device_name())
        return processor_name()

    def with_links(self, links: Links | None) -> Calibration:
        return replace(self, links=links)

    def device(self, name: str) -> dict[str, object]:
        """The cluster file's `device` (`cost.cluster.device_kind` reads it)."""
        cores = os.cpu_count() or 1
        # The host is one node; measured links are its scale-up link, else its copy rate.
        bandwidth, latency = self.copy_bandwidth, self.launch_s
        if self.links is not None:
            bandwidth, latency = self.links.fit.bandwidth, self.links.fit.latency
        return {
            "name": name,
            # Tensor cores run float16 at bfloat16's rate: a float16 model plans on it too.
            "flops": {self.dtype: self.peak}
            | ({"float16": self.peak} if self.dtype == "bfloat16" else {})
            | ({"float8_e4m3fn": self.fp8_peak} if self.fp8_peak else {}),
            "default_flops": self.vector_flops or self.peak,
            "memory": self.memory,
            "hbm_bandwidth": self.copy_bandwidth,
            "matmul_efficiency": 1.0,
            "memory_efficiency": 1.0,
            "matmul_half_dim": self.half_dim,
            "launch_s": self.launch_s,
            "link_bandwidth": bandwidth,
            "link_latency": latency,
            "node_size": max(cores, self.links.ranks if self.links else 1),
            "network_bandwidth": bandwidth,
            "network_latency": latency,
            "link_name": self.links.backend if self.links else "host memory",
            "transcendental": dict(self.transcendental),
            "cache_bytes": self.cache_bytes,
            "cache_bandwidth": self.cache_bandwidth,
            "misaligned_efficiency": self.misaligned_efficiency,
            "matmul_cache_bytes": self.matmul_cache_bytes,
            "matmul_cache_speedup": self.matmul_cache_speedup,
            "pack_bandwidth": self.pack_bandwidth,
            "strided_efficiency": self.strided_efficiency,
            "transpose_efficiency": self.transpose_efficiency,
            "attention_efficiency": self.attention_efficiency,
            "attention_backward_efficiency": self.attention_backward_efficiency,
            "reserve": self.reserve,
        }

    def to_json(self) -> dict[str, object]:
        """The cluster file: the measured device, and the raw figures under `calibration`."""
        name = f"{self.processor} (calibrated, {self.probe})"
        found: dict[str, object] = {"device": self.device(name)}
        if self.links is not None:  # the file's links: every axis, as flags would give them
            found["bandwidth"] = f"{self.links.fit.bandwidth / 1e9:.6g}GB/s"
            found["latency"] = f"{self.links.fit.latency * 1e6:.6g}us"
        found["calibration"] = {
            "matmul_flops": [
                {"m": m, "k": k, "n": n, "flops_per_s": rate} for (m, k, n), rate in self.matmul
            ],
            "probe": self.probe,
            "copy_bytes_per_s": self.copy_bandwidth,
            "launch_s": self.launch_s,
            "links": self.links.to_json() if self.links else "not measured: the host's copy rate",
        }
        return found


@dataclass(frozen=True)
class LinkSample:
    """One timed collective: its kind over `ranks` processes, each holding `local` bytes."""

    kind: CollectiveKind
    ranks: int
    local: int
    seconds: float

    @property
    def steps(self) -> int:
        return ring_steps(self.kind, self.ranks)

    @property
    def sent(self) -> int:
        """Bytes each rank sends, as the planner counts them (`reshard.ring_bytes`)."""
        return ring_bytes(self.kind, self.ranks, self.local)


@dataclass(frozen=True)
class LinkFit:
    """A link of the α–β model: bandwidth β (bytes/s) and latency α (s) per ring step."""

    bandwidth: float
    latency: float

    def to_json(self) -> dict[str, float]:
        return {"bandwidth_bytes_per_s": self.bandwidth, "latency_s": self.latency}


@dataclass(frozen=True)
class Links:
    """The collectives measured over `ranks` local processes on `backend`, and their fit:
    `fit` over every sample (the link), `by_kind` each kind's alone (how far they agree)."""

    backend: str
    ranks: int
    samples: tuple[LinkSample, ...]
    fit: LinkFit
    by_kind: tuple[tuple[CollectiveKind, LinkFit], ...]

    def to_json(self) -> dict[str, object]:
        return {
            "backend": self.backend,
            "ranks": self.ranks,
            **self.fit.to_json(),
            "by_kind": {str(kind): fit.to_json() for kind, fit in self.by_kind},
            "samples": [
                {
                    "kind": str(s.kind),
                    "local_bytes": s.local,
                    "sent_bytes": s.sent,
                    "steps": s.steps,
                    "seconds": s.seconds,
                }
                for s in self.samples
            ],  # fmt: skip
        }


def fit_link(samples: Sequence[LinkSample]) -> LinkFit:
    """α and β minimising Σ ((steps·α + sent/β - t) / t)² (the module's docstring): the 2x2
    normal equations of the rows (steps/t, sent/t) against 1, with α held at 0 if the free
    fit makes it negative (latency below the timer's noise)."""
    rows = [(s.steps / s.seconds, s.sent / s.seconds) for s in samples if s.seconds > 0]
    saa = math.fsum(a * a for a, _ in rows)
    sab = math.fsum(a * b for a, b in rows)
    sbb = math.fsum(b * b for _, b in rows)
    sa, sb = math.fsum(a for a, _ in rows), math.fsum(b for _, b in rows)
    det = saa * sbb - sab * sab
    alpha, gamma = -1.0, 0.0
    if det > 1e-12 * saa * sbb:
        alpha, gamma = (sa * sbb - sb * sab) / det, (saa * sb - sab * sa) / det
    if alpha < 0:
        alpha, gamma = 0.0, (sb / sbb if sbb else 0.0)
    if gamma <= 0:
        raise ClusterError(
            "collective timings do not grow with their bytes: no bandwidth to fit (measure "
            "larger sizes, or on a quieter machine)"
        )
    return LinkFit(1 / gamma, alpha)


def fit_links(backend: str, samples: Sequence[LinkSample]) -> Links:
    """The link over every sample, and each kind's own fit (left out where a kind's few
    timings alone show no bandwidth: noise on a shared machine)."""
    by_kind = []
    for kind in sorted({s.kind for s in samples}):
        try:
            by_kind.append((kind, fit_link([s for s in samples if s.kind is kind])))
        except ClusterError:
            continue
    ranks = max(s.ranks for s in samples)
    return Links(backend, ranks, tuple(samples), fit_link(samples), tuple(by_kind))


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
    cached: Callable[[tuple[int, int, int]], bool] = lambda _: False,
) -> tuple[float, int, float]:
    """(E, h, c) minimising Σ (log rate - log E - [cached] log c - Σ log s(d))² over the grid
    of h (see the module's docstring): for each h, log E is the mean residual of the shapes
    out of the cache and log E + log c that of the shapes in it (c = 1 without any)."""
    best: tuple[float, float, int, float] | None = None
    for h in HALF_DIMS:
        groups: dict[bool, list[float]] = {False: [], True: []}
        for shape, rate in rates:
            residual = math.log(rate) - sum(math.log(d / (d + h)) for d in shape)
            groups[cached(shape)].append(residual)
        if not groups[False]:
            groups = {False: groups[True], True: []}
        means = {key: statistics.fmean(found) for key, found in groups.items() if found}
        error = sum((r - means[key]) ** 2 for key, found in groups.items() for r in found)
        if best is None or error < best[0] - 1e-12:
            speedup = math.exp(means[True] - means[False]) if True in means else 1.0
            best = (error, math.exp(means[False]), h, speedup)
    assert best is not None
    return best[1], best[2], best[3]


def kernel_rates(
    rates: Sequence[tuple[tuple[int, int, int], float]],
    launch: float,
    bandwidth: float,
    element: int,
) -> list[tuple[tuple[int, int, int], float]]:
    """The samples that tell a GPU's matmul rate, at the rate of their kernel: the launch
    floor taken off (the roofline adds it to every op), and left out where the time is under
    ten launch floors or moving the operands (at `bandwidth`) takes at least half of it: such
    a shape is bound by them, and its rate says nothing of the matrix units (a GEMM's own
    setup takes a few floors, and a small GEMM's tiles fill only some of the SMs)."""
    found = []
    for shape, rate in rates:
        m, k, n = shape
        seconds = 2 * m * k * n / rate
        moving = working_set(shape, element) / bandwidth
        if seconds > 10 * launch and moving < (seconds - launch) / 2:
            found.append((shape, 2 * m * k * n / (seconds - launch)))
    return found or list(rates)


def working_set(shape: tuple[int, int, int], element: int) -> int:
    """Bytes of a matmul's operands and result."""
    m, k, n = shape
    return element * (m * k + k * n + m * n)


def _fits(shape: tuple[int, int, int], element: int, limit: int) -> bool:
    return working_set(shape, element) <= limit


PACK_RATES = (0.0, *(0.5e9 * 1.26**i for i in range(22)))
"""The packing rates `fit_packing` tries (0: none), 0.5 to 64 GB/s a quarter-octave apart."""


def fit_packing(
    rates: Sequence[tuple[tuple[int, int, int], float]], element: int
) -> tuple[float, int, float, int, float]:
    """(E, h, c, T, P): each matmul's time t = 2MKN / (E · [c if its operands and result fit
    in T bytes] · Π s(d)) + KN·element / P, the second term the pass packing B takes (a CPU
    BLAS re-lays out B on every call). For each P of `PACK_RATES` and each T (the working set
    of a measured shape, or 0: no cache level), the times less their packing are fitted by
    `fit_half_dim`; the fit whose rates are nearest the measured ones in log (Σ log² of their
    ratios: an outlier weighs as little as it can) wins, among those with c > 1."""
    limits = sorted({0, *(working_set(shape, element) for shape, _ in rates)})
    best: tuple[float, float, int, float, int, float] | None = None
    for pack in PACK_RATES:
        packing = [element * k * n / pack if pack else 0.0 for (m, k, n), _ in rates]
        left = [2 * m * k * n / r - p for ((m, k, n), r), p in zip(rates, packing, strict=True)]
        if min(left) <= 0:
            continue  # packing alone would take longer than some matmul did
        corrected = [((m, k, n), 2 * m * k * n / t) for ((m, k, n), _), t in zip(
            rates, left, strict=True)]  # fmt: skip
        for limit in limits:
            inside = [working_set(shape, element) <= limit for shape, _ in rates]
            if limit and (all(inside) or not any(inside)):
                continue  # no shape on one side of it: no level to fit
            fits = functools.partial(_fits, element=element, limit=limit)
            peak, half, speedup = fit_half_dim(corrected, fits)
            if limit and speedup <= 1.0:
                continue  # a cache level that does not help
            error = 0.0
            for ((m, k, n), rate), fast, p in zip(rates, inside, packing, strict=True):
                curve = peak * (speedup if fast else 1.0) * math.prod(
                    d / (d + half) for d in (m, k, n))  # fmt: skip
                error += math.log(2 * m * k * n / (2 * m * k * n / curve + p) / rate) ** 2
            if best is None or error < best[0] - 1e-12:
                best = (error, peak, half, speedup if limit else 1.0, limit, pack)
    assert best is not None
    return best[1], best[2], best[3], best[4], best[5]


def calibrate(
    quick: bool = False,
    progress: Callable[[str], None] = lambda _: None,
    probe: OnnxRuntimeProbe | TorchProbe | None = None,
) -> Calibration:
    """Measure this machine's device with `probe` (default: onnxruntime on the CPU; `quick`:
    smaller shapes and fewer runs, a few seconds)."""
    probe = probe or OnnxRuntimeProbe(repeats=3 if quick else 5, budget=0.01 if quick else 0.05)
    gpu = probe if isinstance(probe, TorchProbe) and probe.cuda else None
    cuda = gpu is not None
    scale = 2 if quick else 1  # quick: half the dims, an eighth of the work
    square = SQUARE + (BIG_SQUARE if cuda else ())
    shapes = [(d // scale,) * 3 for d in square] + [
        (m // scale, k // scale, n // scale) for m, k, n in THIN + (LAYERS if cuda else ())
    ]
    element = 2 if cuda else 4
    rates = _matmul_rates(probe, shapes, progress)
    # The floor and memory before the fit, which takes them off a GPU's matmul times.
    launch = probe.add(1)
    progress(f"launch floor: {launch * 1e6:.2f} us per op (a one-element Add)")
    size = (1 << 30 if cuda else 256 << 20) // (16 if quick else 1)
    elements = size // 4
    copy = 3 * elements * element / probe.add(elements)  # two arrays read, one written
    progress(f"memory: {copy / 1e9:.1f} GB/s (Add of {elements * element >> 20} MiB arrays)")
    # Each against the Add's bytes per second, its own bytes read and written over its time.
    strided = min(1.0, 2 * elements * element / probe.strided(elements) / copy)
    transposed = min(1.0, 2 * elements * element / probe.transposed(elements) / copy)
    progress(f"access: {strided:.2f} of that rate reading an operand broadcast (a row added "
             f"to rows), {transposed:.2f} moving the innermost axis (a transpose)")  # fmt: skip
    if cuda:  # GPUs model no cache level for matmuls, and pack nothing
        peak, half, speedup = fit_half_dim(kernel_rates(rates, launch, copy, element))
        private, pack = 0, 0.0
    else:
        peak, half, speedup, private, pack = fit_packing(rates, element)
    progress(f"matmul fit: {peak / 1e9:.1f} GFLOP/s at large shapes, half speed at dim {half}"
             + (f", {speedup:.2f}x up to {private >> 10} KiB of operands" if private
                else "") + (f", B packed at {pack / 1e9:.2f} GB/s" if pack else ""))  # fmt: skip
    d = (4096 if cuda else 1024) // scale  # a GPU's kernels differ only where they are fast
    aligned = next(rate for shape, rate in rates if shape == (d, d, d))
    odd = 2 * d * d * (d - 1) / probe.matmul(d, d, d - 1)
    misaligned = min(1.0, odd / aligned)
    progress(f"misaligned: {misaligned:.2f} of the rate ({d}x{d}x{d - 1} against {d}^3)")
    vector = peak
    if gpu is not None:  # float32 without TF32 runs on the vector units: every other op's rate
        d = 4096 // scale
        vector = 2 * d**3 / gpu.matmul(d, d, d, dtype=gpu.torch.float32)
        progress(f"vector rate: {vector / 1e9:.1f} GFLOP/s (float32 matmul {d}^3)")
    cache = (gpu_cache(gpu) if gpu is not None else last_level_cache()) // 2
    cache_rate = 0.0
    if cache:  # a quarter of the working set the cache keeps: well inside it
        elements = cache // (3 * element) // 4
        seconds = max(probe.add(elements) - launch, 1e-9)
        cache_rate = 3 * element * elements / seconds
        progress(f"cache: {cache_rate / 1e9:.1f} GB/s up to {cache >> 20} MiB moved per op")
    if not cuda:
        # A CPU's row kernels (softmax, normalizations: a few flops per element loaded, the
        # `OP_KINDS` count, 5 for a softmax), not the FMA peak its matmuls reach.
        count = 1 << 16
        vector = 5 * count / max(probe.softmax(count) - launch, 1e-9)
        progress(f"vector rate: {vector / 1e9:.2f} GFLOP/s (a Softmax of {count} in the cache)")
    count = 1 << (22 if cuda else 16)  # in the cache: the function's rate, not memory's
    special = _special_rates(probe, count, launch, progress)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    flash, fp8, reserve = (0.0, 0.0), 0.0, 0
    if gpu is not None:
        memory = gpu.torch.cuda.get_device_properties(gpu.device).total_memory
        flash = attention_efficiencies(gpu, peak, launch, scale, progress)
        fp8, reserve = _gpu_precision_and_reserve(gpu, memory, half, scale, progress)
    return Calibration(
        tuple(rates), peak, half, copy, launch, memory, None, probe.dtype, vector,
        tuple(special), f"{probe.name} {probe.dtype}", cache, cache_rate, misaligned,
        private, speedup, pack, strided, transposed, *flash, fp8, reserve,
    )  # fmt: skip


ATTENTION = (4, 32, 2048, 128)
"""The shape SDPA is measured at: batch, heads, sequence, head dim (a 7B model's layer)."""


def attention_efficiencies(
    gpu: TorchProbe,
    peak: float,
    launch: float,
    scale: int = 1,
    progress: Callable[[str], None] = lambda _: None,
) -> tuple[float, float]:
    """The fractions of the matmul peak torch's fused attention (causal, at `ATTENTION`,
    its sequence over `scale`) reaches forward and backward, its FLOPs counted as the cost
    model counts them (`cost.attention.attention_flops`)."""
    batch, heads, seq, head_dim = ATTENTION
    seq //= scale
    found = []
    for backward in (False, True):
        seconds = max(gpu.attention((batch, heads, seq, head_dim), backward) - launch, 1e-9)
        flops = attention_flops(batch, heads, seq, seq, head_dim, True, backward)
        found.append(min(1.0, flops / seconds / peak))
        pass_ = "backward" if backward else "forward"
        progress(f"attention {pass_}: {found[-1]:.2f} of the matmul peak (SDPA, causal, "
                 f"{batch}x{heads}x{seq}x{head_dim})")  # fmt: skip
    return found[0], found[1]


def _gpu_precision_and_reserve(
    gpu: TorchProbe, memory: int, half: int, scale: int, progress: Callable[[str], None]
) -> tuple[float, int]:
    """The FP8 peak (0 without FP8) and the reserve of a GPU, after the other probes ran
    (their kernels' modules loaded, as a training process has them)."""
    d = 8192 // scale
    seconds = gpu.fp8_matmul(d, d, d)
    fp8 = 0.0 if seconds is None else fp8_peak(2 * d**3 / seconds, d, half)
    if fp8:
        progress(f"fp8: {fp8 / 1e12:.1f} TFLOP/s at efficiency 1 (an e4m3 matmul {d}^3)")
    context = gpu.runtime_bytes()
    reserve = gpu_reserve(memory, context)
    progress(f"reserve: {reserve / 1e9:.2f} GB ({context / 1e9:.2f} GB of CUDA context measured, "
             "0.5 GiB for NCCL, 1 % for fragmentation)")  # fmt: skip
    return fp8, reserve


def fp8_peak(rate: float, dim: int, half: int) -> float:
    """The FP8 peak at efficiency 1 that the contraction model (`cost.compute`) puts at a
    measured `rate` for a dim^3 matmul: rate / s(dim)^3, s(d) = d / (d + half), with the
    half dim fitted to the bf16 matmuls (the same tiles)."""
    return rate / (dim / (dim + half)) ** 3


def _matmul_rates(
    probe: OnnxRuntimeProbe | TorchProbe,
    shapes: Sequence[tuple[int, int, int]],
    progress: Callable[[str], None],
) -> list[tuple[tuple[int, int, int], float]]:
    """FLOP/s of a matmul of each (m, k, n) shape, in order."""
    rates: list[tuple[tuple[int, int, int], float]] = []
    for i, (m, k, n) in enumerate(shapes, 1):
        seconds = probe.matmul(m, k, n)
        rates.append(((m, k, n), 2 * m * k * n / max(seconds, 1e-9)))
        progress(
            f"matmul {m}x{k}x{n} ({probe.dtype}): {rates[-1][1] / 1e9:.1f} GFLOP/s "
            f"({i}/{len(shapes)})"
        )
    return rates


def _special_rates(
    probe: OnnxRuntimeProbe | TorchProbe,
    count: int,
    launch: float,
    progress: Callable[[str], None],
) -> list[tuple[str, float]]:
    """Evaluations per second of each special-function family on `count` elements, the
    launch floor taken off."""
    special = []
    for family in Transcendental:
        seconds = max(probe.special(family, count) - launch, 1e-9)
        special.append((str(family), count / seconds))
        progress(f"{family}: {special[-1][1] / 1e9:.3g} G evaluations/s")
    return special


def _caches() -> dict[int, int]:
    """Per cache level of the first CPU, its bytes (Linux sysfs; data and unified caches)."""
    found: dict[int, int] = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            size = parse_size((index / "size").read_text().strip().replace("K", "KiB"))
        except (OSError, ValueError, ClusterError):
            continue
        found[level] = max(found.get(level, 0), size)
    return found


def gpu_cache(gpu: TorchProbe) -> int:
    """Bytes of the GPU's L2 cache (0 where torch does not say)."""
    properties = gpu.torch.cuda.get_device_properties(gpu.device)
    return int(getattr(properties, "L2_cache_size", 0))


def last_level_cache() -> int:
    """Bytes of the CPU's largest cache (0 where unknown)."""
    return max(_caches().values(), default=0)
