"""A forward graph cut into pipeline stages: each stage's ops of the whole model, what it
receives from the stage before and what it sends to the stage after.

Stage `s` holds the repeated layers of its range (`Run` layers), the first stage also the ops
before them (the embedding), the last the ops after them (the final norm, the head). An op in
no layer between two layers (computed from parameters alone, not in every layer) goes with
the next layer. A value computed on stage `p` and read on stage `q > p` crosses every boundary
between them: stage `p` sends it, each stage in between receives it and sends it on (without
reading it, where it does not), stage `q` receives it. Graph inputs, weights and constants
never cross: every stage takes what it reads. A model output is returned by the stage that
computes it.

Worked example: `x -> E -> [a0 b0] [a1 b1] -> h -> y` in stages `[0, 1)` and `[1, 2)` is stage
0 `x -> E -> a0 b0 -> (b0's result sent)` and stage 1 `(b0's result received) -> a1 b1 -> h
-> y`; were the mask `m = E'(x)` read by every layer, stage 0 would send it too.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from autoshard.analysis.repeats import Run
from autoshard.errors import AutoshardError
from autoshard.ir.fused import Fused
from autoshard.ir.graph import Graph, Op


class StageCutError(AutoshardError):
    """Stages that do not cut the model: ranges that miss layers, an output no stage computes."""


@dataclass(frozen=True)
class StageCut:
    """Stage `index`: its repeated `layers`, its ops of the whole model as a graph (inputs: the
    graph inputs it reads, then what it receives and reads; outputs: what it sends that it
    computes, then the model outputs it computes), and the boundary values it `receives`
    from the stage before and `sends` to the stage after, in graph order."""

    index: int
    layers: range
    graph: Graph
    receives: tuple[str, ...]
    sends: tuple[str, ...]


def op_stages(graph: Graph, run: Run, ranges: Sequence[range]) -> tuple[int, ...]:
    """The stage of each op of `graph` (module docstring)."""
    if not ranges or ranges[0].start != 0 or ranges[-1].stop != run.count or any(
        a.stop != b.start or not a for a, b in zip(ranges, ranges[1:], strict=False)
    ):  # fmt: skip
        spans = " ".join(f"{r.start}..{r.stop - 1}" for r in ranges)
        raise StageCutError(
            f"stages of layers {spans} do not cover the model's {run.count} repeated layers "
            "in order"
        )
    stops = [r.stop for r in ranges]
    firsts = [min(layer) for layer in run.layers]
    last = max(run.layers[-1])
    found = []
    for i in range(len(graph.ops)):
        layer = run.layer(i)
        if layer is None:
            layer = 0 if i < firsts[0] else run.count - 1 if i > last else bisect.bisect(firsts, i)
        found.append(bisect.bisect(stops, layer))
    return tuple(found)


def cut_stages(graph: Graph, run: Run, ranges: Sequence[range]) -> tuple[StageCut, ...]:
    """The stages of `graph` whose repeated layers `run` are split as `ranges`."""
    stage_of = op_stages(graph, run, ranges)
    count = len(ranges)
    produced = {out: stage_of[i] for i, op in enumerate(graph.ops) for out in op.outputs if out}
    read_last: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        for name in op.inputs:
            if name in produced:
                read_last[name] = max(read_last.get(name, 0), stage_of[i])
    unmade = [n for n in graph.outputs if n not in produced]
    if unmade:
        raise StageCutError(
            f"model output {unmade[0]!r} is computed by no op: no stage can return it"
        )
    order = list(produced)
    crossing = [[n for n in order if produced[n] <= s < read_last.get(n, -1)] for s in range(count)]
    return tuple(
        StageCut(
            index=s,
            layers=ranges[s],
            graph=_stage_graph(
                graph,
                [op for i, op in enumerate(graph.ops) if stage_of[i] == s],
                crossing[s - 1] if s else [],
                crossing[s],
                produced,
                s,
            ),
            receives=tuple(crossing[s - 1]) if s else (),
            sends=tuple(crossing[s]),
        )  # fmt: skip
        for s in range(count)
    )


def _stage_graph(
    graph: Graph, ops: list[Op], receives: list[str], sends: list[str],
    produced: dict[str, int], stage: int,
) -> Graph:  # fmt: skip
    """Stage `stage`'s ops as a graph of their own."""
    read = {name for op in ops for name in op.inputs if name}
    inputs = [n for n in graph.inputs if n in read] + [n for n in receives if n in read]
    outputs = [n for n in sends if produced[n] == stage]
    outputs += [n for n in graph.outputs if produced[n] == stage and n not in outputs]
    used = read | {name for op in ops for name in op.outputs if name} | set(inputs)
    return dataclasses.replace(
        graph, name=f"{graph.name}_stage{stage}", ops=tuple(ops), inputs=tuple(inputs),
        outputs=tuple(outputs), values={k: v for k, v in graph.values.items() if k in used},
        weights={k: w for k, w in graph.weights.items() if k in used},
        constants={k: c for k, c in graph.constants.items() if k in used},
        buffers=graph.buffers & used, updates={}, phases={}, fused=Fused(),
    )  # fmt: skip
