"""The search problem's costs before scaling to integers: what a choice per group costs in
the objective's own unit (seconds, or bytes), compute apart. The solver minimizes the scaled
integer costs (tie-breakers added); a plan's price, read here, is the unrounded sum of the
same terms, so pricing a choice never needs its program lowered."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class Prices:
    """The problem's costs before scaling, in the objective's unit (seconds, or bytes): each
    group's compute and its whole node cost per choice, and each edge's matrix."""

    compute: tuple[np.ndarray, ...]
    node: tuple[np.ndarray, ...]
    edges: Mapping[tuple[int, int], np.ndarray]

    def of(self, choice: Sequence[int]) -> tuple[float, float]:
        """The compute and the whole cost of one choice per group."""
        compute = sum(float(costs[k]) for costs, k in zip(self.compute, choice, strict=True))
        total = sum(float(costs[k]) for costs, k in zip(self.node, choice, strict=True))
        edges = sum(float(m[choice[a], choice[b]]) for (a, b), m in sorted(self.edges.items()))
        return compute, total + edges
