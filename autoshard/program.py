"""The sharded program: the "distributed tensors" of docs/design/lowering.md made explicit.

Materialization turns a graph and its completed shardings into a `Program`; the CCL passes
rewrite programs; the MLIR printer prints them; partition turns them into what each device
runs. A program is in SSA form over *global* tensors: every `Tensor` has its global shape and
the sharding it is held in, every op computes with a sharding option, and every change of
sharding is an explicit `Communicate` step carrying one collective. One graph value may be held
by several tensors (`x`, then `x~1` after an all_gather); `Tensor.value` names the graph value.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from autoshard.collectives import Collective
from autoshard.ir.fused import Fused
from autoshard.ir.graph import Op, TensorLike
from autoshard.mesh import Mesh
from autoshard.sharding import Sharding, ShardingOption


@dataclass(frozen=True)
class Tensor(TensorLike):
    """An SSA value: `name` is unique in the program, `value` the graph value it holds."""

    name: str
    value: str
    shape: tuple[int, ...]
    dtype: str
    sharding: Sharding


@dataclass(frozen=True)
class Compute:
    """An op of the graph computing with `option` (None: no rule, computed replicated). Its
    `op.inputs` and `op.outputs` are SSA tensor names ("" for an absent optional operand)."""

    op: Op
    option: ShardingOption | None

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.op.inputs

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.op.outputs


@dataclass(frozen=True)
class Communicate:
    """One collective from tensor `source` to tensor `target`."""

    source: str
    target: str
    collective: Collective

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.source,)

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.target,)


Step = Compute | Communicate


def step_index(
    steps: Sequence[Step], outputs: Sequence[str]
) -> tuple[dict[str, int], dict[str, list[int]]]:
    """The step defining each tensor, and the steps reading it (-1 for each graph output it
    is; a step reading it twice is listed twice)."""
    producers: dict[str, int] = {}
    readers: dict[str, list[int]] = {}
    for i, step in enumerate(steps):
        for name in step.outputs:
            producers.setdefault(name, i)
        for name in step.inputs:
            if name:
                readers.setdefault(name, []).append(i)
    for name in outputs:
        readers.setdefault(name, []).append(-1)
    return producers, readers


@dataclass(frozen=True)
class Program:
    """`inputs` are the graph inputs then the weights, held as `tensors` says; `constants` are
    replicated values known at compile time (their data here); `outputs` the returned tensors
    in graph output order. The `replaced` inputs are written over by a training step's update
    (`Graph.updates`): live until their last reader, not throughout; the `accumulated`
    gradients of several micro-batches are live from the start."""

    name: str
    mesh: Mesh
    tensors: Mapping[str, Tensor]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    steps: tuple[Step, ...]
    constants: Mapping[str, np.ndarray] = field(default_factory=dict)
    unruled: tuple[str, ...] = ()
    replaced: frozenset[str] = frozenset()  # inputs a training step writes over
    accumulated: frozenset[str] = frozenset()  # gradients held from the start (micro-batches)
    fused: Fused = Fused()  # the graph's fused kernels: what they keep of the values inside

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))
        object.__setattr__(self, "constants", MappingProxyType(dict(self.constants)))

    @property
    def communications(self) -> Iterator[Communicate]:
        return (s for s in self.steps if isinstance(s, Communicate))

    @property
    def bytes_per_device(self) -> int:
        return sum(s.collective.bytes_per_device for s in self.communications)

    def collectives_json(self) -> list[dict[str, object]]:
        """The collectives of `autoshard propagate --json`: each with the graph value it moves
        and the op that reads its result (null when it feeds an output or another collective)."""
        users = step_index(self.steps, self.outputs)[1]
        ops = [s.op.name if isinstance(s, Compute) else None for s in self.steps]
        out = []
        for step in self.communications:
            readers = [ops[i] for i in users.get(step.target, []) if i >= 0 and ops[i]]
            out.append(
                {
                    "value": self.tensors[step.source].value,
                    "user": readers[0] if readers else None,
                    **step.collective.to_json(),
                }
            )
        return out
