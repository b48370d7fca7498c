"""The devices the cost model knows (peak rates, memory, special-function costs) and the
clusters preset on them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType


class Transcendental(StrEnum):
    """The families of special functions an op evaluates per element, priced by their own
    rates (`DeviceKind.transcendental`). `int_pow` is a power by a constant 2 or 3: two
    multiplications, which some runtimes special-case without vectorizing (onnxruntime's CPU
    Pow), so it is priced apart from both."""

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
    dim at which a kernel reaches half its large-shape efficiency (`cost.compute`). launch_s:
    the shortest time a kernel takes. node_size devices share the scale-up link
    (`link_bandwidth`, `link_latency`); nodes talk over the network (`network_bandwidth`,
    `network_latency`), per device. transcendental: evaluations per second of each family of
    special functions (`cost.devices.Transcendental`: "exp", "erf", ...) where measured; a
    family not listed runs at `default_flops` over the instructions it takes
    (`cost.compute.TRANSCENDENTAL_FLOPS`). cache_bytes, cache_bandwidth: an op moving at most
    cache_bytes streams from a cache at cache_bandwidth instead (0: not modelled; CPUs, whose
    last-level cache holds the activations a small forward passes from op to op, and GPUs'
    L2, where what the last kernel wrote is read by the next).
    misaligned_efficiency: what a matmul with a dim off 16-byte alignment keeps of its rate.
    strided_efficiency, transpose_efficiency: what a memory-bound kernel keeps of the
    streaming rate when it reads an operand broadcast or out of its result's order, and when
    that order moves the innermost axis (`cost.compute.access`; 1: not modelled).
    matmul_cache_bytes, matmul_cache_speedup: a matmul whose operands and result fit in
    matmul_cache_bytes runs matmul_cache_speedup times faster (0, 1: not modelled; CPUs'
    private caches). pack_bandwidth: bytes/s at which a matmul re-lays out its second operand
    on every call (0: it does not; CPU BLAS packing). attention_efficiency,
    attention_backward_efficiency: the fraction of the matrix units' peak a fused (flash)
    attention kernel reaches forward and backward (`cost.attention.attention_cost`); 0: the
    device has no such kernel (a training plan then prices attention as exported by default,
    and a fused one at `matmul_efficiency`).
    reserve: bytes of `memory` a training or serving process cannot hold tensors in (the
    CUDA context and its kernels' modules, NCCL's buffers, the caching allocator's
    fragmentation: `gpu_reserve`); the budget a plan gets when none is given is memory less
    it, so a plan that fits fits when it runs.
    overlap_slowdown: how much slower a compute kernel runs while a collective runs beside
    it (they share SMs and memory bandwidth): 0.19 is 19 % longer for the time they overlap
    (`cost.overlap`); 0: not modelled.
    network_bandwidth is one device's share of its node's scale-out bandwidth: a node's NICs
    together carry node_size × network_bandwidth, which NCCL's rings across nodes use all of
    (`cost.price.collective_time`).
    """

    @property
    def flash_attention(self) -> bool:
        """Whether the device runs fused (flash) attention kernels."""
        return self.attention_efficiency > 0

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
    attention_efficiency: float = 0.0
    attention_backward_efficiency: float = 0.0
    reserve: int = 0
    overlap_slowdown: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "flops", MappingProxyType(dict(self.flops)))
        object.__setattr__(self, "transcendental", MappingProxyType(dict(self.transcendental)))

    def peak(self, dtype: str) -> float:
        return self.flops.get(dtype, self.default_flops)


GiB = 1 << 30


def gpu_reserve(memory: int, context: int = GiB) -> int:
    """What a GPU process cannot use for tensors: the CUDA (or ROCm) context with the
    libraries' kernels loaded and cuBLAS's workspace (`context`: 1 GiB, or as `autoshard
    calibrate --torch` measures it), 0.5 GiB for NCCL's buffers (a few communicators of
    several channels, 4 MiB a channel per peer), and 1 % of the memory for the caching
    allocator's fragmentation (docs/concepts/mesh.md#the-memory-reserve)."""
    return context + GiB // 2 + memory // 100


OVERLAP_SLOWDOWN = 0.189
"""Lee et al. 2025's mean compute slowdown under overlapped communication (module presets)."""

DEVICES = {
    # H100 SXM5 datasheet: 989 TFLOP/s bf16/fp16 dense (1979 fp8/int8), 67 fp32 (non-tensor),
    # 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s bidirectional = 450 per direction. DGX H100:
    # 8 GPUs, one ConnectX-7 400 Gb/s NIC each = 50 GB/s. cuBLAS bf16 GEMMs of 8192^3 reach
    # ~0.8 of peak; a streaming copy ~0.85 of HBM bandwidth. The misaligned, strided and
    # transpose efficiencies and the L2's rate (an op moving at most half the 50 MB L2 reads
    # what its producer just wrote from there) are measured on an H100 with
    # bench/kernel_access.py and `autoshard calibrate --torch`; the figures are in
    # docs/measurements.md, the preset's fidelity against those kernels in bench/data/h100.
    # Flash attention: FlashAttention-3's fractions at head dim 128 and 2k tokens (Shah et al.
    # 2024, arXiv:2407.08608; figures in docs/concepts/fused-attention.md). Overlap slowdown:
    # the mean compute slowdown beside collectives Lee et al. 2025 measured on A100s and
    # H100s training GPT and Llama models (arXiv:2507.03114; docs/concepts/step-time.md).
    "h100": DeviceKind(
        "NVIDIA H100 SXM5 80GB",
        {"bfloat16": 989e12, "float16": 989e12, "float8_e4m3fn": 1979e12, "int8": 1979e12},
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
        attention_efficiency=0.6,
        attention_backward_efficiency=0.45,
        reserve=gpu_reserve(80 * 10**9),
        overlap_slowdown=OVERLAP_SLOWDOWN,
    ),
    # A100 SXM4 80GB datasheet: 312 TFLOP/s bf16/fp16 (624 int8), 19.5 fp32, HBM2e at
    # 2.039 TB/s, NVLink 3 600 GB/s bidirectional = 300 per direction. DGX A100: 8 GPUs, one
    # ConnectX-6 200 Gb/s HDR NIC each = 25 GB/s. cuBLAS reaches ~0.85 of peak.
    # Flash attention: FlashAttention-2's fractions at head dim 128 and 2k tokens (Dao 2023,
    # arXiv:2307.08691; figures in docs/concepts/fused-attention.md). Overlap slowdown: as
    # the H100's (Lee et al. 2025 measured both).
    "a100": DeviceKind(
        "NVIDIA A100 SXM4 80GB",
        {"bfloat16": 312e12, "float16": 312e12, "int8": 624e12},
        19.5e12,
        80 * 10**9,
        300e9,
        hbm_bandwidth=2.039e12,
        matmul_efficiency=0.85,
        network_bandwidth=25e9,
        attention_efficiency=0.6,
        attention_backward_efficiency=0.5,
        reserve=gpu_reserve(80 * 10**9),
        overlap_slowdown=OVERLAP_SLOWDOWN,
    ),
    # MI300X datasheet: 1307 TFLOP/s bf16/fp16 dense (2615 fp8/int8), 163.4 fp32, 192 GB HBM3 at
    # 5.3 TB/s, Infinity Fabric 7 links x 64 GB/s = 448 GB/s per GPU. 8-GPU OAM platform with
    # a 400 Gb/s NIC per GPU = 50 GB/s. hipBLASLt bf16 GEMMs reach ~0.6 of peak, copies ~0.8
    # of HBM bandwidth.
    "mi300x": DeviceKind(
        "AMD Instinct MI300X",
        {"bfloat16": 1307e12, "float16": 1307e12, "float8_e4m3fn": 2615e12, "int8": 2615e12},
        163.4e12,
        192 * 10**9,
        448e9,
        hbm_bandwidth=5.3e12,
        matmul_efficiency=0.6,
        memory_efficiency=0.8,
        link_name="Infinity Fabric",
        attention_efficiency=0.6,  # FlashAttention-2's A100 fractions, assumed (ROCm port)
        attention_backward_efficiency=0.5,
        reserve=gpu_reserve(192 * 10**9),
        overlap_slowdown=OVERLAP_SLOWDOWN,  # Lee et al. 2025's MI250/MI210 runs, assumed
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
        reserve=GiB // 2,
    ),
    # L4 datasheet: 121 TFLOP/s bf16/fp16 dense (242.5 fp8), 30.3 fp32, 24 GB GDDR6 at
    # 300 GB/s, PCIe Gen4 x16 (~32 GB/s per direction). A g2-standard-96 node holds 8 L4s on
    # PCIe and one 100 Gb/s NIC shared by the 8 = 1.5625 GB/s per GPU. At 72 W it clocks
    # down: ~0.7 of peak.
    "l4": DeviceKind(
        "NVIDIA L4",
        {"bfloat16": 121e12, "float16": 121e12, "float8_e4m3fn": 242.5e12},
        30.3e12,
        24 * 10**9,
        32e9,
        hbm_bandwidth=300e9,
        matmul_efficiency=0.7,
        network_bandwidth=12.5e9 / 8,
        link_name="PCIe",
        attention_efficiency=0.6,  # FlashAttention-2's A100 fractions, assumed (Ada)
        attention_backward_efficiency=0.5,
        reserve=gpu_reserve(24 * 10**9),
        overlap_slowdown=OVERLAP_SLOWDOWN,  # assumed (Ada, not measured)
    ),
}

# The H100s of Meta's Grand Teton hosts, on which TorchTitan's published runs were measured
# (pytorch/torchtitan docs/performance.md; HBM2e, a 500 W limit, 400 Gb/s RDMA per GPU): no
# peak is published ("between SXM and NVL"), so the SXM5's rates scaled by the assumption
# below, the rest as the SXM5's (sources and figures in docs/concepts/mesh.md).
_HBM2E_SPEED = 0.875
"""The Grand Teton H100's rates against the SXM5's: the middle of the slowdown issue 44 saw."""
_H100_HBM2E = dataclasses.replace(
    DEVICES["h100"],
    name="NVIDIA H100 HBM2e 96GB 500W",
    flops={k: v * _HBM2E_SPEED for k, v in DEVICES["h100"].flops.items()},
    default_flops=DEVICES["h100"].default_flops * _HBM2E_SPEED,
    memory=96 * 10**9,
    hbm_bandwidth=2.4e12,
    reserve=gpu_reserve(96 * 10**9),
)
DEVICES = {**dict(list(DEVICES.items())[:1]), "h100-hbm2e": _H100_HBM2E, **DEVICES}


DEFAULT_DEVICE = "h100"


CLUSTERS = {"dgx-h100": "h100", "dgx-a100": "a100", "selene": "a100",
            "grand-teton-h100": "h100-hbm2e", "mi300x-8": "mi300x",
            "tpu-v5e-256": "tpu-v5e", "g2-l4-8": "l4"}  # fmt: skip
"""`--cluster NAME`: the node each device preset describes (node size, scale-up link, NICs).
`selene` is NVIDIA's cluster of DGX A100 80GB nodes (8 HDR 200 Gb/s NICs each) on which
Megatron-LM's published runs were measured (Korthikanti et al. 2022); `grand-teton-h100`
Meta's hosts of TorchTitan's runs."""
