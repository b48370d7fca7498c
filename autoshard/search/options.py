"""What a search is asked to do: its objective and how long the solver may take."""

from __future__ import annotations

import enum
from dataclasses import dataclass


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
