"""`--recompute auto`: the search decides a training step's recomputation by its step time.

Each recomputation `recompute_ladder` offers is a step of its own (its graph replays other
ops), planned by a search of its own. Each has a lower bound on its step (`compute_floor`:
every op whole, split over every device at the device's fastest memory) and a memory floor
(`memory_floor`), from its graph alone, priced only where they decide (`Lazy`): those whose
memory floor is over the budget are skipped; the rest are solved in the order of the compute
they replay, each skipped where its bound is no better than the fastest step found, which no
plan of it can beat (branch and bound over the candidates: the fastest is found, not the
first that fits). The story names the one chosen, its step, and what the runner-up costs.

Worked example: bounds none 10 s, layers:4 11 s, layers 13 s. `none` solved: 20 s (it fits
only by sharding activations, at much communication); layers:4's bound 11 < 20, solved: 12 s;
layers' bound 13 >= 12: not solved. Chosen layers:4, 12 s a step; runner-up none, 20 s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from autoshard.cost.cluster import Cluster
from autoshard.cost.replay import compute_floor, memory_floor, recompute_ranked
from autoshard.deadline import TimeUp
from autoshard.ir.graph import Graph
from autoshard.search.solver.outcome import InfeasibleError, OutOfTime
from autoshard.training.options import Recompute, Training
from autoshard.units import format_bytes, format_seconds

V = TypeVar("V")


@dataclass(frozen=True)
class RecomputeCandidate:
    """One recomputation `auto` considered: `bound_s`, the least step any of its plans can
    take (None: not needed, so not priced); `step_s`, its plan's step where solved; else
    `why` it has none."""

    training: Training
    bound_s: float | None
    step_s: float | None = None
    why: str = ""

    def words(self) -> str:
        name = self.training.recompute_text
        if self.step_s is None:
            return f"{name}: {self.why}"
        return f"{name}: {format_seconds(self.step_s)} a step"

    def to_json(self) -> dict[str, object]:
        return {"recompute": self.training.recompute_text, "bound_s": self.bound_s,
                "step_time_s": self.step_s, "why": self.why}  # fmt: skip


class Lazy(Mapping[Training, V]):
    """The values of `keys`, each made by `make` when first read (a recomputation's training
    step, its floors: `auto` often needs only `none`'s)."""

    def __init__(self, keys: Sequence[Training], make: Callable[[Training], V]) -> None:
        self._keys, self._make = tuple(keys), make
        self._known: dict[Training, V] = {}

    def __getitem__(self, key: Training) -> V:
        if key not in self._keys:
            raise KeyError(key)
        if key not in self._known:
            self._known[key] = self._make(key)
        return self._known[key]

    def __iter__(self) -> Iterator[Training]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


@dataclass(frozen=True)
class Ladder:
    """What `auto` knows of its recomputations before any search: every one, in the order of
    the compute it replays (`ranked`); each one's step floor (`bounds`) and memory floor
    (`floors`), priced when first read."""

    ranked: tuple[Training, ...]
    bounds: Mapping[Training, float]
    floors: Mapping[Training, int]

    @classmethod
    def of(cls, forward: Graph, steps: Mapping[Training, Graph], cluster: Cluster) -> Ladder:
        """The ladder of `steps` (each recomputation's training step, `none`'s first: the
        others are built only where their floors are read) of `forward` on `cluster`."""
        first = next(iter(steps))
        ranked = recompute_ranked(forward, steps[first], tuple(steps), cluster)
        bounds = Lazy(ranked, lambda t: compute_floor(steps[t], cluster))
        floors = Lazy(ranked, lambda t: memory_floor(steps[t], cluster.mesh.size))
        return cls(ranked, bounds, floors)

    @classmethod
    def unpriced(cls, ranked: tuple[Training, ...]) -> Ladder:
        """Each of `ranked` solved in turn, no floor known (a pipeline's stage step is not
        the whole step the floors price)."""
        return cls(ranked, dict.fromkeys(ranked, 0.0), dict.fromkeys(ranked, 0))


def choose_recompute(
    ranked: Sequence[Training], bounds: Mapping[Training, float],
    solve: Callable[[Training, bool], tuple[float, bool]],
    floors: Mapping[Training, int] | None = None, budget: float = math.inf,
) -> tuple[RecomputeCandidate, tuple[RecomputeCandidate, ...]]:  # fmt: skip
    """The candidate of the fastest step, and every one considered, in `ranked`'s order (by
        the compute they replay, so roughly by their bounds): each solved by `solve` (its step's
        seconds, and whether the memory budget binds its search; told whether it is the last
        chance, where its error should say the least memory a plan needs) unless its memory floor
        (`floors`) is over `budget` (but the last, which answers where none fits) or its bound is
        no better than the fastest step found; where the budget binds no plan of `none`, none
        other is solved (recomputing frees memory the search does not need, and only adds to
        what it minimizes); where the time runs out with a plan found (`TimeUp` or the solve's
    `OutOfTime`), the rest are not. A floor
        or bound is read only where it decides: lazy mappings (`Lazy`) price no more. The last
        chance's error where none fits; `TimeUp` where the time runs out before any plan."""
    considered: list[RecomputeCandidate] = []
    for index, step in enumerate(ranked):
        best, last = fastest(considered), index == len(ranked) - 1
        floor = 0 if last or floors is None else floors[step]
        if floor > budget:
            why = f"needs at least {format_bytes(floor)} per device"
            considered.append(RecomputeCandidate(step, None, why=why))
            continue
        bound = None if best is None else bounds[step]
        if best is not None and bound is not None and bound >= (best.step_s or 0.0):
            why = f"not solved, no plan of it under {format_seconds(bound)}"
            considered.append(RecomputeCandidate(step, bound, why=why))
            continue
        try:
            seconds, binds = solve(step, best is None and last)
        except InfeasibleError:
            if best is None and last:
                raise
            considered.append(RecomputeCandidate(step, bound, why="no plan fits"))
            continue
        except (TimeUp, OutOfTime):  # while building its problem; in its solve, with no plan
            if best is None:
                raise
            considered += [RecomputeCandidate(t, None, why="out of time")
                           for t in ranked[index:]]  # fmt: skip
            break
        considered.append(RecomputeCandidate(step, bound, seconds))
        if step.recompute is Recompute.NONE and not binds:
            why = "not solved, the budget binds no plan keeping every activation"
            considered += [RecomputeCandidate(t, None, why=why) for t in ranked[index + 1 :]]
            break
    chosen = fastest(considered)
    assert chosen is not None  # the last chance raised otherwise
    return chosen, tuple(considered)


def fastest(candidates: Sequence[RecomputeCandidate]) -> RecomputeCandidate | None:
    """The solved candidate of the least step, the first of equals (None: none solved)."""
    solved = [c for c in candidates if c.step_s is not None]
    return min(solved, key=lambda c: c.step_s or 0.0) if solved else None


def recompute_words(chosen: RecomputeCandidate, candidates: Sequence[RecomputeCandidate]) -> str:
    """The story's sentence on `auto`'s choice: `Recompute layers:4, the fastest step of
    those tried (12 s a step); runner-up none: 20 s a step (+66.7 %); layers: not solved,
    ...`, those not solved for one reason named together."""
    assert chosen.step_s is not None
    others = [c for c in candidates if c is not chosen]
    runner = fastest(others)
    step = f"{format_seconds(chosen.step_s)} a step"
    told = [
        f"Recompute {chosen.training.recompute_text}"
        + (f", the fastest step of those tried ({step})" if runner else f" ({step})")
    ]
    if runner is not None and runner.step_s is not None:
        more = 100 * (runner.step_s / chosen.step_s - 1) if chosen.step_s else 0.0
        told.append(f"runner-up {runner.words()} (+{more:.1f} %)")
    told += [c.words() for c in others if c is not runner and c.step_s is not None]
    whys: dict[str, list[str]] = {}
    for c in others:
        if c.step_s is None:
            whys.setdefault(c.why, []).append(c.training.recompute_text)
    for why, names in whys.items():
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        told.append(f"{listed}: {why}")
    return "; ".join(told) + "."
