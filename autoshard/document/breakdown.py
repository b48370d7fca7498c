"""Where the time and memory go: a priced plan's compute and communication per repeated layer
(a layer once, and times its count), per op type and per mesh axis, its top collectives by
time, and the memory live at its peak by kind, per repeated layer and for the rest.

Figures are the cost model's (`cost.price`: each op's compute, each collective's time charged
to the op it serves; `cost.memory`: the tensors live at the peak), regrouped, so they add up to
the plan's `compute_time_s`, `comm_time_s` and `memory_bytes_per_device`. A training step has
several runs of repeated layers (the forward layers, their backward, their updates): each is
told apart, with its phase.

A tensor live at the peak belongs to the op that computes it, a collective's result (a buffer)
to the op it serves, and a weight, input or optimizer state to the first op reading it; so a
layer's weights are its own, and its activations live at the peak are those it computed that
some later op still reads. Layers are alike in what they compute but not in what is live at
the peak (in a forward pass the peak is in one layer): `one_layer` is the layer holding the
most, `all_layers` their sum.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from autoshard.analysis.repeats import Repeats, find_repeats
from autoshard.cost.liveness import MEMORY_KINDS, Memory
from autoshard.cost.price import Cost, held_at_peak
from autoshard.ir.graph import Graph
from autoshard.program import Program

TOP = 5
"""How many collectives `top_collectives` lists."""

Held = Mapping[str, Mapping[str, int]]
"""Op name ("" for none) -> memory kind -> bytes it holds at the peak."""


def _spent(cost: Cost, ops: Iterable[str]) -> dict[str, Any]:
    """Sums in program order (floats: the same plan, the same bytes)."""
    ordered = list(ops)
    names = set(ordered)
    comm: dict[str, float] = {}
    for c in cost.collectives:
        if c.op in names:
            comm[c.mesh_axes] = comm.get(c.mesh_axes, 0.0) + c.seconds
    return {
        "compute_s": sum(cost.ops[n].seconds for n in ordered if n in cost.ops),
        "comm_s_by_mesh_axes": dict(sorted(comm.items())),
    }


def _kinds(held: Held, ops: Iterable[str]) -> dict[str, int]:
    """Bytes by kind (every kind of `MEMORY_KINDS`, in its order) that `ops` hold at the peak."""
    found = dict.fromkeys(MEMORY_KINDS, 0)
    for op in ops:
        for kind, size in held.get(op, {}).items():
            found[kind] += size
    return found


def breakdown(
    graph: Graph,
    program: Program,
    cost: Cost,
    repeats: Repeats | None = None,
    peak: Memory | None = None,
) -> dict[str, Any]:
    """The plan document's `breakdown` block; `repeats` (the graph's `find_repeats`) and
    `peak` (the program's `memory`) when the caller has them."""
    names = [op.name for op in graph.ops]
    held, at_op = held_at_peak(graph, program, peak)
    runs, inside = [], set()
    repeats = find_repeats(graph) if repeats is None else repeats
    for run in repeats.runs:
        if run.count < 2:
            continue
        each = [[names[i] for i in layer] for layer in run.layers]
        first, every = each[0], [name for layer in each for name in layer]
        inside.update(every)
        layers = [_kinds(held, layer) for layer in each]
        most = max(range(run.count), key=lambda j: (sum(layers[j].values()), -j))
        runs.append({
            "phase": graph.phase(first[0]), "first_op": first[0], "ops_per_layer": run.period,
            "layers": run.count, "one_layer": _spent(cost, first),
            "all_layers": _spent(cost, every),
            "memory_at_peak": {"one_layer": layers[most], "one_layer_index": most,
                               "all_layers": _kinds(held, every)},
        })  # fmt: skip
    by_type: dict[str, float] = {}
    for op in graph.ops:
        if op.name in cost.ops:
            by_type[op.type] = by_type.get(op.type, 0.0) + cost.ops[op.name].seconds
    top = sorted(cost.collectives, key=lambda c: (-c.seconds, c.index))[:TOP]
    rest = [n for n in names if n not in inside]
    return {
        "repeated_layers": runs,
        "rest": _spent(cost, rest) | {"memory_at_peak": _kinds(held, [*rest, ""])},
        "compute_s_by_op_type": dict(sorted(by_type.items(), key=lambda kv: (-kv[1], kv[0]))),
        "top_collectives": [c.to_json() for c in top],
        "memory_peak": {
            "bytes_per_device": cost.memory_bytes_per_device,
            "at_op": at_op,
            "by_kind": _kinds(held, held),
        },
    }
