"""The few markup primitives the report is written with: escaped text, elements, SVG numbers,
colours, and the units the plan's figures are told in.

Every string that reaches the page goes through `esc` (names come from the user's model: a
value named `<script>` must print as text), and every number through a fixed format, so the
same plan gives the same bytes.
"""

from __future__ import annotations

import html

from autoshard.units import format_bytes


def esc(text: object) -> str:
    """Text or an attribute value, escaped (quotes too)."""
    return html.escape(str(text), quote=True)


def tag(name: str, body: str = "", /, **attrs: object) -> str:
    """`<name a="v">body</name>`; `body` is markup (escape text first). Attribute names lose
    a trailing `_` (`class_`) and spell `_` as `-` (`text_anchor`); None leaves one out."""
    spelled = "".join(
        f' {key.rstrip("_").replace("_", "-")}="{esc(value)}"'
        for key, value in attrs.items()
        if value is not None
    )
    return f"<{name}{spelled}>{body}</{name}>"


def svg(width: float, height: float, label: str, body: str) -> str:
    """An SVG picture of `width` x `height` user units, scaled down by the page's CSS."""
    box = f"0 0 {num(width)} {num(height)}"
    return tag("svg", body, xmlns="http://www.w3.org/2000/svg", viewBox=box, width=num(width),
               role="img", aria_label=label)  # fmt: skip


def num(x: float) -> str:
    """An SVG coordinate: one decimal, no trailing `.0`."""
    text = f"{x:.1f}"
    return text[:-2] if text.endswith(".0") else text


def ms(seconds: float) -> str:
    """Seconds in milliseconds, as the CLI prints them."""
    return f"{seconds * 1e3:.3f} ms"


def size(count: float) -> str:
    return format_bytes(count)


def share(part: float, whole: float) -> str:
    if not whole:
        return "-"
    fraction = part / whole
    return f"{fraction:.1%}" if fraction >= 0.001 or not part else "<0.1%"


COMPUTE = "#4e79a7"
"""The colour of compute time; communication takes `axes_colour`'s."""

_AXES = ("#f28e2b", "#e15759", "#59a14f", "#b07aa1", "#edc948", "#76b7b2", "#ff9da7", "#9c755f")

KIND_COLOURS = {
    "weights": "#4e79a7", "gradients": "#e15759", "optimizer_state": "#b07aa1",
    "activations": "#59a14f", "inputs": "#edc948", "buffers": "#f28e2b",
}  # fmt: skip
"""Memory kinds (`cost.liveness.MEMORY_KINDS`)."""


def axes_colour(index: int) -> str:
    """The colour of the `index`-th group of mesh axes a plan communicates over."""
    return _AXES[index % len(_AXES)]


def block_colour(index: int) -> str:
    """A light colour per tensor block, hues a golden angle apart (neighbours differ)."""
    return f"hsl({round(index * 137.508) % 360}, 62%, 78%)"
