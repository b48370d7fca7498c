"""What a training step on torch.distributed moves, counted on the test's side: a dispatch mode
that sees every collective torch issues (DTensor's functional collectives and the c10d calls
FSDP2 and `sync_gradients` make directly), keyed by the phase the step is in and the kind, each
priced with the plan's own ring formula (`collectives.ring_bytes`) from the tensor it moved and
its group's size. An op on DTensors is left to DTensor first (as `CommDebugMode` does), so the
collectives it issues inside the op (an input redistributed to the placement the op needs) are
seen too. torch's `CommDebugMode` runs beside it, per phase: its counts per collective op must
be the same calls (`calls`, `debug_calls`). torch is imported inside (its tests importorskip
it first)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from autoshard.collectives import CollectiveKind, ring_bytes

# torch op name -> (kind, where the input tensor is among the args); a c10d op takes lists.
_OPS = {
    "_c10d_functional.all_gather_into_tensor": (CollectiveKind.ALL_GATHER, 0),
    "_c10d_functional.all_reduce": (CollectiveKind.ALL_REDUCE, 0),
    "_c10d_functional.reduce_scatter_tensor": (CollectiveKind.REDUCE_SCATTER, 0),
    "_c10d_functional.all_to_all_single": (CollectiveKind.ALL_TO_ALL, 0),
    "c10d._allgather_base_": (CollectiveKind.ALL_GATHER, 1),
    "c10d.allgather_": (CollectiveKind.ALL_GATHER, 1),
    "c10d.allgather_into_tensor_coalesced_": (CollectiveKind.ALL_GATHER, 1),
    "c10d.allreduce_": (CollectiveKind.ALL_REDUCE, 0),
    "c10d.allreduce_coalesced_": (CollectiveKind.ALL_REDUCE, 0),
    "c10d._reduce_scatter_base_": (CollectiveKind.REDUCE_SCATTER, 1),
    "c10d.reduce_scatter_": (CollectiveKind.REDUCE_SCATTER, 1),
    "c10d.reduce_scatter_tensor_coalesced_": (CollectiveKind.REDUCE_SCATTER, 1),
    "c10d.alltoall_base_": (CollectiveKind.ALL_TO_ALL, 1),
}
_OTHER = ("c10d.", "_c10d_functional.")  # any other collective: a test failure, named


def _group_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    import torch
    import torch.distributed.distributed_c10d as c10d

    for value in (*args, *kwargs.values()):
        if isinstance(value, str):  # a functional collective's group name
            try:
                return c10d._resolve_process_group(value).size()
            except (ValueError, RuntimeError):
                continue
        if isinstance(value, torch.ScriptObject):  # a c10d op's ProcessGroup (or ReduceOp)
            try:
                return int(c10d.ProcessGroup.unbox(value).size())
            except (RuntimeError, TypeError):
                continue
    raise AssertionError(f"no process group among {args}")


def _bytes(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return int(value.numel() * value.element_size())


class Traffic:
    """Collectives per (phase, kind): a count and bytes per device (`ring_bytes`)."""

    def __init__(self) -> None:
        self.count: Counter[tuple[str, str]] = Counter()
        self.bytes: Counter[tuple[str, str]] = Counter()
        self.debug: dict[str, Counter[str]] = {}  # CommDebugMode's counts per phase
        self.seen: dict[str, Counter[str]] = {}  # ours, per torch op name

    def add(self, phase: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if name not in _OPS:
            raise AssertionError(f"{phase}: collective {name} is not counted here")
        kind, at = _OPS[name]
        n = _group_size(args, kwargs)
        self.count[(phase, str(kind))] += 1
        self.bytes[(phase, str(kind))] += ring_bytes(kind, n, _bytes(args[at]))
        self.seen.setdefault(phase, Counter())[name] += 1

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count what runs inside, as phase `name` (CommDebugMode beside it)."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.debug import CommDebugMode
        from torch.utils._python_dispatch import TorchDispatchMode

        traffic = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if any(issubclass(t, DTensor) for t in types):
                    # DTensor desugars its op first: the collectives an implicit redistribution
                    # issues inside it (a Partial gradient into a norm) come back through here
                    return NotImplemented
                kwargs = kwargs or {}
                op = str(func.overloadpacket._qualified_op_name).replace("::", ".")
                helper = op.startswith("_c10d_functional._") or op.endswith("wait_tensor")
                if op.startswith(_OTHER) and not helper:
                    traffic.add(name, op, tuple(args), dict(kwargs))
                return func(*args, **kwargs)

        debug = CommDebugMode()
        with debug, Mode():
            yield
        counts = self.debug.setdefault(name, Counter())
        for op, n in debug.get_comm_counts().items():
            counts[str(op.__name__ if hasattr(op, "__name__") else op)] += n

    def by_kind(self) -> dict[str, dict[str, int]]:
        """Bytes per device by phase, then kind (sorted)."""
        out: dict[str, dict[str, int]] = {}
        for (phase, kind), sent in sorted(self.bytes.items()):
            out.setdefault(phase, {})[kind] = sent
        return out

    def calls(self) -> dict[str, int]:
        """Our count of collective calls per phase (CommDebugMode's must be the same)."""
        return {phase: sum(c.values()) for phase, c in sorted(self.seen.items())}

    def debug_calls(self) -> dict[str, int]:
        return {phase: sum(c.values()) for phase, c in sorted(self.debug.items()) if c}


def mismatches(
    estimate: Mapping[str, Mapping[str, int]], counted: Mapping[str, Mapping[str, int]], steps: int
) -> list[str]:
    """Each phase and kind whose counted bytes over `steps` steps are not `steps` times the
    estimate of one, as a line naming both."""
    out = []
    for phase in sorted(set(estimate) | set(counted)):
        want, got = estimate.get(phase, {}), counted.get(phase, {})
        for kind in sorted(set(want) | set(got)):
            if steps * want.get(kind, 0) != got.get(kind, 0):
                out.append(f"{phase} {kind}: estimated {steps * want.get(kind, 0)} B, "
                           f"counted {got.get(kind, 0)} B")  # fmt: skip
    return out
