"""The report's weights table: how each weight is held and read, the weights of the repeated
layers one row per role.

A 70B decoder has hundreds of weights, most of them copies of a dozen roles of one layer; a
row each makes the page tens of screens tall. So the weights that the forward's repeated
layers (`analysis.repeats.find_repeats`) read at the same place of their layer share one row,
named with a layer's index as `*` (`layers.*.attn.q_proj.weight`) and their count; copies held
or read differently are one row per variant, with its count. The weights outside the layers
are one row each.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from autoshard.analysis.repeats import Run, find_repeats
from autoshard.cost.liveness import shard_bytes
from autoshard.document.plan_document import PlanDocument
from autoshard.holding import words_of
from autoshard.html.markup import esc, size, tag
from autoshard.ir.graph import FORWARD, Graph
from autoshard.names import is_constant
from autoshard.plan import Plan
from autoshard.training.strategy import held_as


def weight_roles(graph: Graph, weights: Sequence[str]) -> list[list[str]]:
    """`weights` grouped by role: those the same op of each forward repeated layer reads at
    the same inputs share a group (in layer order); any other weight is a group of its own.
    Groups come in the order of their first weight."""
    repeats = find_repeats(graph)
    runs: list[Run] = [
        r for r in repeats.runs if r.count > 1 and graph.phase(graph.ops[r.start].name) == FORWARD
    ]
    index = {op.name: i for i, op in enumerate(graph.ops)}
    groups: dict[object, list[str]] = {}
    for name in weights:
        key: object = name
        readers = [index[op.name] for op in graph.consumers(name)]
        for r, run in enumerate(runs):
            first = run.first(min(readers)) if readers else None
            if first is not None:
                op = graph.ops[min(readers)]
                slots = tuple(k for k, x in enumerate(op.inputs) if x == name)
                key = (r, first, slots)
                break
        groups.setdefault(key, []).append(name)
    out: list[list[str]] = []
    for members in groups.values():
        out.extend([members] if len(members) > 1 else [[m] for m in members])
    return out


def pattern(names: Sequence[str]) -> str:
    """The names with each run of digits that differs among them as `*`
    (`layers.0.mlp.weight`, `layers.1.mlp.weight` -> `layers.*.mlp.weight`); names that differ
    otherwise are told by their first and last."""
    if len(set(names)) <= 1:
        return names[0] if names else ""
    parts = [re.split(r"(\d+)", n) for n in names]
    if len({len(p) for p in parts}) == 1:
        out = []
        for column in zip(*parts, strict=True):
            if len(set(column)) == 1:
                out.append(column[0])
            elif all(c.isdigit() for c in column):
                out.append("*")
            else:
                break
        else:
            return "".join(out)
    return f"{names[0]} \u2026 {names[-1]}"


def weights_table(
    document: PlanDocument, graph: Graph, plan: Plan, names: Mapping[str, Sequence[str]]
) -> tuple[str, int, int]:
    """The table's markup, the weights it tells of and its rows."""
    strategies = document.strategy.weights if document.strategy is not None else {}
    header = ["weight (source parameter)", "copies", "shape", "dtype", "per device", "held",
              "used", "held as"]  # fmt: skip
    if strategies:
        header += ["optimizer state"]
    shown = [n for n, w in graph.weights.items() if n not in graph.constants and not is_constant(w)]
    rows = [tag("tr", "".join(tag("th", esc(h)) for h in header))]
    for group in weight_roles(graph, shown):
        variants: dict[tuple[str, ...], list[str]] = {}
        for name in group:
            variants.setdefault(_cells(document, graph, plan, name), []).append(name)
        for cells, members in variants.items():
            params = [[p for p in names.get(m, ()) if p != m] for m in members]
            told = [", ".join(p) for p in params]
            source = pattern(told) if all(told) else ""
            head = tag("code", esc(pattern(members)), class_="name")
            head += tag("span", esc(source), class_="param") if source else ""
            copies = f"{len(members)}" + (f" of {len(group)}" if len(variants) > 1 else "")
            row = [head, esc(copies), *cells]
            rows.append(tag("tr", "".join(tag("td", c) for c in row), data_copies=len(members)))
    return tag("table", "".join(rows), class_="weights"), len(shown), len(rows) - 1


def _cells(document: PlanDocument, graph: Graph, plan: Plan, name: str) -> tuple[str, ...]:
    """A weight's cells after its name and count: shape, dtype, bytes per device, how it is
    held and read, how it is held in `autoshard.holding`'s words (a training plan's strategy;
    a weight it does not train as its forward holds it), and a training plan's optimizer
    state."""
    value = graph.values[name]
    held = plan.values[name]
    reads: dict[str, int] = {}
    entry = document.values.get(name)
    for text in ((entry.read_as if entry is not None else None) or {}).values():
        reads[text] = reads.get(text, 0) + 1
    used = "<br>".join(
        tag("code", esc(t)) + esc(f" ({n} op{'s' if n > 1 else ''})") for t, n in reads.items()
    )
    cells = [
        esc("x".join(map(str, value.shape)) or "scalar"),
        esc(value.dtype),
        esc(size(shard_bytes(value.shape, value.dtype, held, plan.mesh))),
        tag("code", esc(held.text(len(value.shape)))),
        used or "not read",
    ]
    strategies = document.strategy.weights if document.strategy is not None else {}
    s = strategies.get(name)
    cells.append(esc(words_of(s.strategy) if s else held_as(graph, plan, name).words))
    if strategies:
        cells.append(tag("code", esc(s.state if s else "-")))
    return tuple(cells)
