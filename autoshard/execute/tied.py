"""Weights trained on several pipeline stages (an embedding tied to the LM head: the first and
the last stage), kept equal as Megatron keeps them: each stage holds its own copy, and after
the backward the stages' gradients are summed before the update.

Each stage holding a tied weight `w` reads it as the stage's model does (both ends keep their
own names, so every copy takes the same decisions). Its step makes `w`'s gradient `w@grad`
(`training.step.gradient_name`) from its own uses only; the sum is an all-reduce over the
devices at the same place in the stages holding `w` (one group per place in the stage mesh),
run once the pipeline drains (the last micro-batch's backward pauses before anything reads
the gradient, `run.stage_device`). Both copies
then take the same update from the same total, so they stay equal bit for bit (gloo's sum of
two gives both the same bytes). The cost model prices the same all-reduce
(`cost.price.tied_sync_time`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autoshard.execute.stage_plans import PipelinedPartition, StageMapError, StagePartition
from autoshard.mlir import Dialect
from autoshard.mlir.syntax import TensorType, quote
from autoshard.training.step import gradient_name


@dataclass(frozen=True)
class Tied:
    """Weight `weight` trained on `stages` (stage or chunk indices): its gradient `gradient`
    summed over each group of `groups` (whole-mesh ranks, one group per place in the stage
    mesh, in the stages' order)."""

    weight: str
    gradient: str
    stages: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]

    def to_json(self) -> dict[str, Any]:
        return {"weight": self.weight, "gradient": self.gradient, "stages": list(self.stages),
                "groups": [list(g) for g in self.groups]}  # fmt: skip

    def collective(self, dtype: str, shapes: Sequence[Sequence[int]], world: int) -> dict[str, Any]:
        """The all-reduce as a whole-mesh collective entry (`run.collectives.Executor`):
        `shapes` the gradient's local shape on each place in the stage mesh."""
        full: list[list[int]] = [[] for _ in range(world)]
        for group, shape in zip(self.groups, shapes, strict=True):
            for rank in group:
                full[rank] = list(shape)
        return {"kind": "all_reduce", "source": self.gradient, "target": self.gradient,
                "dtype": dtype, "reduction": "sum", "groups": [list(g) for g in self.groups],
                "source_shapes": full, "target_shapes": full}  # fmt: skip


def tied_weights(stages: Sequence[StagePartition]) -> tuple[Tied, ...]:
    """The weights trained on more than one of `stages`, each checked to be held alike by
    every stage that trains it (the same holding of its gradient, devices apart)."""
    by_weight: dict[str, list[StagePartition]] = {}
    for stage in stages:
        graph = stage.built.graph
        for w in sorted(graph.weights):
            if gradient_name(w) in graph.values:
                by_weight.setdefault(w, []).append(stage)
    found = []
    for w, holders in sorted(by_weight.items()):
        if len(holders) < 2:
            continue
        g = gradient_name(w)
        held = {s.built.plan.values[g] for s in holders if g in s.built.plan.values}
        indices = [s.cut.index for s in holders]
        if len(held) != 1:
            raise StageMapError(
                f"parameter {w!r} is trained on stages {indices} but its gradient is held "
                f"differently on them ({', '.join(sorted(map(str, held)))}): plan again"
            )
        groups = tuple(zip(*(s.devices for s in holders), strict=True))
        if any(len(set(group)) < len(group) for group in groups):
            raise StageMapError(
                f"parameter {w!r} is trained on stages {indices}, which share devices: a "
                "device would hold it twice; choose another schedule"
            )
        found.append(Tied(w, g, tuple(indices), groups))
    return tuple(found)


def local_shapes(tied: Tied, stage: StagePartition) -> list[list[int]]:
    """The gradient's local shape on each of `stage`'s devices (in its stage mesh's order)."""
    return [list(d.shapes[tied.gradient]) for d in stage.built.partitioned.devices]


def tied_json(staged: PipelinedPartition) -> list[dict[str, Any]]:
    """The pipeline block's `tied`: each tied weight, its gradient's dtype and local shapes."""
    stages = {s.cut.index: s for s in staged.stages}
    found = []
    for tied in tied_weights(staged.stages):
        stage = stages[tied.stages[0]]
        dtype = stage.built.partitioned.program.tensors[tied.gradient].dtype
        found.append(tied.to_json() | {"dtype": dtype, "local_shapes": local_shapes(tied, stage)})
    return found


@dataclass(frozen=True)
class TiedText:
    """A stage function's part for its tied weights: arguments (each gradient), body, and
    results (each summed gradient and its type)."""

    args: tuple[str, ...] = ()
    body: tuple[str, ...] = ()
    results: tuple[tuple[str, str], ...] = ()


def tied_mlir(staged: PipelinedPartition, stage: StagePartition, dialect: str) -> TiedText:
    """Stage `stage`'s sum of its tied weights' gradients as MLIR (`pipe_folder.p2p_text`):
    its gradient exchanged with each other stage holding the weight on the pipeline axis and
    added, in the stages' order (an all-reduce over the pair)."""
    mesh, axis, s = staged.mesh, staged.axis, stage.cut.index
    axes = "mesh_axes" if dialect == Dialect.MESH else "grid_axes"
    lines: list[str] = []
    args, results = [], []
    for k, tied in enumerate(t for t in tied_weights(staged.stages) if s in t.stages):
        shapes = {tuple(shape) for shape in local_shapes(tied, stage)}
        dims = tuple(d[0] if len(set(d)) == 1 else None for d in zip(*shapes, strict=True))
        t = TensorType(dims, stage.built.partitioned.program.tensors[tied.gradient].dtype)
        loc = f"loc({quote(tied.gradient)})"
        args.append(f"%tied{k}_in: {t}")
        lines.append(f"// {tied.weight} is tied: its gradient summed over stages "
                     f"{list(tied.stages)} (an all-reduce over each pair of devices)")  # fmt: skip
        terms = []
        for other in tied.stages:
            if other == s:
                terms.append(f"%tied{k}_in")
                continue
            peer = f"[{staged.position(other)}]"
            lines += [
                f"%tied{k}_send{other} = {dialect}.send %tied{k}_in on @{mesh.name} {axes} = "
                f"[{axis}] destination = {peer} : ({t}) -> {t} {loc}",
                f"%tied{k}_e{other} = tensor.empty() : {t}",
                f"%tied{k}_recv{other} = {dialect}.recv %tied{k}_e{other} on @{mesh.name} "
                f"{axes} = [{axis}] source = {peer} : ({t}) -> {t} {loc}",
            ]  # fmt: skip
            terms.append(f"%tied{k}_recv{other}")
        total = terms[0]
        for j, term in enumerate(terms[1:]):
            lines.append(f"%tied{k}_sum{j} = arith.addf {total}, {term} : {t} {loc}")
            total = f"%tied{k}_sum{j}"
        results.append((total, str(t)))
    return TiedText(tuple(args), tuple(lines), tuple(results))
