"""The sweep's page: the Pareto fronts of step time against devices and against the cost of
a step, drawn as SVG scatter plots, and the table of every point; one self-contained HTML
file in the plan report's style (its CSS and markup helpers), the same bytes for the same
rows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from autoshard.html.charts import WIDTH
from autoshard.html.markup import COMPUTE, esc, ms, num, size, svg, tag
from autoshard.html.page import html_page

FRONT = "#e15759"
"""The colour of the points on the front and the line through them."""


def scatter(
    rows: Sequence[dict[str, Any]],
    xs: Sequence[float],
    fronts: Sequence[Sequence[int]],
    x_label: str,
    log_x: bool,
    label: str,
) -> str:
    """Every point at (x, step time), each front's points (one per workload) joined by a
    line; log2 x for device counts. Hover a point for its mesh and figures."""
    left, right, top, bottom, height = 90, 30, 24, 50, 360
    ys = [row["step_time_s"] for row in rows]
    fx = (lambda v: math.log2(v)) if log_x else (lambda v: v)
    lo_x, hi_x = min(map(fx, xs), default=0.0), max(map(fx, xs), default=1.0)
    hi_y = max(ys, default=1.0) * 1.08 or 1.0
    span_x = (hi_x - lo_x) or 1.0

    def at(x: float, y: float) -> tuple[float, float]:
        px = left + (fx(x) - lo_x) / span_x * (WIDTH - left - right - 20) + 10
        return px, top + (1 - y / hi_y) * (height - top - bottom)

    out = [tag("line", x1=num(left), y1=num(height - bottom), x2=num(WIDTH - right),
               y2=num(height - bottom), class_="grid")]  # fmt: skip
    for i in range(5):
        y = hi_y * i / 4
        _, py = at(xs[0] if xs else 1.0, y)
        out.append(tag("line", x1=num(left), y1=num(py), x2=num(WIDTH - right), y2=num(py),
                       class_="grid"))  # fmt: skip
        out.append(tag("text", esc(f"{y * 1e3:.4g} ms"), x=num(left - 6), y=num(py + 4),
                       class_="label"))  # fmt: skip
    lo, hi = min(xs, default=0.0), max(xs, default=0.0)
    # Every device count (few, a log scale apart); five ticks of a cost.
    ticks = sorted(set(xs)) if log_x else sorted({lo + (hi - lo) * i / 4 for i in range(5)})
    for x in ticks:
        px, _ = at(x, 0.0)
        tick = f"{x:g}" if log_x else f"{x:.3g}"
        out.append(tag("text", esc(tick), x=num(px), y=num(height - bottom + 16),
                       class_="cell-label"))  # fmt: skip
    out.append(tag("text", esc(x_label), x=num(WIDTH / 2), y=num(height - 8), class_="cell-label"))
    for front in fronts:
        line = " ".join(f"{num(a)},{num(b)}" for a, b in (at(xs[i], ys[i]) for i in front))
        out.append(tag("polyline", points=line, fill="none", stroke=FRONT, stroke_width="1.5"))
    on_front = {i for front in fronts for i in front}
    for i, row in enumerate(rows):
        px, py = at(xs[i], ys[i])
        title = tag("title", esc(f"{_name(row)}: {ms(ys[i])}"))
        colour = FRONT if i in on_front else COMPUTE
        out.append(tag("circle", title, cx=num(px), cy=num(py), r="4" if i in on_front else "3",
                       fill=colour, fill_opacity="0.85"))  # fmt: skip
        if i in on_front:
            out.append(tag("text", esc(row["point"]["mesh"]), x=num(px), y=num(py - 8),
                           class_="cell-label"))  # fmt: skip
    return svg(WIDTH, height, label, "".join(out))


def _name(row: dict[str, Any]) -> str:
    point = row["point"]
    parts = [point["mesh"], point.get("cluster"), point.get("device"), point.get("memory")]
    parts += [f"{k}={v}" for k, v in (*point["dims"].items(), *point["training"].items())]
    return " ".join(str(p) for p in parts if p)


HEADER = ("point", "devices", "step time", "tokens/s/device", "memory/device", "cost/step",
          "status", "strategy")  # fmt: skip


def _cells(row: dict[str, Any], cost: float | None) -> list[object]:
    if row["status"] != "ok":
        return [_name(row), row["devices"], "-", "-", "-", "-", row["status"], row["error"]]
    return [_name(row), row["devices"], ms(row["step_time_s"]),
            f"{row['tokens_per_s_per_device']:.1f}", size(row["memory_bytes_per_device"]),
            "-" if cost is None else f"{cost:.6g}", "ok", row["strategy"]]  # fmt: skip


def _table(rows: Sequence[dict[str, Any]], costs: Sequence[float | None]) -> str:
    head = tag("tr", "".join(tag("th", esc(h)) for h in HEADER))
    body = "".join(
        tag("tr", "".join(tag("td", esc(c)) for c in _cells(row, cost)))
        for row, cost in zip(rows, costs, strict=True)
    )
    return tag("div", tag("table", head + body), class_="scroll")


def sweep_html(
    title: str, rows: Sequence[dict[str, Any]], price: float | None,
    fronts: dict[str, list[list[int]]], costs: Sequence[float | None],
) -> str:  # fmt: skip
    """The page. `rows`: every point in grid order; `fronts` indexes the planned ones
    (`planned`, the rows with status ok) by front name (`devices`, `cost`), a front per
    workload."""
    planned = [row for row in rows if row["status"] == "ok"]
    planned_costs = [c for row, c in zip(rows, costs, strict=True) if row["status"] == "ok"]
    devices = [float(row["devices"]) for row in planned]
    sections = [("devices", "Step time against devices", scatter(
        planned, devices, fronts["devices"], "devices (log scale)", True,
        "step time against devices"))]  # fmt: skip
    if price is not None:
        xs = [c or 0.0 for c in planned_costs]
        sections.append(("cost", f"Step time against the cost of a step (at {price:g} per "
                         "device-hour)", scatter(planned, xs, fronts["cost"], "cost of a step",
                         False, "step time against cost")))  # fmt: skip
    front_rows = [planned[i] for front in fronts["devices"] for i in front]
    sections.append(("front", "The front (step time against devices)",
                     _table(front_rows, [None] * len(front_rows))))  # fmt: skip
    sections.append(("points", "Every point", _table(rows, costs)))
    failed = len(rows) - len(planned)
    sub = f"{len(rows)} points, {len(planned)} planned" + (f", {failed} not" if failed else "")
    return html_page(title, sub, sections, "sweep")
