"""The HTML report of a plan: one self-contained page (inline CSS and SVG; no script, font or
image from anywhere, and a Content-Security-Policy that forbids them), a pure function of the
plan document, its graph, plan and program (`ReportInputs`).

Sections, each a `<section id=...>`: `strategy` (the story and the plan's figures), `mesh` (the
devices drawn, each axis's role and link), `layer` (one repeated layer's matrix multiplies,
split by column or row, and the collectives between its ops: `html.layer`), `time` (stacked
bars of compute and communication per mesh axis, per repeated layer and for the rest; a
training step's phases; the costliest op types and collectives), `memory` (bytes per device
over the program's steps against the budget, the peak marked, what is live there by kind),
`weights` (how each weight is held and read, by parameter name, the repeated layers' one row
per role), `layout` (which block of a tensor each device holds, for the largest weight and the
tensors asked for).

Deterministic: the same inputs give the same bytes (the only wall-clock figure is the plan's
own `timing`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from autoshard import __version__
from autoshard.cost.liveness import MEMORY_KINDS, memory, memory_timeline, tensor_kinds
from autoshard.cost.price import served_ops
from autoshard.document.blocks import ClusterInfo, CostFigures
from autoshard.document.plan_document import SCHEMA, PlanDocument
from autoshard.document.recipes import RECIPE_HEADER, Recipes, recipe_cells
from autoshard.document.story import recognise
from autoshard.errors import AutoshardError
from autoshard.html.charts import Band, Bar, Segment, memory_chart, stacked_bars
from autoshard.html.layer import layer_picture
from autoshard.html.markup import (
    COMPUTE,
    KIND_COLOURS,
    axes_colour,
    esc,
    ms,
    share,
    size,
    tag,
)
from autoshard.html.mesh import Cell, axis_label, mesh_svg
from autoshard.html.stages import stages_section
from autoshard.html.tensor import tensor_figure
from autoshard.html.weights import weights_table
from autoshard.ir.graph import Graph
from autoshard.mesh import Device, Mesh
from autoshard.plan import Plan
from autoshard.program import Compute, Program
from autoshard.rules.gradient import TRAIN, TrainOp
from autoshard.training.buffers import buffer_names, buffers_text
from autoshard.units import format_rate

LIVE_SHOWN = 3
"""The largest tensors of each memory kind named at the peak."""


class ReportError(AutoshardError):
    """A tensor asked for that the model does not have."""


@dataclass(frozen=True, eq=False)
class ReportInputs:
    """What the report is drawn from: the plan document (`autoshard plan --json`), the graph it
    plans, the plan and its program; each weight's source-model parameter names (empty where
    none is known); and the tensors whose layout to draw besides the largest weight."""

    document: PlanDocument
    graph: Graph
    plan: Plan
    program: Program
    names: Mapping[str, Sequence[str]] = field(default_factory=dict)
    tensors: Sequence[str] = ()


def html_report(inputs: ReportInputs) -> str:
    """The report as one HTML page."""
    doc, graph = inputs.document, inputs.graph
    chosen = layout_tensors(graph, inputs.tensors)
    title = f"autoshard plan: {doc.model.name or graph.name} on mesh {doc.mesh}"
    layer, picture = layer_picture(doc, graph, inputs.plan, inputs.names)
    sections = [
        ("strategy", "Strategy", _strategy(inputs)),
        ("mesh", "Mesh", _mesh(inputs)),
        ("layer", layer, picture),
        ("time", "Where the time goes", _time(doc, graph, inputs.plan.mesh)),
        ("memory", "Memory over the program", _memory(inputs)),
        ("weights", "Weights", _weights(inputs)),
        ("layout", "Tensor layouts", _layouts(inputs, chosen)),
    ]
    if doc.recipes is not None:
        sections.insert(1, ("recipes", "Beside the standard recipes", _recipes(doc.recipes)))
    if doc.pipeline is not None:
        sections.insert(1, ("stages", "Pipeline stages", stages_section(doc.pipeline)))
    subtitle = _subtitle(doc, inputs.plan.mesh.size)
    return html_page(title, subtitle, sections, f"plan schema {SCHEMA}")


def html_page(
    title: str, subtitle: str, sections: Sequence[tuple[str, str, str]], footnote: str
) -> str:
    """A page of the report's style: its title and subtitle, a bar of links to its sections
    (id, heading, markup), the sections, and a footer naming autoshard's version and
    `footnote`. Self-contained: inline CSS and SVG, and a Content-Security-Policy that lets
    nothing else load."""
    nav = tag("nav", " ".join(tag("a", esc(h), href=f"#{i}") for i, h, _ in sections))
    main = "".join(tag("section", tag("h2", esc(h)) + body, id=i) for i, h, body in sections)
    head = (
        '<meta charset="utf-8">'
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'\">"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        + tag("title", esc(title)) + tag("style", CSS)
    )  # fmt: skip
    header = tag("header", tag("h1", esc(title)) + tag("p", esc(subtitle), class_="sub"))
    footer = tag("footer", esc(f"autoshard {__version__} \u00b7 {footnote}"))
    body = header + nav + tag("main", main) + footer
    page = tag("html", tag("head", head) + tag("body", body), lang="en")
    return f"<!DOCTYPE html>\n{page}\n"


def layout_tensors(graph: Graph, asked: Sequence[str]) -> list[str]:
    """The tensors whose layout is drawn: the largest weight (else the largest input), then
    those asked for, each once. An unknown name is refused, naming the choices."""
    for name in asked:
        if name not in graph.values:
            weights = sorted(n for n in graph.weights if n not in graph.constants)
            some = ", ".join(weights[:5]) + (", ..." if len(weights) > 5 else "")
            raise ReportError(
                f"no tensor {name!r} in model {graph.name!r}: name a value of the model"
                + (f" (weights: {some})" if some else "")
            )
    pool = [n for n in graph.weights if n not in graph.constants] or list(graph.inputs)
    largest = sorted(pool, key=lambda n: (-graph.values[n].nbytes, n))[:1]
    return list(dict.fromkeys([*largest, *asked]))


# ---- sections ----------------------------------------------------------------------------------


def _priced(doc: PlanDocument) -> tuple[CostFigures, ClusterInfo]:
    """The plan's cost and the cluster it was priced on, which every report draws."""
    if doc.cost is None or doc.cluster is None:
        raise ReportError("the plan has no cost or cluster block: plan it again")
    return doc.cost, doc.cluster


def _subtitle(doc: PlanDocument, devices: int) -> str:
    model, cluster = doc.model, _priced(doc)[1]
    dims = " ".join(f"{k}={v}" for k, v in model.dims.items())
    mode = "training step" if doc.mode == "training" else "inference (forward pass)"
    if doc.training is not None:
        mode += " (" + ", ".join(f"{k} {v}" for k, v in doc.training.to_json().items()) + ")"
    return f"{model.file or ''} {dims} \u00b7 {devices} devices of {cluster.device} \u00b7 {mode}"


def _strategy(inputs: ReportInputs) -> str:
    doc = inputs.document
    cost, cluster = _priced(doc)
    peak, budget = cost.memory_bytes_per_device, cluster.memory_bytes
    figures = [
        ("objective (compute + communication)", ms(cost.objective), "objective"),
        *([("step time (critical path, overlapped)", ms(cost.step_time_s), "step")]
          if cost.scheduled_s is not None else []),
        ("compute per device", ms(cost.compute_time_s), "compute"),
        ("communication per device",
         f"{size(cost.comm_bytes_per_device)}, {ms(cost.comm_time_s)}", "comm"),
        ("memory per device", f"{size(peak)} of {size(budget)} ({share(peak, budget)})", "mem"),
    ]  # fmt: skip
    solver, timing = doc.solver, doc.timing
    if solver:
        figures.append(("solver", f"{solver.status}, gap {solver.gap:.2%}", "solver"))
    if timing:
        figures.append(("solve time", f"{timing.solve_s:.2f} s", "timing"))
    items = "".join(
        tag("div", tag("dt", esc(k)) + tag("dd", esc(v)), class_=f"figure-{c}")
        for k, v, c in figures
    )
    return tag("p", esc(doc.story or ""), class_="story") + tag("dl", items, class_="figures")


def _recipes(block: Recipes) -> str:
    """The standard layouts priced beside the plan (`document.recipes`), and how it differs."""
    titles = {r.name: r.title for r in block.rows}
    named = [(f"{n} ({titles[n]})" if n in titles else n, *rest)
             for n, *rest in recipe_cells(block)]  # fmt: skip
    note = (
        "Each recipe pins how the batch, the weights and their optimizer state are held, and "
        "is priced at its fastest program in the plan's own search problem, without lowering "
        "it: its time is its materialized program's (the CCL passes may shave it further), "
        "its memory the search's rows' (>=: a lower bound). A recipe whose fastest program "
        "does not fit the budget says no; autoshard explain --why-not RECIPE plans it."
    )
    return (
        tag("p", esc(block.difference), class_="difference")
        + _table(RECIPE_HEADER, named, "recipes")
        + tag("p", esc(note), class_="note")
    )


def _mesh(inputs: ReportInputs) -> str:
    doc, graph, plan = inputs.document, inputs.graph, inputs.plan
    mesh, (cost, cluster) = plan.mesh, _priced(doc)
    in_node = cluster.in_node
    roles = recognise(graph, plan, [c.to_json() for c in doc.collectives]).roles

    def cell(device: Device) -> Cell:
        linear = mesh.linear_index(device)
        return Cell("#dfe7f2", str(linear), f"device {device} #{linear}")

    traffic = cost.comm_by_mesh_axes
    rows = [tag("tr", "".join(tag("th", esc(h)) for h in (
        "axis", "devices", "role in this plan", "link", "bandwidth", "latency",
        "collectives over it alone")))]  # fmt: skip
    for a in range(mesh.ndim):
        link = "in a node (scale-up link)" if in_node[a] else "across nodes (network)"
        sent = traffic.get(f"[{a}]")
        over = f"{size(sent.bytes_per_device)}, {ms(sent.time_s)}" if sent else "none"
        told = ", ".join(roles.get(a, ())) or "not used to split"
        cells = (axis_label(mesh, a), mesh.shape[a], told, link,
                 format_rate(cluster.bandwidth_bytes_per_s[a]),
                 f"{cluster.latency_s[a] * 1e6:.3g} us", over)  # fmt: skip
        rows.append(tag("tr", "".join(tag("td", esc(c)) for c in cells), data_axis=str(a)))
    note = (
        "Dashed boxes: the devices of one node (the axes on the scale-up link); cells are "
        f"devices by linear index. Node size {cluster.node_size}."
    )
    return (
        tag("div", mesh_svg(mesh, cell, in_node), class_="picture")
        + tag("p", esc(note), class_="note")
        + tag("table", "".join(rows), class_="axes")
    )


def _axes_names(mesh: Mesh, key: str) -> str:
    """`[0, 1]` -> `dp, tp`."""
    axes = [int(a) for a in key.strip("[]").split(",") if a.strip()]
    return ", ".join(axis_label(mesh, a) for a in axes)


def compute_by_type(doc: PlanDocument, graph: Graph) -> dict[str, float]:
    """Each op type's compute per device, the costliest first; a gradient op (`Grad`) named
    by the forward op it differentiates (`MatMul backward`), so a training step's backward
    is not one opaque bucket. The plan document's breakdown keeps the graph's own types."""
    spent: dict[str, float] = {}
    for op in graph.ops:
        entry = doc.ops.get(op.name)
        if entry is None or entry.compute_s is None:
            continue
        kind = op.type
        grad = op.domain == TRAIN and op.type == TrainOp.GRAD
        forward = graph.op_by_name.get(str(op.attr("op"))) if grad else None
        if forward is not None:
            kind = f"{forward.type} backward"
        spent[kind] = spent.get(kind, 0.0) + entry.compute_s
    return dict(sorted(spent.items(), key=lambda kv: (-kv[1], kv[0])))


def _time(doc: PlanDocument, graph: Graph, mesh: Mesh) -> str:
    breakdown, cost = doc.breakdown or {}, _priced(doc)[0]
    keys = sorted(cost.comm_by_mesh_axes, key=lambda k: (len(k), k))
    colour = {k: axes_colour(i) for i, k in enumerate(keys)}
    legend = [("compute", COMPUTE)] + [(f"comm over {_axes_names(mesh, k)}", colour[k])
                                       for k in keys]  # fmt: skip

    def segments(spent: Mapping[str, Any]) -> tuple[Segment, ...]:
        comm = spent.get("comm_s_by_mesh_axes", {})
        return (Segment("compute", spent["compute_s"], COMPUTE), *(
            Segment(f"comm over {_axes_names(mesh, k)}", comm[k], colour[k]) for k in keys
            if k in comm))  # fmt: skip

    bars = []
    for run in breakdown.get("repeated_layers", ()):
        phase, count = run["phase"], run["layers"]
        bars.append(Bar(f"{phase}: one layer (of {count})", segments(run["one_layer"])))
        bars.append(Bar(f"{phase}: all {count} layers", segments(run["all_layers"])))
    if "rest" in breakdown:
        bars.append(Bar("the rest", segments(breakdown["rest"])))
    out = tag("p", esc(
        "Per device, without overlap: the compute of each repeated layer and of the rest, "
        "and the communication each needs, per mesh axis (a collective is charged to the op "
        "it serves)."), class_="note")  # fmt: skip
    out += tag("div", stacked_bars(bars, legend, "time per layer"), class_="picture layers")
    phases = cost.phases
    if phases:
        comm = "#f28e2b"
        by_phase = [Bar(name, (Segment("compute", p.compute_time_s, COMPUTE),
                               Segment("communication", p.comm_time_s, comm)))
                    for name, p in phases.items()]  # fmt: skip
        out += tag("h3", "Training step by phase")
        chart = stacked_bars(by_phase, [("compute", COMPUTE), ("communication", comm)], "phases")
        out += tag("div", chart, class_="picture phases")
    by_type = list(compute_by_type(doc, graph).items())
    total = cost.compute_time_s
    if by_type:
        shown = by_type[:8]
        rest = sum(t for _, t in by_type[8:])
        rows = [(k, ms(t), share(t, total)) for k, t in shown]
        if rest:
            rows.append((f"{len(by_type) - 8} other op types", ms(rest), share(rest, total)))
        out += tag("h3", "Compute by op type") + _table(("op type", "time", "share"), rows)
    top = breakdown.get("top_collectives") or []
    if top:
        costliest = [(c["kind"], c["value"], _axes_names(mesh, c["mesh_axes"]), c["op"],
                      size(c["bytes_per_device"]), ms(c["time_s"])) for c in top]  # fmt: skip
        header = ("collective", "value", "over", "for op", "bytes per device", "time")
        out += tag("h3", "Costliest collectives") + _table(header, costliest, "collectives")
    return out


def _memory(inputs: ReportInputs) -> str:
    doc, graph, program = inputs.document, inputs.graph, inputs.program
    budget = _priced(doc)[1].memory_bytes
    timeline = memory_timeline(program)
    peak = memory(program)
    if peak.step >= 0:
        step = program.steps[peak.step]
        what = (
            step.op.name if isinstance(step, Compute)
            else f"{step.collective.kind} of {program.tensors[step.source].value}"
        )  # fmt: skip
        where = f"step {peak.step + 1} of {len(program.steps)}: {what}"
    else:
        where = "before the first step"
    bands = []
    if graph.phases:
        served = served_ops(program)
        start = 0
        for i in range(1, len(served) + 1):
            if i == len(served) or graph.phase(served[i]) != graph.phase(served[start]):
                bands.append(Band(graph.phase(served[start]), start, i))
                start = i
    chart = memory_chart(timeline, budget, peak.step, f"peak {size(peak.peak)} at {where}", bands)
    kinds = tensor_kinds(program, graph)
    by_kind: dict[str, list[tuple[str, int]]] = {}
    for name, held in peak.live:  # largest first
        by_kind.setdefault(kinds[name], []).append((name, held))
    rows = []
    for kind in MEMORY_KINDS:
        if kind not in by_kind:
            continue
        live = by_kind[kind]
        total = sum(b for _, b in live)
        largest = ", ".join(f"{n} ({size(b)})" for n, b in live[:LIVE_SHOWN] if b)
        more = f" and {len(live) - LIVE_SHOWN} more" if len(live) > LIVE_SHOWN else ""
        swatch = tag("span", "", class_="swatch", style=f"background:{KIND_COLOURS[kind]}")
        told = (size(total), share(total, peak.peak), len(live), largest + more)
        cells = [swatch + esc(kind.replace("_", " ")), *map(esc, told)]
        rows.append(tag("tr", "".join(tag("td", c) for c in cells), data_kind=kind))
    head = tag("tr", "".join(tag("th", esc(h)) for h in (
        "kind", "bytes", "share of the peak", "tensors", "largest")))  # fmt: skip
    summary = (
        f"Peak {tag('strong', esc(size(peak.peak)), class_='peak', data_bytes=str(peak.peak))}"
        f" per device of the budget "
        f"{tag('strong', esc(size(budget)), class_='budget', data_bytes=str(budget))} "
        f"({esc(share(peak.peak, budget))}), at {esc(where)}. Live at the peak, by kind:"
    )
    return (
        tag("div", chart, class_="picture")
        + tag("p", summary)
        + tag("table", head + "".join(rows), class_="live")
    )


def _weights(inputs: ReportInputs) -> str:
    doc = inputs.document
    table, count, rows = weights_table(doc, inputs.graph, inputs.plan, inputs.names)
    trained = doc.strategy is not None and bool(doc.strategy.weights)
    note = (
        f"{count} weights in {rows} rows (shapes and scalars left out): those of the repeated "
        "layers one row per role, a layer's index as *, with their count; how each is held on "
        "a device, how the ops that read it use it (held split further than read: gathered "
        "before use)" + (", and a training plan's strategy per weight." if trained else ".")
    )
    buffers = buffer_names(inputs.graph) if trained else []
    if buffers:  # named by their source parameters where known
        sources = {b: inputs.names[b][0] for b in buffers if inputs.names.get(b)}
        note += (f" Not trained (no gradient, sync or optimizer state): "
                 f"{buffers_text(buffers, sources)}.")  # fmt: skip
    return tag("p", esc(note), class_="note") + tag("div", table, class_="scroll")


def _layouts(inputs: ReportInputs, chosen: Sequence[str]) -> str:
    graph, plan = inputs.graph, inputs.plan
    in_node = _priced(inputs.document)[1].in_node
    out = []
    for name in chosen:
        value = graph.values[name]
        held = plan.values[name]
        produced = graph.producer(name) is not None
        how = "produced as" if produced else "held as"
        figures = [tensor_figure(plan.mesh, name, value.shape, value.dtype, held, in_node, how)]
        for op in graph.consumers(name):
            reads = [plan.needs[(op.name, i)] for i, x in enumerate(op.inputs) if x == name]
            differ = [r for r in reads if r != held]
            if differ:
                how = f"read by {op.name} as"
                figures.append(
                    tensor_figure(
                        plan.mesh, name, value.shape, value.dtype, differ[0], in_node, how
                    )
                )
                break
        out.append(tag("div", "".join(figures), class_="tensor-layout", data_tensor=name))
    note = (
        "Which block of each tensor every device holds: the tensor cut into its blocks, and the "
        "mesh with each device in the colour of its block (hover for slices). Name more tensors "
        "with --html-tensor (autoshard plan) or --tensor (autoshard html)."
    )
    return tag("p", esc(note), class_="note") + "".join(out)


def _table(header: Sequence[str], rows: Sequence[Sequence[object]], css: str = "") -> str:
    head = tag("tr", "".join(tag("th", esc(h)) for h in header))
    body = "".join(tag("tr", "".join(tag("td", esc(c)) for c in row)) for row in rows)
    return tag("table", head + body, class_=css or None)


CSS = """
:root{--ink:#1d2330;--muted:#5b6475;--line:#d5dbe5;--bg:#f7f9fc}
*{box-sizing:border-box}
body{margin:0;font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--ink);
background:#fff}
header,nav,main,footer{max-width:1040px;margin:0 auto;padding:0 24px}
header{padding-top:24px}h1{font-size:24px;margin:0 0 4px}h2{font-size:19px;margin:0 0 10px}
h3{font-size:15px;margin:18px 0 6px}.sub,.note,footer{color:var(--muted)}.note{font-size:13px}
nav{position:sticky;top:0;background:#fff;border-bottom:1px solid var(--line);padding-top:8px;
padding-bottom:8px;z-index:1}nav a{margin-right:16px;color:#2b5797;text-decoration:none}
section{border-bottom:1px solid var(--line);padding:20px 0}
.story{font-size:16px;background:var(--bg);border-left:4px solid #4e79a7;padding:10px 14px}
.difference{background:var(--bg);border-left:4px solid #59a14f;padding:8px 14px}
dl.figures{display:grid;grid-template-columns:repeat(auto-fill,minmax(230px,1fr));gap:8px;
margin:12px 0 0}dl.figures div{background:var(--bg);padding:8px 12px;border-radius:6px}
dt{font-size:12px;color:var(--muted)}dd{margin:0;font-weight:600}
svg{max-width:100%;height:auto;display:block}
svg text{font:12px system-ui,sans-serif;fill:var(--ink)}svg .small{font-size:11px}
svg .label{text-anchor:end;font-size:11px}svg .axis{font-weight:600}
svg .cell{stroke:#8796ad;stroke-width:1}svg .cell-label{text-anchor:middle;font-size:11px}
svg .node{fill:none;stroke:#2b5797;stroke-dasharray:5 3;stroke-width:1.5}
svg .block{stroke:#fff;stroke-width:1.5}svg .grid{stroke:#e6e9ef}
svg .area{fill:#9fc0e3;stroke:#2b5797;stroke-width:1.2}
svg .budget{stroke:#c0392b;stroke-dasharray:6 4;stroke-width:1.5}
svg .budget-label{fill:#c0392b;font-size:11px}svg .peak{stroke:#1d2330;stroke-dasharray:2 3}
svg .peak-dot{fill:#c0392b}svg .band{fill:#f0f3f8}svg .band-backward{fill:#eef6ee}
svg .band-gradient_sync{fill:#fbf3e6}svg .band-optimizer{fill:#f6eef6}
svg .swatch-band{stroke:#8796ad}
.picture{margin:8px 0}.pictures{display:flex;flex-wrap:wrap;gap:24px;align-items:flex-start}
.pictures svg{max-width:480px}
table{border-collapse:collapse;font-size:13px;margin:8px 0;width:100%}
th,td{border-bottom:1px solid var(--line);padding:4px 8px;text-align:left;vertical-align:top}
th{background:var(--bg);font-weight:600}td code{white-space:nowrap}
td code.name{white-space:normal;overflow-wrap:anywhere}
.param{display:block;color:var(--muted);font-size:12px}.scroll{overflow-x:auto}
table.layer tr.collective td{background:#fbf3e6;font-size:12px;padding:2px 8px 2px 24px}
table.layer .param{display:inline;margin-left:6px}
code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace}
.swatch{display:inline-block;width:10px;height:10px;margin-right:6px;border-radius:2px}
figure{margin:12px 0 20px}figcaption{font-size:13px;color:var(--muted);margin-top:6px}
footer{padding:16px 24px 32px;font-size:12px}
"""
