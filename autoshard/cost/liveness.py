"""Memory: the bytes a device holds at each step of a sharded program, and what they are.

A tensor takes, per device, the bytes of its largest shard: Π ceil(d_i / g_i) elements (a
value inside a fused kernel what the kernel keeps of it: `held_bytes`).
Walking the program in order, a tensor is live from the step defining it to the last step
reading it; program inputs, weights and constants are live throughout (a training step's
weight or optimizer state until the update writing over it, an accumulated gradient from the
start). The peak over steps is the memory per device. Each tensor has a kind (`MEMORY_KINDS`),
so that the peak can be told apart into weights, gradients, optimizer state, activations,
inputs and reshard buffers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from autoshard.ir import dtypes
from autoshard.ir.fused import Fused, Held
from autoshard.ir.graph import Graph
from autoshard.mesh import Mesh
from autoshard.program import Compute, Program, Tensor
from autoshard.rules.gradient import TRAIN, TrainOp
from autoshard.sharding import Sharding, shard_size


def shard_bytes(shape: Sequence[int], dtype: str, sharding: Sharding, mesh: Mesh) -> int:
    """Bytes of the largest shard of a tensor."""
    elements = 1
    for dim, size in enumerate(shape):
        elements *= shard_size(size, sharding.shard_count(mesh, dim))
    return dtypes.nbytes(dtype, elements)


def held_bytes(
    value: str, shape: Sequence[int], dtype: str, sharding: Sharding, mesh: Mesh, fused: Fused
) -> int:
    """Bytes of the largest shard of a tensor holding graph value `value` as a device holds it
    (`ir.fused`): whole; a fused attention's probabilities as their row statistics (float32,
    one per row: what flash attention keeps for the backward); a value inside a fused kernel
    not at all. The search's memory and the program's both count bytes so."""
    held = fused.held(value)
    if held is Held.NONE:
        return 0
    if held is Held.STATISTICS:
        return shard_bytes(shape[:-1], "float32", sharding, mesh)
    return shard_bytes(shape, dtype, sharding, mesh)


@dataclass(frozen=True)
class Memory:
    """Peak bytes per device, the program step where it is reached (-1: before any), and the
    tensors live there, largest first."""

    peak: int
    step: int
    live: tuple[tuple[str, int], ...]


def memory(program: Program) -> Memory:
    """The program's peak per device: the first step where the most bytes are live."""
    peak, where, at_peak = -1, -1, {}
    for i, current, live in _walk_memory(program):
        if current > peak:
            peak, where, at_peak = current, i, dict(live)
    top = sorted(at_peak.items(), key=lambda kv: (-kv[1], kv[0]))
    return Memory(peak, where, tuple(top))


def memory_timeline(program: Program) -> tuple[int, ...]:
    """Bytes per device live before the first step, then at each step of the program (its
    results held, what it read last not yet freed): the curve whose maximum is `memory`'s
    peak (`memory_timeline(p)[memory(p).step + 1] == memory(p).peak`)."""
    return tuple(current for _, current, _ in _walk_memory(program))


def _walk_memory(program: Program) -> Iterator[tuple[int, int, Mapping[str, int]]]:
    """(step, bytes live, the tensors live with their bytes) before any step (step -1), then
    at each step; the mapping is only valid until the next item."""
    mesh = program.mesh

    def size(t: Tensor) -> int:
        return held_bytes(t.value, t.shape, t.dtype, t.sharding, mesh, program.fused)

    resident = [n for n in (*program.inputs, *program.constants) if n not in program.replaced]
    last: dict[str, int] = {}
    for i, step in enumerate(program.steps):
        for name in step.inputs:
            if name:
                last[name] = i
    for name in program.outputs:
        last[name] = len(program.steps)
    # Replaced inputs and accumulated gradients: live from the start until their last reader.
    early = sorted(program.replaced | program.accumulated)
    live = {n: size(program.tensors[n]) for n in resident}
    held = {n: size(program.tensors[n]) for n in early}  # live, and freed after their last read
    live |= held
    current = sum(live.values())
    yield -1, current, live
    freed: dict[int, list[str]] = {}  # step -> tensors dead after it
    for name in held:
        freed.setdefault(last.get(name, -1), []).append(name)
    for i, step in enumerate(program.steps):
        if isinstance(step, Compute):  # an update writes over what it replaces
            for name in [n for n in freed.get(i, ()) if n in program.replaced]:
                freed[i].remove(name)
                current -= live.pop(name)
        for name in step.outputs:
            if name and name not in live:
                live[name] = size(program.tensors[name])
                current += live[name]
                freed.setdefault(max(last.get(name, i), i), []).append(name)
        yield i, current, live
        for name in freed.pop(i, []) + freed.pop(-1, []):
            current -= live.pop(name)


MEMORY_KINDS = ("weights", "gradients", "optimizer_state", "activations", "inputs", "buffers")
"""What a device holds, by kind: `buffers` are the results of collectives (a gathered weight,
a resharded activation)."""


def memory_kinds(graph: Graph) -> dict[str, str]:
    """The kind of every graph value (`MEMORY_KINDS` but buffers, which are program tensors):
    weights and their next values; optimizer state and its next; gradients (what the loss
    gradient, gradient ops, their sums and syncs make); inputs; every other value an
    activation."""
    kinds = dict.fromkeys(graph.values, "activations")
    kinds |= dict.fromkeys(graph.inputs, "inputs")
    kinds |= dict.fromkeys(graph.weights, "weights")
    for op in graph.ops:
        if op.domain == TRAIN and op.type == TrainOp.UPDATE:
            weight, state = op.inputs[1], op.inputs[2]
            kinds |= {weight: "weights", op.outputs[0]: "weights"}
            kinds |= {state: "optimizer_state", op.outputs[1]: "optimizer_state"}
        elif (op.domain == TRAIN) or (
            op.type == "Sum" and all(kinds.get(i) == "gradients" for i in op.inputs)
        ):
            kinds |= dict.fromkeys(op.outputs, "gradients")
    return kinds


def live_kinds(program: Program, graph: Graph, peak: Memory) -> list[tuple[str, str, int]]:
    """The tensors live at the peak: (tensor, its kind in `MEMORY_KINDS`, bytes), largest
    first."""
    kinds = tensor_kinds(program, graph)
    return [(name, kinds[name], size) for name, size in peak.live]


def tensor_kinds(program: Program, graph: Graph) -> dict[str, str]:
    """The memory kind (`MEMORY_KINDS`) of every tensor of the program: a collective's result
    is a buffer, any other tensor has its graph value's kind (`memory_kinds`)."""
    kinds = memory_kinds(graph)
    return {name: "buffers" if t.name != t.value else kinds[t.value]
            for name, t in program.tensors.items()}  # fmt: skip
