"""Materialization (docs/design/lowering.md): a graph and its completed shardings become a sharded
`Program`.

Wherever a value is held in another sharding than a user computes with, a reshard is inserted
and lowered to collectives by `plan_reshard` (the planner that also prices it). Reshards appear
in program order: a value whose required result annotation differs from what its producer
computes is resharded right after the producer; each use then gets what its op needs. Uses
that need the same sharding of a value share one reshard, so the bytes counted are the bytes
the program sends; but a training step's backward reshards a weight or input again rather
than keep the forward's buffer alive (FSDP gathers a weight before each use), and so a
recomputed layer's inputs (`reshards_again`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from autoshard.ir import dtypes
from autoshard.ir.graph import FORWARD, Graph
from autoshard.plan import RETURN, Plan
from autoshard.program import Communicate, Compute, Program, Step, Tensor
from autoshard.reshard import plan_reshard
from autoshard.rules.gradient import RECOMPUTE_OF, accumulated_gradients
from autoshard.sharding import Sharding


class _Builder:
    """Names SSA tensors and emits the collectives that bring a value to a sharding."""

    def __init__(self, graph: Graph, plan: Plan) -> None:
        self.graph, self.mesh = graph, plan.mesh
        self.tensors: dict[str, Tensor] = {}
        self.steps: list[Step] = []
        self.held: dict[str, dict[Sharding, str]] = {}  # value -> sharding -> tensor name
        self.home: dict[str, str] = {}  # value -> the tensor holding it as `values` says
        self.made: dict[str, int] = {}  # value -> tensors made of it

    def define(self, value: str, sharding: Sharding) -> str:
        info = self.graph.values[value]
        held = self.held.setdefault(value, {})
        made = self.made[value] = self.made.get(value, -1) + 1
        name = f"{value}~{made}" if made else value
        self.tensors[name] = Tensor(name, value, info.shape, info.dtype, sharding)
        held[sharding] = name
        self.home.setdefault(value, name)
        return name

    def reach(self, value: str, sharding: Sharding) -> str:
        """The tensor holding `value` in `sharding`, resharded from its home tensor when no
        tensor holds it so yet."""
        held = self.held[value]
        if sharding in held:
            return held[sharding]
        info = self.graph.values[value]
        current = start = self.home[value]
        size = dtypes.nbytes(info.dtype, 1)
        steps = plan_reshard(self.tensors[start].sharding, sharding, info.shape, self.mesh, size)
        made_steps = taken([c.dst for c in steps], held)
        for collective, made in zip(steps, made_steps, strict=True):
            if not made:  # a step already taken for another user: reuse it
                current = held[collective.dst]
                continue
            target = self.define(value, collective.dst)
            self.steps.append(Communicate(current, target, collective))
            current = target
        return current


def taken(targets: Sequence[Sharding], reached: Collection[Sharding]) -> list[bool]:
    """Which steps of a reshard (by the sharding each reaches, `targets`) materialization
    makes, the value already held in the shardings `reached` (by its home and its earlier
    reshards): a step to one of those is reused, not made again. The search prices a plan's
    communication by the same rule (`search.traffic`)."""
    seen = set(reached)
    made = []
    for target in targets:
        made.append(target not in seen)
        seen.add(target)
    return made


def backward_starts(graph: Graph) -> list[int]:
    """The positions of the ops where a training step's backward begins after forward ops:
    there materialization reshards a weight (an input, a constant) again rather than keep
    the forward's buffers of it (FSDP gathers a weight before each use)."""
    ops = graph.ops
    return [
        p for p in range(1, len(ops))
        if graph.phase(ops[p].name) != FORWARD == graph.phase(ops[p - 1].name)
    ]  # fmt: skip


def reshards_again(graph: Graph) -> frozenset[str]:
    """The values a training step's backward reshards again rather than keep the forward's
    reshards of alive: the weights, inputs and constants (FSDP gathers a weight before each
    use), and the forward values a recomputed op reads (a recomputed layer's inputs: its
    recompute gathers a sequence-split input again, as Megatron's sequence parallelism does,
    rather than keep the gathered copy from the forward to the backward)."""
    recomputing = {n for op in graph.ops if op.attr(RECOMPUTE_OF, "") for n in op.inputs if n}
    again = set()
    for name in graph.values:
        producer = graph.producer(name)
        if producer is None or (name in recomputing and graph.phase(producer.name) == FORWARD):
            again.add(name)
    return frozenset(again)


def materialize(graph: Graph, plan: Plan) -> Program:
    """The sharded program of a completed plan, in the graph's op order."""
    build = _Builder(graph, plan)
    values, needs = plan.values, plan.needs
    inputs = tuple(graph.inputs) + tuple(n for n in graph.weights if n not in graph.inputs)
    for name in inputs + tuple(graph.constants):
        if name in graph.values:
            build.define(name, values[name])
    again = reshards_again(graph)
    starts = set(backward_starts(graph))
    for position, op in enumerate(graph.ops):
        if position in starts:
            # The backward gathers a weight (an input, a constant, a recomputed layer's
            # input) again, as FSDP does: the forward's buffers of it are gone.
            for name in again & build.home.keys():
                home = build.home[name]
                build.held[name] = {build.tensors[home].sharding: home}
        renamed = tuple(
            build.reach(name, needs[(op.name, i)]) if name else ""
            for i, name in enumerate(op.inputs)
        )
        outputs = tuple(build.define(n, plan.produced[n]) if n else "" for n in op.outputs)
        build.steps.append(
            Compute(
                dataclasses.replace(op, inputs=renamed, outputs=outputs),
                plan.options[op.name],
            )
        )
        for name in op.outputs:
            if name and values[name] != plan.produced[name]:
                build.home[name] = build.reach(name, values[name])
    outputs = tuple(build.reach(name, needs[(RETURN, i)]) for i, name in enumerate(graph.outputs))
    return Program(
        graph.name,
        plan.mesh,
        build.tensors,
        tuple(n for n in inputs if n in graph.values),
        outputs,
        tuple(build.steps),
        {n: a for n, a in graph.constants.items() if n in graph.values},
        plan.unruled,
        frozenset(graph.replaced & set(inputs)),
        accumulated_gradients(graph),
        graph.fused,
    )
