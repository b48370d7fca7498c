"""The report's two charts, as SVG: horizontal stacked bars (time per layer: compute and the
communication over each mesh axis) and an area chart of memory over the program's steps
against the budget, its peak marked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autoshard.html.markup import esc, ms, num, size, svg, tag

WIDTH = 960


@dataclass(frozen=True)
class Segment:
    name: str
    seconds: float
    colour: str


@dataclass(frozen=True)
class Bar:
    label: str
    segments: tuple[Segment, ...]

    @property
    def total(self) -> float:
        return sum(s.seconds for s in self.segments)


def stacked_bars(bars: Sequence[Bar], legend: Sequence[tuple[str, str]], label: str) -> str:
    """One row per bar, its segments side by side on one time scale, its total at its end;
    `legend` is (name, colour) per segment kind."""
    left, right, row, top = 250, 110, 28, 30
    scale = max((b.total for b in bars), default=0.0) or 1.0
    span = WIDTH - left - right
    out = []
    x = 0.0
    for name, colour in legend:
        out.append(tag("rect", x=num(x), y="4", width="12", height="12", fill=colour))
        out.append(tag("text", esc(name), x=num(x + 16), y="14", class_="small"))
        x += 24 + 7.2 * len(name)
    for i, bar in enumerate(bars):
        y = top + i * row
        out.append(tag("text", esc(bar.label), x=num(left - 8), y=num(y + 17), class_="label"))
        x = float(left)
        for segment in bar.segments:
            w = span * segment.seconds / scale
            if w <= 0:
                continue
            title = tag("title", esc(f"{bar.label}: {segment.name} {ms(segment.seconds)}"))
            out.append(tag("rect", title, x=num(x), y=num(y + 4), width=num(max(w, 0.5)),
                           height=num(row - 8), fill=segment.colour))  # fmt: skip
            x += w
        out.append(tag("text", esc(ms(bar.total)), x=num(x + 6), y=num(y + 17), class_="small"))
    return svg(WIDTH, top + len(bars) * row + 4, label, "".join(out))


@dataclass(frozen=True)
class Band:
    """A stretch of steps shown apart (a training step's phase)."""

    name: str
    start: int
    stop: int


POINTS = 600
"""The most points the memory curve is drawn with: more steps share a point, at their maximum
(the peak is always drawn)."""


def memory_chart(
    timeline: Sequence[int], budget: int, peak_step: int, peak_text: str, bands: Sequence[Band]
) -> str:
    """Bytes live over the program's steps (`timeline[0]` before the first step, then one per
    step), the budget as a dashed line (or a note when it is far above the curve), the peak
    marked at `peak_step` and told by `peak_text`, and `bands` shaded under their names."""
    left, right, top, bottom = 78, 20, 26, 34
    height = 300
    plot_w, plot_h = WIDTH - left - right, height - top - bottom
    peak = max(timeline, default=0)
    shows_budget = budget <= 3 * peak
    ymax = (max(peak, budget) if shows_budget else peak) * 1.08 or 1.0
    n = len(timeline)

    def x_at(index: int) -> float:  # index into timeline
        return left + plot_w * index / max(1, n - 1)

    def y_at(value: float) -> float:
        return top + plot_h * (1 - value / ymax)

    out = []
    taken: list[Box] = []  # the text boxes drawn inside the plot, that the budget's must miss
    for band in bands:
        x0, x1 = x_at(band.start + 1), x_at(band.stop)
        out.append(tag("rect", x=num(x0), y=num(top), width=num(max(x1 - x0, 0.5)),
                       height=num(plot_h), class_=f"band band-{band.name}"))  # fmt: skip
        if x1 - x0 > 60:
            out.append(tag("text", esc(band.name), x=num(x0 + 4), y=num(top + 14), class_="small"))
            taken.append(text_box(band.name, x0 + 4, top + 14, "start"))
    for value in _ticks(ymax):
        y = y_at(value)
        out.append(tag("line", x1=num(left), x2=num(left + plot_w), y1=num(y), y2=num(y),
                       class_="grid"))  # fmt: skip
        out.append(tag("text", esc(size(value)), x=num(left - 6), y=num(y + 4), class_="label"))
    points = _downsample(timeline)
    path = " ".join(f"L{num(x_at(i))},{num(y_at(v))}" for i, v in points)
    base = num(y_at(0))
    out.append(tag("path", d=f"M{num(left)},{base} {path} L{num(x_at(n - 1))},{base} Z",
                   class_="area"))  # fmt: skip
    if shows_budget:
        y = y_at(budget)
        out.append(tag("line", x1=num(left), x2=num(left + plot_w), y1=num(y), y2=num(y),
                       class_="budget"))  # fmt: skip
    else:
        note = f"budget {size(budget)}, above the chart: the peak is {peak / budget:.1%} of it"
        out.append(tag("text", esc(note), x=num(left + plot_w - 4), y=num(top - 8),
                       class_="label budget-label"))  # fmt: skip
    px, py = x_at(peak_step + 1), y_at(peak)
    out.append(tag("line", x1=num(px), x2=num(px), y1=num(top), y2=num(top + plot_h),
                   class_="peak"))  # fmt: skip
    out.append(tag("circle", tag("title", esc(peak_text)), cx=num(px), cy=num(py), r="4",
                   class_="peak-dot"))  # fmt: skip
    anchor = "end" if px > left + plot_w / 2 else "start"
    shift = -6 if anchor == "end" else 6
    peak_y = max(py, top + 24) + 16
    out.append(tag("text", esc(peak_text), x=num(px + shift), y=num(peak_y),
                   text_anchor=anchor, class_="small"))  # fmt: skip
    taken.append(text_box(peak_text, px + shift, peak_y, anchor))
    if shows_budget:
        out.append(_budget_label(f"budget {size(budget)}", y_at(budget), left, plot_w, taken))
    out.append(tag("text", "program steps \u2192", x=num(left), y=num(height - 8), class_="small"))
    x = left + 120.0
    for name in dict.fromkeys(band.name for band in bands):  # the phases' legend
        out.append(tag("rect", x=num(x), y=num(height - 18), width="12", height="12",
                       class_=f"band band-{name} swatch-band"))  # fmt: skip
        out.append(tag("text", esc(name), x=num(x + 16), y=num(height - 8), class_="small"))
        x += 30 + 7 * len(name)
    out.append(tag("text", esc(f"{n - 1} steps"), x=num(left + plot_w), y=num(height - 8),
                   class_="label"))  # fmt: skip
    return svg(WIDTH, height, "memory per device over the program's steps", "".join(out))


Box = tuple[float, float, float, float]
"""A text's box: left, top, right, bottom."""

CHAR_W = 0.62
"""A character's width of the chart's sans-serif font, in font sizes (a little over the
average, so an estimated box holds the drawn text)."""


def text_box(text: str, x: float, y: float, anchor: str, font: float = 11.0) -> Box:
    """The box of `text` drawn at (`x`, baseline `y`) with `text-anchor` `anchor`."""
    width = CHAR_W * font * len(text)
    x0 = {"start": x, "middle": x - width / 2, "end": x - width}[anchor]
    return (x0, y - font, x0 + width, y + 0.3 * font)


def overlap(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _budget_label(text: str, y: float, left: float, width: float, taken: Sequence[Box]) -> str:
    """The budget line's label, at the first of its places that misses every text in `taken`
    (the phases' names along the plot's top, the peak's text): above the line at its right
    end, below it, then the same at the left end. (Not of class `label`, whose CSS anchors
    every text at its end.)"""
    places = [(left + width - 4, y - 5, "end"), (left + width - 4, y + 15, "end"),
              (left + 4, y - 5, "start"), (left + 4, y + 15, "start")]  # fmt: skip
    free = [p for p in places if not any(overlap(text_box(text, *p), t) for t in taken)]
    x, baseline, anchor = (free or places)[0]
    return tag("text", esc(text), x=num(x), y=num(baseline), text_anchor=anchor,
               class_="budget-label")  # fmt: skip


def _ticks(top: float) -> list[float]:
    """Round byte values from 0 to `top`, at most 6: steps of 1, 2 or 5 times a power of ten
    of a binary unit (B, KiB, MiB, GiB, TiB)."""
    steps = [float(unit * scale) for unit in (1, 1 << 10, 1 << 20, 1 << 30, 1 << 40)
             for scale in (1, 2, 5, 10, 20, 50, 100, 200, 500)]  # fmt: skip
    step = next((s for s in steps if top / s <= 5), steps[-1])
    return [k * step for k in range(int(top // step) + 1)]


def _downsample(timeline: Sequence[int]) -> list[tuple[int, int]]:
    """At most `POINTS` (index, bytes) points: each the maximum of its stretch of steps."""
    n = len(timeline)
    if n <= POINTS:
        return list(enumerate(timeline))
    points = []
    for k in range(POINTS):
        lo, hi = k * n // POINTS, (k + 1) * n // POINTS
        i = max(range(lo, hi), key=lambda j: (timeline[j], -j))
        points.append((i, timeline[i]))
    return points
