"""A pipelined plan on the whole model. Its decisions are one stage's: the model cut to
`stage_model_layers` repeated layers (`analysis.shorten`), a plan that stands for every stage.
Each layer of the whole model runs as the layer of the stage's model the search priced it as
(`search.pipelined.model_layer`), so it is held so: op for op and weight for weight by the
run's correspondence (op `k` of layer `g` is a copy of op `k` of layer `j`, its weights in
the same input slots).

Worked example: a plan of 4 layers cut to 2 holds layers 1 and 2 as layer 0 (each borders a
layer on both sides) and layer 3 as layer 1 (it borders the head).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from autoshard.analysis.shorten import layer_run
from autoshard.document.blocks import Decisions, WeightStrategy
from autoshard.document.plan_document import PlanDocument
from autoshard.ir.graph import Graph
from autoshard.search.pipelined import model_layer


def unrolled(
    document: PlanDocument, graph: Graph
) -> tuple[Decisions, Mapping[str, WeightStrategy]]:
    """The decisions and weight strategies of `document` on `graph`, the whole forward (the
    module's docstring); a plan without a pipeline, or one whose stage's model is the whole
    model, as it is."""
    decisions = document.decisions
    strategies = document.strategy.weights if document.strategy is not None else {}
    depth = (document.pipeline or {}).get("stage_model_layers", 0)
    run = layer_run(graph)
    if not depth or run is None or depth >= run.count:
        return decisions, strategies
    ops, values, kept = dict(decisions.ops), dict(decisions.values), dict(strategies)
    for layer in range(depth - 1, run.count):
        like = model_layer(layer, depth, run.count)
        for mine, theirs in zip(run.layers[layer], run.layers[like], strict=True):
            op, other = graph.ops[mine], graph.ops[theirs]
            if other.name in decisions.ops:
                ops[op.name] = decisions.ops[other.name]
            for name, same in zip(op.inputs, other.inputs, strict=True):
                if name == same or name not in graph.weights or same not in decisions.values:
                    continue
                values[name] = decisions.values[same]
                if same in strategies:
                    kept[name] = strategies[same]
    return dataclasses.replace(decisions, ops=ops, values=values), kept
