"""Reports on plan documents (`autoshard plan -o` / `--json`): one plan as Markdown (the REST
service's `report.md`), and the CI cost-regression report that compares a baseline set of
plans with a current one (`autoshard report`).

Plans are matched by (model, mesh), where the model is its file name and its bound dims
(`gpt2.onnx batch=8 seq=128`). For each pair the report shows every metric below with its
change; a gated metric that grew by more than the threshold (relative to the baseline) is a
regression, one that shrank by more is an improvement. Plans only in the current set are new,
plans only in the baseline removed. Example, threshold 2%:

    comm bytes per device   baseline 1.00 KiB   current 2.00 KiB   +1.00 KiB (+100.0%)  regression
    memory per device       baseline 100 B      current 101 B      +1 B (+1.0%)         within 2%

Solve time is reported but never gated: it depends on the machine and its load, so a CI run
would fail on noise. The cost metrics are deterministic (the solver runs with a fixed seed and
a deterministic time limit), so on the same inputs they repeat exactly.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoshard.document.blocks import CostFigures, Strategy
from autoshard.document.plan_document import PlanDocument, read_document
from autoshard.document.recipes import RECIPE_HEADER, recipe_cells
from autoshard.errors import AutoshardError
from autoshard.holding import words_of
from autoshard.training import Training
from autoshard.units import format_bytes, format_seconds


class ReportError(AutoshardError):
    """A baseline or current path that holds no readable plan documents, or a bad threshold."""


@dataclass(frozen=True)
class Metric:
    key: str
    title: str
    path: str  # where the value sits in the plan document, for errors
    read: Callable[[PlanDocument], float | None]  # the value, None where the plan has none
    unit: str  # "bytes" or "seconds"
    gated: bool  # a change beyond the threshold fails the report


METRICS = (
    Metric("memory", "memory per device", "cost.memory_bytes_per_device",
           lambda d: d.cost.memory_bytes_per_device if d.cost else None, "bytes", True),
    Metric("comm_bytes", "comm bytes per device", "cost.comm_bytes_per_device",
           lambda d: d.cost.comm_bytes_per_device if d.cost else None, "bytes", True),
    Metric("comm_time", "comm time", "cost.comm_time_s",
           lambda d: d.cost.comm_time_s if d.cost else None, "seconds", True),
    Metric("compute_time", "compute time", "cost.compute_time_s",
           lambda d: d.cost.compute_time_s if d.cost else None, "seconds", True),
    Metric("objective", "objective", "cost.objective",
           lambda d: d.cost.objective if d.cost else None, "seconds", True),
    Metric("step_time", "step time", "cost.step_time_s",
           lambda d: d.cost.step_time_s if d.cost else None, "seconds", True),
    Metric("solve_time", "solve time", "timing.solve_s",
           lambda d: d.timing.solve_s if d.timing else None, "seconds", False),
)  # fmt: skip
_BY_KEY = {m.key: m for m in METRICS}
SOLVE_TIME_NOTE = "Solve time is reported but never fails the check: it depends on the machine."


@dataclass(frozen=True)
class Entry:
    """One plan document's metrics, under its (model, mesh) key."""

    model: str
    mesh: str
    file: str
    values: Mapping[str, float]

    @property
    def key(self) -> tuple[str, str]:
        return self.model, self.mesh


@dataclass(frozen=True)
class Change:
    metric: str
    baseline: float
    current: float
    verdict: str  # "regression", "improvement", "same" (within the threshold) or "ungated"

    @property
    def delta(self) -> float:
        return self.current - self.baseline

    @property
    def relative(self) -> float | None:
        """The change as a fraction of the baseline; None from a baseline of zero."""
        if self.baseline == 0:
            return 0.0 if self.current == 0 else None
        return self.delta / self.baseline


@dataclass(frozen=True)
class Comparison:
    threshold: float
    compared: tuple[tuple[Entry, Entry, tuple[Change, ...]], ...]  # (baseline, current, changes)
    new: tuple[Entry, ...]
    removed: tuple[Entry, ...]

    def changes(self, verdict: str) -> list[tuple[Entry, Change]]:
        return [(cur, c) for _, cur, cs in self.compared for c in cs if c.verdict == verdict]

    @property
    def regressed(self) -> bool:
        return bool(self.changes("regression"))


# ---- reading ----------------------------------------------------------------------------------


def parse_threshold(text: str) -> float:
    """`2%` (or `2`: percent either way) -> 0.02."""
    number = text.strip().removesuffix("%")
    try:
        value = float(number) / 100
    except ValueError:
        raise ReportError(f"threshold {text!r} is not a percentage like 2%") from None
    if not math.isfinite(value) or value < 0:
        raise ReportError(f"threshold {text!r} must be a percentage >= 0, like 2%")
    return value


def entry_of(document: PlanDocument, file: str) -> Entry:
    """The metrics of a plan document; `file` names it in errors."""
    values: dict[str, float] = {}
    for m in METRICS:
        value = m.read(document)
        if value is None and m.gated:
            raise ReportError(f"{file}: plan has no {m.path}")
        if value is not None:
            values[m.key] = float(value)
    label = document.model.label
    if document.mode == "training":  # a training step is another plan of the model
        label += " (training)"
    return Entry(label, str(document.mesh), file, values)


def load_entries(path: str | Path) -> dict[tuple[str, str], Entry]:
    """The plans of a JSON file or of the `*.json` files of a directory, by (model, mesh)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.json"))
        if not files:
            raise ReportError(f"no plan JSON files (*.json) in directory {path}")
    elif path.is_file():
        files = [path]
    else:
        raise ReportError(f"{path}: no such file or directory")
    entries: dict[tuple[str, str], Entry] = {}
    for file in files:
        entry = entry_of(read_document(file), str(file))
        if entry.key in entries:
            raise ReportError(
                f"{file} and {entries[entry.key].file} are both plans of {entry.model} on mesh "
                f"{entry.mesh}; keep one per (model, mesh)"
            )
        entries[entry.key] = entry
    return entries


# ---- comparing --------------------------------------------------------------------------------


def _verdict(metric: Metric, baseline: float, current: float, threshold: float) -> str:
    if not metric.gated:
        return "ungated"
    if current > baseline * (1 + threshold):
        return "regression"
    if current < baseline * (1 - threshold):
        return "improvement"
    return "same"


def compare(
    baseline: Mapping[tuple[str, str], Entry],
    current: Mapping[tuple[str, str], Entry],
    threshold: float,
) -> Comparison:
    """Every (model, mesh) of both sets, sorted; metrics missing on one side are skipped."""
    compared = []
    for key in sorted(baseline.keys() & current.keys()):
        base, cur = baseline[key], current[key]
        changes = tuple(
            Change(m.key, base.values[m.key], cur.values[m.key],
                   _verdict(m, base.values[m.key], cur.values[m.key], threshold))
            for m in METRICS
            if m.key in base.values and m.key in cur.values
        )  # fmt: skip
        compared.append((base, cur, changes))
    return Comparison(
        threshold,
        tuple(compared),
        tuple(current[k] for k in sorted(current.keys() - baseline.keys())),
        tuple(baseline[k] for k in sorted(baseline.keys() - current.keys())),
    )


# ---- formatting -------------------------------------------------------------------------------


def _value(metric: str, value: float) -> str:
    unit = _BY_KEY[metric].unit
    return format_bytes(value) if unit == "bytes" else format_seconds(value)


def _percent(change: Change) -> str:
    relative = change.relative
    return "from 0" if relative is None else f"{relative:+.1%}"


def _delta(change: Change) -> str:
    sign = "+" if change.delta >= 0 else ""
    return f"{sign}{_value(change.metric, change.delta)} ({_percent(change)})"


def _cell(change: Change) -> str:
    text = _value(change.metric, change.current)
    if change.delta:
        text += f" ({_percent(change)})"
    return f"**{text}**" if change.verdict == "regression" else text


def _table(header: Sequence[str], right: int, rows: Sequence[Sequence[object]]) -> list[str]:
    """A Markdown table; columns from index `right` on are right-aligned (numbers)."""
    rule = ["---" if i < right else "---:" for i in range(len(header))]
    return [f"| {' | '.join(map(str, r))} |" for r in (header, rule, *rows)]


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _change_rows(changes: Sequence[tuple[Entry, Change]]) -> list[tuple[str, ...]]:
    return [
        (e.model, e.mesh, _BY_KEY[ch.metric].title, _value(ch.metric, ch.baseline),
         _value(ch.metric, ch.current), _delta(ch))
        for e, ch in changes
    ]  # fmt: skip


def _entry_rows(entries: Sequence[Entry]) -> list[tuple[str, ...]]:
    return [
        (e.model, e.mesh, *(_value(m.key, e.values[m.key]) if m.key in e.values else "–"
                            for m in METRICS))
        for e in entries
    ]  # fmt: skip


def _compared_rows(compared: Comparison) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for _, cur, changes in compared.compared:
        cells = {ch.metric: _cell(ch) for ch in changes}
        rows.append((cur.model, cur.mesh, *(cells.get(m.key, "–") for m in METRICS)))
    return rows


def comparison_markdown(comparison: Comparison) -> str:
    """The report as Markdown (a pull-request comment): a summary line, then the regressions,
    improvements, new and removed plans, and every compared plan's metrics (bold where one
    regressed). Empty sections are left out."""
    c = comparison
    regressions, improvements = c.changes("regression"), c.changes("improvement")
    threshold = f"{c.threshold:.1%}".replace(".0%", "%")
    regressed_plans = len({e.key for e, _ in regressions})
    head = (
        f"**{_plural(len(regressions), 'regression')}** beyond {threshold} in "
        f"{regressed_plans} of {len(c.compared)} compared plans"
        if regressions
        else f"No regression beyond {threshold} in {len(c.compared)} compared plans"
    )
    lines = [
        "## autoshard cost report",
        "",
        f"{head}; {_plural(len(improvements), 'improvement')}, {len(c.new)} new, "
        f"{len(c.removed)} removed.",
    ]
    change_header = ("model", "mesh", "metric", "baseline", "current", "change")
    header = ("model", "mesh", *(m.title for m in METRICS))
    sections = (
        ("Regressions", change_header, 3, _change_rows(regressions)),
        ("Improvements", change_header, 3, _change_rows(improvements)),
        ("New", header, 2, _entry_rows(c.new)),
        ("Removed", header, 2, _entry_rows(c.removed)),
        ("All compared plans (current, change from baseline)", header, 2, _compared_rows(c)),
    )
    for title, columns, right, rows in sections:
        if rows:
            lines += ["", f"### {title}", "", *_table(columns, right, rows)]
    if regressions:
        lines += ["", "### What changed in the regressed plans", ""]
        lines += [f"- {cur.model} on {cur.mesh}: `{command}`" for cur, command in diff_commands(c)]
    lines += ["", SOLVE_TIME_NOTE]
    return "\n".join(lines) + "\n"


def diff_commands(comparison: Comparison) -> list[tuple[Entry, str]]:
    """The `autoshard diff BASELINE CURRENT` showing what changed in each regressed plan."""
    return [
        (cur, f"autoshard diff {shlex.quote(base.file)} {shlex.quote(cur.file)}")
        for base, cur, changes in comparison.compared
        if any(change.verdict == "regression" for change in changes)
    ]


def comparison_json(comparison: Comparison) -> dict[str, Any]:
    def metrics(entry: Entry) -> dict[str, float]:
        return dict(entry.values)

    return {
        "threshold": comparison.threshold,
        "regressed": comparison.regressed,
        "compared": [
            {"model": cur.model, "mesh": cur.mesh, "baseline_file": base.file,
             "current_file": cur.file,
             "metrics": {ch.metric: {"baseline": ch.baseline, "current": ch.current,
                                     "delta": ch.delta, "relative": ch.relative,
                                     "verdict": ch.verdict} for ch in changes}}
            for base, cur, changes in comparison.compared
        ],
        "new": [{"model": e.model, "mesh": e.mesh, "file": e.file, "metrics": metrics(e)}
                for e in comparison.new],
        "removed": [{"model": e.model, "mesh": e.mesh, "file": e.file, "metrics": metrics(e)}
                    for e in comparison.removed],
        "diffs": [{"model": e.model, "mesh": e.mesh, "command": command}
                  for e, command in diff_commands(comparison)],
    }  # fmt: skip


# ---- one plan ---------------------------------------------------------------------------------


def _reserve_note(reserve: int) -> str:
    """What the budget held back of the device's memory, where it did."""
    return f"; the device's memory less a reserve of {format_bytes(reserve)}" if reserve else ""


def plan_markdown(document: PlanDocument) -> str:
    """One plan document as a Markdown report: the strategy in words, model, cluster, cost,
    the standard recipes beside it, solver, collectives and every op's sharding option."""
    model, cluster, cost = document.model, document.cluster, document.cost
    if cluster is None or cost is None:
        raise ReportError("a plan's report needs its cluster and cost blocks")
    memory, budget = cost.memory_bytes_per_device, cluster.memory_bytes  # budget > 0
    lines = [
        f"# Plan: {model.label} on mesh {document.mesh}",
        "",
        *([document.story, ""] if document.story else []),
        f"Model `{model.name}` ({model.file}, sha256 `{model.sha256}`); "
        f"device {cluster.device}; link bandwidth per mesh axis "
        f"{', '.join(f'{b / 1e9:g} GB/s' for b in cluster.bandwidth_bytes_per_s)}; "
        f"latency {', '.join(format_seconds(t) for t in cluster.latency_s)}.",
        "",
        *_table(("cost per device", "value"), 1, [
            ("memory", f"{format_bytes(memory)} of {format_bytes(budget)} ({memory / budget:.1%})"
             + _reserve_note(cluster.reserve_bytes)),
            ("compute time", format_seconds(cost.compute_time_s)),
            ("communication", f"{format_bytes(cost.comm_bytes_per_device)} in "
                              f"{format_seconds(cost.comm_time_s)}"),
            ("objective (compute + communication)", format_seconds(cost.objective)),
            *([("step time (critical path, overlapped)", format_seconds(cost.step_time_s))]
              if cost.scheduled_s is not None else []),
        ]),
    ]  # fmt: skip
    if document.training is not None:
        lines += ["", *_training_markdown(document.training, cost, document.strategy)]
    if document.recipes is not None:
        cells = recipe_cells(document.recipes)
        lines += ["", "## Beside the standard recipes", "", document.recipes.difference, "",
                  *_table(RECIPE_HEADER, 1, cells)]  # fmt: skip
    solver, timing = document.solver, document.timing
    if solver:
        lines += [
            "",
            f"Solver: {solver.status}, gap {solver.gap:.2%}, "
            f"{timing.solve_s if timing else 0.0:.2f} s, "
            f"{solver.variables} variables, {solver.constraints} constraints.",
        ]
    collectives = document.collectives
    lines += ["", f"## Collectives ({len(collectives)})"]
    if collectives:
        rows: list[tuple[str, ...]] = [
            (f"`{c.value}`", c.kind, str(list(c.mesh_axes)), f"`{c.source}`", f"`{c.target}`",
             format_bytes(c.bytes_per_device))
            for c in collectives
        ]  # fmt: skip
        header = ("value", "kind", "mesh axes", "from", "to", "bytes per device")
        lines += ["", *_table(header, 5, rows)]
    ops = document.ops
    op_rows = [
        (f"`{name}`", op.type, f"`{op.sharding_option}`" if op.sharding_option
         else "replicated (no rule)")
        for name, op in ops.items()
    ]  # fmt: skip
    lines += [
        "",
        f"## Ops ({len(ops)})",
        "",
        *_table(("op", "type", "sharding option"), 3, op_rows),
    ]
    return "\n".join(lines) + "\n"


def _training_markdown(
    training: Training, cost: CostFigures, strategy: Strategy | None
) -> list[str]:
    """A training plan's step by phase, memory at the peak by kind, and weights by strategy."""
    phases = [
        (name, format_seconds(p.time_s), format_seconds(p.compute_time_s),
         format_bytes(p.comm_bytes_per_device), format_seconds(p.comm_time_s))
        for name, p in (cost.phases or {}).items()
    ]  # fmt: skip
    kinds = [(kind, format_bytes(size)) for kind, size in (cost.memory_by_kind or {}).items()]
    weights = [
        (f"`{name}`", words_of(w.strategy), f"`{w.stored}`", f"`{w.used}`", f"`{w.state}`")
        for name, w in (strategy.weights if strategy else {}).items()
    ]
    return [
        f"## Training step: {training.optimizer}, {training.precision}, "
        f"{training.micro_batches} micro-batch(es), recompute {training.recompute}",
        "",
        *_table(("phase", "time", "compute", "communication", "its time"), 1, phases),
        "",
        *_table(("memory at the peak", "bytes"), 1, kinds),
        "",
        *_table(("weight", "held as", "stored", "used", "optimizer state"), 5, weights),
    ]
