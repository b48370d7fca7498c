"""What one kernel takes on this machine, in the runtime a plan's program runs in: the probes
`autoshard calibrate` measures the device with and the fidelity bench times ops with.

- `OnnxRuntimeProbe`: onnxruntime on the CPU, float32, one single-node model per kernel (the
  way `autoshard run` and `verify` execute a device's program), all cores. A run's own cost
  (binding inputs, Python to C++: the fastest run of a one-element Identity) is taken off
  every time, so what is left is the kernel's. Not numpy: its matmuls and transcendentals run
  at other rates than onnxruntime's (MLAS), and a calibration must measure the kernels the
  program runs.
- `TorchProbe`: torch eager kernels on CUDA (bfloat16; the kernel's device time: a burst of
  calls captured in a CUDA graph and replayed between CUDA events, over the calls) or on
  the CPU (float32, the wall time of the call on one thread: the same code, testable without
  a GPU; threads waiting on each other on a shared machine take scheduler quanta, not kernel
  time). On CUDA the graph takes the host out: an eager call timed alone between events also
  times the host launching it into an idle GPU (several times a small op's kernel), which a
  running program hides behind the kernels queued ahead. A kernel that cannot be captured (one that
  waits on the host) is timed as the same burst queued eagerly.

Each time is taken over at least `repeats` runs and as many as fit in `budget` seconds,
after a warm-up: on CUDA their median (device time, which other processes barely move); on
a CPU the fastest (wall time on shared cores only ever grows by what other processes take:
the least disturbed run is the kernel's).
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from autoshard.cost.devices import Transcendental

REPEATS = 5
BUDGET = 0.05
ROW, HEADS, PERM = 1024, 8, (1, 2, 0)
"""The access probes' shapes: an Add of a row [ROW] to rows (a bias: read broadcast), and a
Transpose of [n, HEADS, ROW] to [HEADS, ROW, n] (an attention's keys turned: the innermost
axis moves), `cost.compute.access`'s STRIDED and TRANSPOSED."""
BURST, BURST_SECONDS = 64, 1e-3
"""On CUDA each timed replay runs a kernel up to BURST times, about BURST_SECONDS of it."""


def best_time(run: Callable[[], object], repeats: int = REPEATS, budget: float = BUDGET) -> float:
    """The fastest wall time of `run`: at least `repeats` runs, more while within `budget`."""
    run()  # warm up: first-touch pages, thread pools, kernel selection
    times: list[float] = []
    while len(times) < repeats or (sum(times) < budget and len(times) < 200):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


SPECIAL_OPS: Mapping[Transcendental, tuple[str, float | None]] = {
    Transcendental.EXP: ("Exp", None),
    Transcendental.LOG: ("Log", None),
    Transcendental.ERF: ("Erf", None),
    Transcendental.TANH: ("Tanh", None),
    Transcendental.POW: ("Pow", 1.7),  # an exponent no kernel special-cases
    Transcendental.INT_POW: ("Pow", 3.0),
    Transcendental.SQRT: ("Sqrt", None),
    Transcendental.TRIG: ("Sin", None),
}
"""The ONNX op (and constant exponent) each family's rate is measured with."""


class OnnxRuntimeProbe:
    """Kernels of onnxruntime's CPU provider, float32 (the module's docstring)."""

    name = "onnxruntime"
    dtype = "float32"

    def __init__(self, repeats: int = REPEATS, budget: float = BUDGET) -> None:
        import onnxruntime as ort

        self.repeats, self.budget = repeats, budget
        self.options = ort.SessionOptions()
        self.options.log_severity_level = 3
        self.overhead = 0.0
        one = np.ones(1, np.float32)
        self.overhead = self.run_model(single_node("Identity", [one]), {"x0": one})

    def run_model(self, proto: Any, feed: Mapping[str, np.ndarray]) -> float:
        """The fastest run of an ONNX model on `feed`, less a run's own cost."""
        import onnxruntime as ort

        session = ort.InferenceSession(proto.SerializeToString(), self.options)
        seconds = best_time(lambda: session.run(None, dict(feed)), self.repeats, self.budget)
        return max(0.0, seconds - self.overhead)

    def node(
        self,
        op_type: str,
        inputs: Sequence[np.ndarray],
        constant: float | None = None,
        **attributes: Any,
    ) -> float:
        proto = single_node(op_type, inputs, constant, **attributes)
        return self.run_model(proto, {f"x{i}": a for i, a in enumerate(inputs)})

    def matmul(self, m: int, k: int, n: int) -> float:
        rng = np.random.default_rng(0)
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        return self.node("MatMul", [a, b])

    def add(self, elements: int) -> float:
        x, y = np.ones(elements, np.float32), np.ones(elements, np.float32)
        return self.node("Add", [x, y])

    def softmax(self, elements: int) -> float:
        x = np.random.default_rng(0).standard_normal((elements // 128, 128), dtype=np.float32)
        return self.node("Softmax", [x])

    def strided(self, elements: int) -> float:
        x, row = np.ones((elements // ROW, ROW), np.float32), np.ones(ROW, np.float32)
        return self.node("Add", [x, row])

    def transposed(self, elements: int) -> float:
        x = np.ones((elements // (HEADS * ROW), HEADS, ROW), np.float32)
        return self.node("Transpose", [x], perm=PERM)

    def special(self, family: Transcendental, elements: int) -> float:
        op_type, constant = SPECIAL_OPS[family]
        x = np.random.default_rng(0).uniform(0.5, 2.0, elements).astype(np.float32)
        return self.node(op_type, [x], constant)


def single_node(
    op_type: str, inputs: Sequence[np.ndarray], constant: float | None = None, **attributes: Any
) -> Any:
    """A model of one node reading inputs x0.. (and a constant scalar operand) into y."""
    from onnx import TensorProto, helper, numpy_helper

    names = [f"x{i}" for i in range(len(inputs))]
    initializers = []
    if constant is not None:
        initializers.append(numpy_helper.from_array(np.array(constant, np.float32), "c"))
    node = helper.make_node(
        op_type, [*names, *(["c"] if constant is not None else [])], ["y"], **attributes
    )
    graph = helper.make_graph(
        [node], "probe",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, a.shape) for n, a in zip(
            names, inputs, strict=True)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializers,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


class TorchProbe:
    """torch eager kernels on `device` ("cuda": bfloat16, bursts in CUDA graphs between CUDA
    events; "cpu": float32 with the wall time of each call)."""

    name = "torch"

    def __init__(self, device: str = "cpu", repeats: int = REPEATS, budget: float = BUDGET) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.dtype = "bfloat16" if self.cuda else "float32"
        self.torch_dtype = torch.bfloat16 if self.cuda else torch.float32
        self.repeats, self.budget = repeats, budget

    def time(self, run: Callable[[], object]) -> float:
        """The time of `run`'s kernels (CUDA: the median device time between events)."""
        if not self.cuda:
            threads = self.torch.get_num_threads()
            self.torch.set_num_threads(1)
            try:
                return best_time(run, self.repeats, self.budget)
            finally:
                self.torch.set_num_threads(threads)
        torch = self.torch
        run()
        torch.cuda.synchronize(self.device)
        once = self._events(run)
        calls = max(1, min(BURST, int(BURST_SECONDS / max(once, 1e-7))))
        replay = self._captured(run, calls)
        times: list[float] = []
        while len(times) < self.repeats or (sum(times) < self.budget and len(times) < 200):
            times.append(self._events(replay) / calls)
        return statistics.median(times)

    def _events(self, run: Callable[[], object]) -> float:
        """Device seconds between CUDA events recorded around `run`."""
        start = self.torch.cuda.Event(enable_timing=True)
        end = self.torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    def _captured(self, run: Callable[[], object], calls: int) -> Callable[[], object]:
        """`calls` runs of `run` as one CUDA graph's replay; queued eagerly where the kernels
        cannot be captured."""
        torch = self.torch

        def eager() -> None:
            for _ in range(calls):
                run()

        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(side):  # torch's recipe: warm up on a side stream first
                run()
            torch.cuda.current_stream(self.device).wait_stream(side)
            with warnings.catch_warnings():  # a view launches no kernel: an empty graph
                warnings.filterwarnings("ignore", "The CUDA Graph is empty")
                with torch.cuda.graph(graph):
                    eager()
        except Exception:  # a kernel that waits on the host (or any capture error)
            torch.cuda.synchronize(self.device)
            return eager
        return graph.replay

    def tensor(self, *shape: int, dtype: Any = None) -> Any:
        generator = self.torch.Generator().manual_seed(0)
        x = self.torch.rand(*shape, generator=generator) * 1.5 + 0.5
        return x.to(self.device, dtype or self.torch_dtype)

    def matmul(self, m: int, k: int, n: int, dtype: Any = None) -> float:
        a, b = self.tensor(m, k, dtype=dtype), self.tensor(k, n, dtype=dtype)
        return self.time(lambda: self.torch.matmul(a, b))

    def fp8_matmul(self, m: int, k: int, n: int) -> float | None:
        """Seconds of an FP8 (e4m3) matmul with a bf16 result, as Float8Linear runs one
        (`torch._scaled_mm`, its second operand column-major as it requires); None on a
        device without FP8 tensor cores (compute capability below 8.9, or no CUDA)."""
        torch = self.torch
        if not self.cuda or torch.cuda.get_device_capability(self.device) < (8, 9):
            return None
        a = self.tensor(m, k).to(torch.float8_e4m3fn)
        b = self.tensor(n, k).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=self.device)
        return self.time(
            lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        )

    def runtime_bytes(self) -> int:
        """Bytes of the GPU this process holds outside torch's allocator: the CUDA context,
        the kernels' modules loaded so far, cuBLAS's workspace (0 on a CPU)."""
        if not self.cuda:
            return 0
        free, total = self.torch.cuda.mem_get_info(self.device)
        return max(0, total - free - self.torch.cuda.memory_reserved(self.device))

    def add(self, elements: int) -> float:
        x, y = self.tensor(elements), self.tensor(elements)
        out = self.torch.empty_like(x)
        return self.time(lambda: self.torch.add(x, y, out=out))

    def softmax(self, elements: int) -> float:
        x = self.tensor(elements // 128, 128)
        return self.time(lambda: self.torch.softmax(x, -1))

    def attention(self, shape: tuple[int, int, int, int], backward: bool = False) -> float:
        """Seconds of torch's fused attention (`scaled_dot_product_attention`, causal: on
        CUDA its flash kernel) over (batch, heads, seq, head_dim); with `backward`, of its
        backward alone (forward and backward, less the forward)."""
        functional = self.torch.nn.functional
        q, k, v = (self.tensor(*shape).requires_grad_(backward) for _ in range(3))

        def forward() -> Any:
            return functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        once = self.time(lambda: forward().detach())
        if not backward:
            return once
        grad = self.tensor(*shape)
        both = self.time(lambda: self.torch.autograd.grad(forward(), (q, k, v), grad))
        return max(both - once, 1e-9)

    def strided(self, elements: int) -> float:
        x, row = self.tensor(elements // ROW, ROW), self.tensor(ROW)
        return self.time(lambda: self.torch.add(x, row))

    def transposed(self, elements: int) -> float:
        x = self.tensor(elements // (HEADS * ROW), HEADS, ROW)
        return self.time(lambda: x.permute(*PERM).contiguous())

    def special(self, family: Transcendental, elements: int) -> float:
        torch, x = self.torch, self.tensor(elements)
        functions: Mapping[Transcendental, Callable[[Any], Any]] = {
            Transcendental.EXP: torch.exp,
            Transcendental.LOG: torch.log,
            Transcendental.ERF: torch.erf,
            Transcendental.TANH: torch.tanh,
            Transcendental.POW: lambda t: torch.pow(t, SPECIAL_OPS[Transcendental.POW][1]),
            Transcendental.INT_POW: lambda t: torch.pow(t, 3.0),
            Transcendental.SQRT: torch.sqrt,
            Transcendental.TRIG: torch.sin,
        }
        function = functions[family]
        return self.time(lambda: function(x))
