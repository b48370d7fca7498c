"""A model cut to fewer of its repeated layers: what one pipeline stage of it looks like.

A pipeline stage holds a contiguous run of the model's repeated layers, and the first and last
stages the ops before and after them (the embedding; the final norm, the head, the loss).
Repeated layers are alike, so the intra-stage plan of a stage of `k` layers is the plan of
the model with its layers cut to the first `k`: the search solves that smaller model once
and the plan stands for every stage (`search.pipelined`), its cost independent of the depth
of the whole model.

`shortened` drops the layers `k` onwards of the forward's largest run and has what read the
last layer's results read layer `k - 1`'s instead (same op, same output, by the run's
correspondence; a dropped layer's result the model returns becomes layer `k - 1`'s, returned
once); weights and values only the dropped ops read go with them.

Worked example: `x -> E -> [a0 b0] [a1 b1] [a2 b2] -> h -> y`, cut to 1 layer, is
`x -> E -> [a0 b0] -> h -> y`, where h reads b0's result in place of b2's.
"""

from __future__ import annotations

import dataclasses

from autoshard.analysis.repeats import Run, find_repeats
from autoshard.ir.fused import Fused
from autoshard.ir.graph import Graph, Op


def layer_run(graph: Graph) -> Run | None:
    """The forward's repeated layers: the largest run of at least two (None: none)."""
    runs = [run for run in find_repeats(graph).runs if run.count >= 2]
    return max(runs, key=lambda r: (r.ops, -r.start), default=None)


def shortened(graph: Graph, layers: int, run: Run | None = None) -> Graph:
    """The forward `graph` with its layers (`run`, else `layer_run`) cut to the first
    `layers` (the module's docstring); `graph` itself where it has no more. Attention fused
    in `graph` is to be found again on the result (its `fused` is empty)."""
    run = layer_run(graph) if run is None else run
    if run is None or layers >= run.count:
        return graph
    if layers < 1:
        raise ValueError(f"a model cut to {layers} layers has none")
    dropped = {i for layer in run.layers[layers:] for i in layer}
    renamed = {
        old: new
        for layer in run.layers[layers:]
        for gone, kept in zip(layer, run.layers[layers - 1], strict=True)
        for old, new in zip(graph.ops[gone].outputs, graph.ops[kept].outputs, strict=True)
    }
    ops = tuple(_reading(op, renamed) for i, op in enumerate(graph.ops) if i not in dropped)
    outputs = tuple(dict.fromkeys(renamed.get(name, name) for name in graph.outputs))
    used = {name for op in ops for name in (*op.inputs, *op.outputs)}
    used |= set(outputs) | set(graph.inputs)
    gone = {name for i in dropped for name in (*graph.ops[i].inputs, *graph.ops[i].outputs)}
    gone -= used
    return dataclasses.replace(
        graph, ops=ops, outputs=outputs,
        values={k: v for k, v in graph.values.items() if k not in gone},
        weights={k: w for k, w in graph.weights.items() if k not in gone},
        constants={k: c for k, c in graph.constants.items() if k not in gone},
        buffers=graph.buffers - gone, fused=Fused(),
    )  # fmt: skip


def _reading(op: Op, renamed: dict[str, str]) -> Op:
    if not any(name in renamed for name in op.inputs):
        return op
    return dataclasses.replace(op, inputs=tuple(renamed.get(name, name) for name in op.inputs))
