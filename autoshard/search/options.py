"""What a search is asked to do: its objective and how long the solver may take."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from autoshard.errors import AutoshardError


class Objective(enum.StrEnum):
    """What the search minimizes: the step's time (compute + communication), or the bytes
    each device sends."""

    TIME = "time"
    BYTES = "bytes"


@dataclass(frozen=True, kw_only=True)
class SolverOptions:
    """`time_limit` is in CP-SAT's deterministic seconds, shared by every solve of one search
    (so the same request gives the same plan on any machine)."""

    objective: Objective = Objective.TIME
    time_limit: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.time_limit < math.inf:  # also false for nan
            raise AutoshardError(
                f"time limit {self.time_limit!r} is not a positive number of seconds, like 60"
            )
