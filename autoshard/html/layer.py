"""The report's picture of one repeated layer: each matrix multiply of the layer in program
order, a projection's weight split by column (its output features) or by row (its input
features: each device computes a partial sum), and every collective where the program places
it, between the op that makes its value and the op that reads it.

A 70B decoder's 80 layers are copies of one: the picture draws one layer, the one most layers
are like (the same sharding options and held weights at the same places), and says which
others are like it. A tight budget's plan may treat some layers otherwise: they are counted,
not drawn. A model without repeated layers is drawn whole, up to `ROWS_SHOWN` rows.

    op                        weight            split                 held as
    layers.3.attn.q_proj      ...q_proj.weight  column over tp        split (tensor parallel)
    layers.3.attn.scores      activations       result [[0], [1], ...]
    -> all_reduce of layers.3.attn.o_proj.out over tp, 32.00 MiB per device:
       after layers.3.attn.o_proj, before layers.3.attn.residual
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autoshard.analysis.patterns import Projection, find_projections
from autoshard.analysis.repeats import Run, find_repeats
from autoshard.document.blocks import CollectiveEntry
from autoshard.document.plan_document import PlanDocument
from autoshard.document.story import axes_text, column_axes, forward_view, row_axes
from autoshard.holding import Holding
from autoshard.html.markup import esc, size, tag
from autoshard.ir.graph import FORWARD, Graph, Op
from autoshard.plan import Plan
from autoshard.training.strategy import held_as

MATMULS = frozenset({"MatMul", "Gemm", "Einsum", "MatMulInteger", "FusedMatMul"})
"""The op types drawn: the matrix multiplies, with a weight (projections) or not (attention)."""

ROWS_SHOWN = 60
"""The rows drawn at most; a layer of a decoder has about twenty."""


@dataclass(frozen=True)
class Layer:
    """The ops drawn (a layer's, in graph order), which layer they are (None: the model has no
    repeated layers) and the layers alike, of how many."""

    ops: tuple[Op, ...]
    index: int | None
    alike: tuple[int, ...]
    count: int


def chosen_layer(graph: Graph, plan: Plan) -> Layer:
    """The forward's repeated layer most layers are like (the first of them); the forward ops
    when there are no repeated layers."""
    runs: list[Run] = [
        r for r in find_repeats(graph).runs
        if r.count > 1 and graph.phase(graph.ops[r.start].name) == FORWARD
    ]  # fmt: skip
    if not runs:
        ops = tuple(op for op in graph.ops if graph.phase(op.name) == FORWARD)
        return Layer(ops, None, (), 0)
    run = runs[0]
    groups: dict[tuple[str, ...], list[int]] = {}
    for j, layer in enumerate(run.layers):
        copies = [graph.ops[i] for i in layer]
        key = [str(plan.options.get(op.name)) for op in copies]
        key += [str(plan.values[x]) for op in copies for x in op.inputs if x in graph.weights]
        groups.setdefault(tuple(key), []).append(j)
    alike = max(groups.values(), key=lambda js: (len(js), -js[0]))
    ops = tuple(graph.ops[i] for i in sorted(run.layers[alike[0]]))
    return Layer(ops, alike[0], tuple(alike), run.count)


def layer_picture(
    document: PlanDocument, graph: Graph, plan: Plan, names: Mapping[str, Sequence[str]]
) -> tuple[str, str]:
    """The section's heading and markup: a note saying which layer is drawn, and its table."""
    layer = chosen_layer(graph, plan)
    heading = "One layer" if layer.index is not None else "The forward pass"
    rows = _rows(document, graph, plan, layer, names)
    head = tag("tr", "".join(tag("th", esc(h)) for h in ("op", "weight", "split", "held as")))
    body = [tag("tr", "".join(tag("td", c, **attrs) for c, attrs in row), class_=kind)
            for kind, row in rows[:ROWS_SHOWN]]  # fmt: skip
    if len(rows) > ROWS_SHOWN:
        more = f"\u2026 and {len(rows) - ROWS_SHOWN} more rows"
        body.append(tag("tr", tag("td", esc(more), colspan=4), class_="more"))
    table = tag("div", tag("table", head + "".join(body), class_="layer"), class_="scroll")
    return heading, tag("p", esc(_caption(layer)), class_="note") + table


def _caption(layer: Layer) -> str:
    what = (
        "Each matrix multiply, its weight split by column (output features) or by row (input "
        "features: partial sums, reduced after), and each collective between the op that makes "
        "its value and the op that reads it."
    )
    if layer.index is None:
        return f"The model has no repeated layers: its forward pass. {what}"
    alike, count = len(layer.alike), layer.count
    others = count - alike
    like = (
        f"all {count} are alike"
        if alike == count
        else f"it stands for {alike} of them ({_spans(layer.alike)}); {others} other"
        f"{'s' if others > 1 else ''} {'differ' if others > 1 else 'differs'}"
    )
    return f"Layer {layer.index} of the {count} repeated layers (forward): {like}. {what}"


def _spans(layers: Sequence[int]) -> str:
    """`0-19, 24` of sorted layer indexes."""
    spans: list[list[int]] = []
    for j in layers:
        if spans and spans[-1][-1] == j - 1:
            spans[-1].append(j)
        else:
            spans.append([j])
    return ", ".join(f"{s[0]}-{s[-1]}" if len(s) > 1 else str(s[0]) for s in spans)


Cells = list[tuple[str, dict[str, object]]]


def _rows(
    document: PlanDocument, graph: Graph, plan: Plan, layer: Layer,
    names: Mapping[str, Sequence[str]],
) -> list[tuple[str, Cells]]:  # fmt: skip
    """(class, cells) of each row: the layer's matrix multiplies and the collectives between
    them, in program order (a collective before the op that reads its result; one whose result
    no op reads, after the op that makes its value)."""
    forward = forward_view(graph)
    projections = find_projections(forward)
    inside = {op.name for op in layer.ops}
    before: dict[str, list[CollectiveEntry]] = {}
    after: dict[str, list[CollectiveEntry]] = {}
    for c in document.collectives:
        maker = graph.producer(c.value)
        if c.user in inside:
            before.setdefault(c.user, []).append(c)
        elif c.user is None and maker is not None and maker.name in inside:
            after.setdefault(maker.name, []).append(c)
    rows: list[tuple[str, Cells]] = []
    for op in layer.ops:
        rows += [("collective", _collective(graph, plan, c)) for c in before.get(op.name, [])]
        if op.name in projections:
            rows.append(("matmul", _projection(document, graph, plan, projections[op.name], names)))
        elif op.type in MATMULS:
            out = op.outputs[0]
            split = f"result {plan.produced[out].text(len(graph.values[out].shape))}"
            rows.append(("matmul", [(_name(op), {}), (esc("activations"), {}),
                                    (tag("code", esc(split)), {}), ("", {})]))  # fmt: skip
        rows += [("collective", _collective(graph, plan, c)) for c in after.get(op.name, [])]
    return rows


def _name(op: Op) -> str:
    return tag("code", esc(op.name), class_="name") + tag("span", esc(op.type), class_="param")


def _projection(
    document: PlanDocument, graph: Graph, plan: Plan, p: Projection,
    names: Mapping[str, Sequence[str]],
) -> Cells:  # fmt: skip
    column, row = column_axes(graph, plan, p), row_axes(graph, plan, p)
    mesh = plan.mesh
    told = []
    if column:
        told.append(f"column over {axes_text(mesh, column)}")
    if row:
        told.append(f"row over {axes_text(mesh, row)}: partial sums")
    weight = graph.values[p.weight]
    source = [n for n in names.get(p.weight, ()) if n != p.weight]
    named = tag("code", esc(p.weight), class_="name") + (
        tag("span", esc(", ".join(source)), class_="param") if source else ""
    )
    shape = tag("span", esc("x".join(map(str, weight.shape))), class_="param")
    return [(_name(graph.op_by_name[p.op]), {}), (named + shape, {}),
            (esc("; ".join(told) or "weight not split"), {}),
            (esc(_held(document, graph, plan, p.weight).words), {})]  # fmt: skip


def _held(document: PlanDocument, graph: Graph, plan: Plan, weight: str) -> Holding:
    """How the weight is held: a training plan's strategy, else held against read."""
    trained = document.strategy.weights.get(weight) if document.strategy is not None else None
    if trained is not None:
        return Holding(trained.strategy)
    return held_as(graph, plan, weight)


def _collective(graph: Graph, plan: Plan, c: CollectiveEntry) -> Cells:
    maker = graph.producer(c.value)
    where = [f"after {maker.name}" if maker is not None else f"of {c.value}"]
    where += [f"before {c.user}"] if c.user else []
    text = (
        f"\u2192 {c.kind} of {c.value} over {axes_text(plan.mesh, c.mesh_axes)}, "
        f"{size(c.bytes_per_device)} per device: {', '.join(where)}"
    )
    return [(esc(text), {"colspan": 4})]
