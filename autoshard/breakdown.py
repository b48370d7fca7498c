"""Where the time goes: a priced plan's compute and communication per repeated layer (a layer
once, and times its count), per op type and per mesh axis, and its top collectives by time.

Figures are the cost model's (`cost.price`: each op's compute, each collective's time charged
to the op it serves), regrouped, so they add up to the plan's `compute_time_s` and
`comm_time_s`. A training step has several runs of repeated layers (the forward layers, their
backward, their updates): each is told apart, with its phase.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from autoshard.cost.model import Cost
from autoshard.ir.graph import Graph
from autoshard.search.coarsen import find_repeats

TOP = 5
"""How many collectives `top_collectives` lists."""


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


def breakdown(graph: Graph, cost: Cost) -> dict[str, Any]:
    """The plan document's `breakdown` block."""
    names = [op.name for op in graph.ops]
    runs, inside = [], set()
    for run in find_repeats(graph).runs:
        if run.count < 2:
            continue
        first = names[run.start : run.start + run.period]
        every = names[run.start : run.start + run.ops]
        inside.update(every)
        runs.append({
            "phase": graph.phase(first[0]), "first_op": first[0], "ops_per_layer": run.period,
            "layers": run.count, "one_layer": _spent(cost, first),
            "all_layers": _spent(cost, every),
        })  # fmt: skip
    by_type: dict[str, float] = {}
    for op in graph.ops:
        if op.name in cost.ops:
            by_type[op.type] = by_type.get(op.type, 0.0) + cost.ops[op.name].seconds
    top = sorted(cost.collectives, key=lambda c: (-c.seconds, c.index))[:TOP]
    return {
        "repeated_layers": runs,
        "rest": _spent(cost, (n for n in names if n not in inside)),
        "compute_s_by_op_type": dict(sorted(by_type.items(), key=lambda kv: (-kv[1], kv[0]))),
        "top_collectives": [c.to_json() for c in top],
    }
