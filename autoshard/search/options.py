"""What a search is asked to do: its objective and how long the solver may take."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from autoshard.errors import AutoshardError


class Objective(enum.StrEnum):
    """What the search minimizes: the step's time (compute + communication), or the bytes
    each device sends."""

    TIME = "time"
    BYTES = "bytes"

    @classmethod
    def parse(cls, text: str) -> Objective:
        try:
            return cls(text)
        except ValueError:
            valid = ", ".join(o.value for o in cls)
            raise AutoshardError(f"unknown objective {text!r}; valid: {valid}") from None


@dataclass(frozen=True, kw_only=True)
class SolverOptions:
    """`time_limit` is in CP-SAT's deterministic seconds, shared by every solve of one search
    (so the same request gives the same plan on any machine)."""

    objective: Objective = Objective.TIME
    time_limit: float = 60.0
