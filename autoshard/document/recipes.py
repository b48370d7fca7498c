"""The plan document's `recipes` block: the standard layouts priced beside the plan
(`search.recipe_prices`), and a line saying how the plan differs from the best of them.

    "recipes": {"plan_step_time_s": ..., "plan_compute_time_s": ...,
                "plan_memory_bytes_per_device": ..., "best": "zero",
                "rows": [{"name": "dp", "title": "DDP", "step_time_s": ...,
                          "compute_time_s": ..., "memory_bytes_per_device": ...,
                          "fits": true, "refused": null}, ...],
                "difference": "the plan is 3.7% faster than zero, ..."}

`plan_*` are the plan's own figures (its program's cost); a recipe is priced by the same
costs without lowering its program (`search.recipe_prices`: its time is the materialized
program's, its memory a lower bound where `memory_at_least`, `fits` then null unless even that
is over the budget; where its fastest program was not proven, the time limit run out or its
exact tables too large, `at_most` is true: its figures are those of a program of its layout,
its time an upper bound); a recipe that does not apply, or that the time limit left unpriced,
has `refused`, its reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autoshard.search.recipe_prices import RecipePrice
from autoshard.units import format_bytes, format_seconds

SAME = 1e-9
"""Relative difference under which two step times are the same (float summation order)."""


@dataclass(frozen=True)
class RecipeRow:
    """One recipe's price: its step time, compute, memory per device, whether it fits the
    budget, or why it does not apply (`refused`)."""

    name: str
    title: str
    step_time_s: float | None
    compute_time_s: float | None
    memory_bytes_per_device: int | None
    fits: bool | None
    refused: str | None = None
    comm_bytes_per_device: int | None = None  # under the bytes objective only
    memory_at_least: bool = False  # a lower bound (`search.recipe_prices`); fits None: unknown
    at_most: bool = False  # a program of its layout, not proven its fastest: an upper bound

    @property
    def comm_time_s(self) -> float:
        return (self.step_time_s or 0.0) - (self.compute_time_s or 0.0)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "step_time_s": self.step_time_s,
                "compute_time_s": self.compute_time_s,
                "memory_bytes_per_device": self.memory_bytes_per_device, "fits": self.fits,
                "refused": self.refused, "memory_at_least": self.memory_at_least} | (
            {"comm_bytes_per_device": self.comm_bytes_per_device}
            if self.comm_bytes_per_device is not None else {}
        ) | ({"at_most": True} if self.at_most else {})  # fmt: skip

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> RecipeRow:
        return RecipeRow(
            str(data["name"]), str(data.get("title") or data["name"]), data.get("step_time_s"),
            data.get("compute_time_s"), data.get("memory_bytes_per_device"), data.get("fits"),
            data.get("refused"), data.get("comm_bytes_per_device"),
            bool(data.get("memory_at_least")), bool(data.get("at_most")),
        )  # fmt: skip


@dataclass(frozen=True)
class Recipes:
    """`recipes`: the rows, the plan's own figures, the best recipe that fits (None: none
    does) and the line saying how the plan differs from it."""

    rows: tuple[RecipeRow, ...]
    plan_step_time_s: float
    plan_compute_time_s: float
    plan_memory_bytes_per_device: int
    best: str | None
    difference: str
    plan_comm_bytes_per_device: int | None = None  # the bytes objective: what it ranks by

    def to_json(self) -> dict[str, Any]:
        return {"plan_step_time_s": self.plan_step_time_s,
                "plan_compute_time_s": self.plan_compute_time_s,
                "plan_memory_bytes_per_device": self.plan_memory_bytes_per_device,
                "best": self.best, "rows": [r.to_json() for r in self.rows],
                "difference": self.difference} | (
            {"plan_comm_bytes_per_device": self.plan_comm_bytes_per_device}
            if self.plan_comm_bytes_per_device is not None else {}
        )  # fmt: skip

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> Recipes:
        return Recipes(
            tuple(RecipeRow.from_json(r) for r in data.get("rows") or ()),
            float(data.get("plan_step_time_s") or 0.0),
            float(data.get("plan_compute_time_s") or 0.0),
            int(data.get("plan_memory_bytes_per_device") or 0), data.get("best"),
            str(data.get("difference") or ""), data.get("plan_comm_bytes_per_device"),
        )  # fmt: skip

    def row(self, name: str) -> RecipeRow | None:
        return next((r for r in self.rows if r.name == name), None)

    @property
    def plan(self) -> RecipeRow:
        """The plan as a row, priced as the recipes are."""
        return RecipeRow("plan", "plan", self.plan_step_time_s, self.plan_compute_time_s,
                         self.plan_memory_bytes_per_device, True, None,
                         self.plan_comm_bytes_per_device)  # fmt: skip


def recipes_block(prices: Sequence[RecipePrice], plan: RecipeRow, budget: int) -> Recipes:
    """The block of the recipes' `prices` beside `plan` (as a row: its program's cost, its
    communication bytes given where the plan minimized them), on a budget of `budget` bytes.
    The best recipe is the one that fits and costs least by the plan's objective."""
    rows = tuple(map(_row, prices))
    fitting = [r for r in rows if r.fits]
    best = min(fitting, key=_measure) if fitting else None
    return Recipes(
        rows, plan.step_time_s or 0.0, plan.compute_time_s or 0.0,
        plan.memory_bytes_per_device or 0, best.name if best else None,
        difference(plan, rows, best, budget), plan.comm_bytes_per_device,
    )  # fmt: skip


def _measure(row: RecipeRow) -> float:
    """What the plan minimized: its communication bytes, where it minimized them, else time."""
    if row.comm_bytes_per_device is not None:
        return float(row.comm_bytes_per_device)
    return row.step_time_s or 0.0


def _row(price: RecipePrice) -> RecipeRow:
    name, title = price.recipe.value, price.recipe.label
    if price.refused:
        return RecipeRow(name, title, None, None, None, None, price.refused)
    return RecipeRow(name, title, price.step_time_s, price.compute_time_s,
                     price.memory_bytes_per_device, price.fits, None,
                     price.comm_bytes_per_device, price.memory_at_least,
                     price.at_most)  # fmt: skip


def difference(
    plan: RecipeRow, rows: Sequence[RecipeRow], best: RecipeRow | None, budget: int
) -> str:
    """How the plan differs from the best recipe that fits, and why it wins, in a line."""
    t = format_seconds
    if best is None:
        priced = [r for r in rows if r.memory_bytes_per_device is not None]
        if not priced:
            return "no recipe applies to this model and mesh"
        least = min(priced, key=lambda r: r.memory_bytes_per_device or 0)
        return (
            f"no recipe fits the budget of {format_bytes(budget)} per device (the least, "
            f"{least.name}, needs {format_bytes(least.memory_bytes_per_device or 0)}); the "
            f"plan fits in {format_bytes(plan.memory_bytes_per_device or 0)}"
        )
    mine, theirs = _measure(plan), _measure(best)
    if theirs < mine and abs(mine - theirs) > SAME * max(abs(mine), abs(theirs)):
        shown = format_bytes if plan.comm_bytes_per_device is not None else t
        return (
            f"{best.name} ({shown(theirs)}) costs {(mine - theirs) / mine:.1%} less than the "
            f"plan ({shown(mine)}): the plan is not the search's optimum (a solver gap, or "
            f"the annotations' hints); `explain --why-not {best.name}` compares them"
        )
    return versus(plan, best, "the best recipe that fits, ")


def versus(plan: RecipeRow, row: RecipeRow, which: str = "") -> str:
    """The plan beside one recipe, in a line: how much faster and where the time goes (its
    communication, compute and memory against the recipe's)."""
    t = format_seconds
    if row.refused:
        return f"{row.name} does not apply: {row.refused}"
    name = (
        f"{which}{row.name}"
        + {True: "", False: " (over the budget)", None: " (may not fit)"}[row.fits]
        + (" (at most: its fastest not proven)" if row.at_most else "")
    )
    if plan.comm_bytes_per_device is not None and row.comm_bytes_per_device is not None:
        return _versus_bytes(plan, row, name)
    mine, theirs = plan.step_time_s or 0.0, row.step_time_s or 0.0
    if abs(mine - theirs) <= SAME * max(abs(mine), abs(theirs)):
        return f"the plan costs what {row.name} costs ({t(theirs)}): it is that layout, or ties"
    faster = (
        f"the plan is {_share((theirs - mine) / theirs)} faster than {name}"
        if theirs > mine
        else f"{name} is {_share((mine - theirs) / mine)} faster than the plan"
    )
    return (
        f"{faster} ({t(mine)} vs {t(theirs)}): communication {t(plan.comm_time_s)} vs "
        f"{t(row.comm_time_s)}, compute {t(plan.compute_time_s or 0.0)} vs "
        f"{t(row.compute_time_s or 0.0)}, memory "
        f"{format_bytes(plan.memory_bytes_per_device or 0)} vs "
        f"{format_bytes(row.memory_bytes_per_device or 0)}"
    )


def _share(fraction: float) -> str:
    """A fraction as a percentage, with a second decimal under 0.1 % (never "0.0% faster")."""
    return f"{fraction:.2%}" if fraction < 0.001 else f"{fraction:.1%}"


# The recipes are priced without overlap (compute plus communication, like the objective the
# search minimizes), so the plan's row is its objective too, not its overlapped step time.
RECIPE_HEADER = ("layout", "compute + comm", "memory/device", "fits")


def recipe_cells(block: Recipes) -> list[tuple[str, str, str, str]]:
    """The block's rows as text cells (`RECIPE_HEADER`), the plan's first; a recipe that does
    not apply says why in its last cell."""
    rows = [("plan (chosen)", format_seconds(block.plan_step_time_s),
             format_bytes(block.plan_memory_bytes_per_device), "yes")]  # fmt: skip
    for r in block.rows:
        if r.refused:
            rows.append((r.name, "n/a", "", r.refused))
            continue
        memory = format_bytes(r.memory_bytes_per_device or 0)
        fits = "unknown" if r.fits is None else "yes" if r.fits else "no"
        time = format_seconds(r.step_time_s or 0.0)
        rows.append((r.name, f"<= {time}" if r.at_most else time,
                     f">= {memory}" if r.memory_at_least else memory, fits))  # fmt: skip
    return rows


def recipes_table(block: Recipes) -> list[str]:
    """The block as a small text table: a row per recipe (and the plan's), then the line."""
    rows = [RECIPE_HEADER, *recipe_cells(block)]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [
        "  " + "".join(cell.ljust(w + 2) for cell, w in zip(row, widths, strict=False)) + row[3]
        for row in rows
    ]
    return ["beside the standard recipes:", *lines, f"  {block.difference}"]


def _versus_bytes(plan: RecipeRow, row: RecipeRow, name: str) -> str:
    """`versus` for a plan that minimized its communication bytes."""
    mine, theirs = plan.comm_bytes_per_device or 0, row.comm_bytes_per_device or 0
    if mine == theirs:
        less = f"the plan sends what {name} sends"
    elif theirs > mine:
        less = f"the plan sends {(theirs - mine) / theirs:.1%} less than {name}"
    else:
        less = f"{name} sends {(mine - theirs) / mine:.1%} less than the plan"
    return (
        f"{less} ({format_bytes(mine)} vs {format_bytes(theirs)} per device): step time "
        f"{format_seconds(plan.step_time_s or 0.0)} vs {format_seconds(row.step_time_s or 0.0)}"
        f", memory {format_bytes(plan.memory_bytes_per_device or 0)} vs "
        f"{format_bytes(row.memory_bytes_per_device or 0)}"
    )
