"""A pipelined plan's stages in the report: a table of the stages and a timeline of the
schedule, each stage's passes as the schedule runs them (`cost.schedule.simulate`, again on the
plan document's stage times: the picture is the price's own critical path), the gradient sync
and update after the drain; the weights tied across stages, if any."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autoshard.cost.schedule import Pipeline, Schedule, StageTime, simulate
from autoshard.html.markup import COMPUTE, esc, ms, num, share, size, svg, tag

WIDTH, ROW, LEFT = 900.0, 22.0, 64.0
_BACKWARD, _WEIGHT, _UPDATE = "#2b5d8a", "#76b7b2", "#b07aa1"


def stages_section(block: Mapping[str, Any]) -> str:
    """The section: the step in words, the timeline, the table of stages."""
    stages = block["stages"]
    budget = block["memory_budget_bytes"]
    words = (
        f"{len(stages)} stages over mesh {block['mesh']} (axis {block['axis']}), schedule "
        f"{block['schedule']}, {block['micro_batches']} micro-batches: step "
        f"{ms(block['step_time_s'])}, bubble {block['bubble']:.1%}; each boundary sends "
        f"{size(block['p2p']['bytes_per_device_per_micro_batch'])} per micro-batch "
        f"({ms(block['p2p']['time_s'])})."
    )
    rows = []
    for s, stage in enumerate(stages):
        first, stop = stage["layers"]
        compute, memory = stage["compute"], stage["memory"]
        rows.append(tag("tr", "".join(tag("td", esc(c)) for c in (
            s, f"{first}..{stop - 1}", ms(compute["forward_s"]), ms(compute["backward_s"]),
            ms(compute["update_s"]), f"{memory['micro_batches_in_flight']:g}",
            f"{size(memory['bytes_per_device'])} ({share(memory['bytes_per_device'], budget)})",
        ))))  # fmt: skip
    header = ("stage", "layers", "forward / micro-batch", "backward / micro-batch",
              "sync + update", "in flight", "memory per device")  # fmt: skip
    table = tag(
        "table",
        tag("tr", "".join(tag("th", esc(h)) for h in header)) + "".join(rows),
        class_="stages",
    )
    return tag("p", esc(words)) + timeline_svg(block) + table + tied_table(block)


def tied_table(block: Mapping[str, Any]) -> str:
    """The weights tied across stages (the block's `tied`): the stages holding a copy, the
    copy's bytes per device, the gradient sum's bytes and time (in both ends' sync + update);
    nothing without one."""
    rows = []
    for tied in block.get("tied", ()):
        sync = tied["sync"]
        rows.append(tag("tr", "".join(tag("td", esc(c)) for c in (
            tied["weight"], " and ".join(map(str, tied["stages"])),
            size(tied["copy_bytes_per_device"]), size(sync["bytes_per_device"]),
            ms(sync["time_s"]),
        ))))  # fmt: skip
    if not rows:
        return ""
    header = ("tied weight", "copy on stages", "copy per device", "gradient sum per device",
              "gradient sum")  # fmt: skip
    head = tag("tr", "".join(tag("th", esc(h)) for h in header))
    return tag("table", head + "".join(rows), class_="tied")


def _time(compute: Mapping[str, float]) -> StageTime:
    """A stage's or a chunk's seconds per micro-batch as the plan records them (a plan from
    before the weight gradients' share has none)."""
    return StageTime(compute["forward_s"], compute["backward_s"], compute.get("weight_s", 0.0))


def timeline_svg(block: Mapping[str, Any]) -> str:
    """The schedule's timeline: a row per stage, forwards light, backwards dark (a zero-bubble
    schedule's weight gradients apart), the update after the drain; the x axis the step's
    seconds. An interleaved plan's chunks each take their own time where the plan records it."""
    stages = block["stages"]
    times = [_time(s["compute"]) for s in block.get("chunks", stages) if "compute" in s]
    times = times or [_time(s["compute"]) for s in stages]
    pipeline = Pipeline(len(stages), block["micro_batches"], Schedule.parse(block["schedule"]))
    training = any(t.backward for t in times)
    timeline = simulate(pipeline, times, block["p2p"]["time_s"], training)
    update = max(s["compute"]["update_s"] for s in stages)
    total = (timeline.step_s + update) or 1.0
    scale = (WIDTH - LEFT - 8) / total
    parts = []
    for s, passes in enumerate(timeline.passes):
        y = 4 + s * ROW
        parts.append(tag("text", f"stage {s}", x=4, y=num(y + 14), font_size=11))
        for step, start, end in passes:
            colour = COMPUTE if step.forward else _WEIGHT if step.weight else _BACKWARD
            width = max((end - start) * scale, 0.5)
            parts.append(tag("rect", tag("title", esc(f"{step} {ms(start)}..{ms(end)}")),
                             x=num(LEFT + start * scale), y=num(y), width=num(width),
                             height=num(ROW - 6), fill=colour, stroke="#fff",
                             stroke_width=0.5))  # fmt: skip
        own = stages[s]["compute"]["update_s"]
        if own > 0:
            parts.append(tag("rect", tag("title", esc(f"sync + update {ms(own)}")),
                             x=num(LEFT + timeline.step_s * scale), y=num(y),
                             width=num(max(own * scale, 0.5)), height=num(ROW - 6),
                             fill=_UPDATE))  # fmt: skip
    height = 8 + len(stages) * ROW + 14
    weight = "weight gradient, " if pipeline.schedule.splits_backward else ""
    parts.append(tag("text", esc(f"0 .. {ms(total)}: forward, backward, {weight}sync + update"),
                     x=num(LEFT), y=num(height - 4), font_size=11))  # fmt: skip
    label = f"timeline of the {block['schedule']} schedule over {len(stages)} stages"
    return tag("figure", svg(WIDTH, height, label, "".join(parts)), class_="timeline")
