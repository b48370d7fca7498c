"""What the program of a choice per group costs, without lowering it: its compute (the
search's own compute costs, unscaled: each op's roofline, `cost.compute`) and its
communication as materialization makes it (`traffic`). The solver minimizes the scaled
integer costs, which count a reshard per reader; these are the program's seconds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.search.memory.build import Chain
from autoshard.search.traffic import Traffic


@dataclass(frozen=True, eq=False)
class Prices:
    """Each group's compute per choice (seconds; zero under the bytes objective) and the
    program's communication (`traffic`)."""

    compute: tuple[np.ndarray, ...]
    traffic: Traffic

    def of(self, choice: Sequence[int]) -> tuple[float, float, frozenset[Chain]]:
        """The compute and the communication seconds of one choice per group, and the
        reshards of several collectives its program makes."""
        # The choice's groups beyond the decisions' are shared reshards: no compute.
        compute = sum(
            float(costs[k])
            for costs, k in zip(self.compute, choice[: len(self.compute)], strict=True)
        )
        return compute, *self.traffic.seconds(choice)
