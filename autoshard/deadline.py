"""The wall-clock deadline of one command (`--time-limit`): started when the command starts and
handed down through every phase of a plan search, each of which looks at it where it can stop
safely (after a group, an op, a step of the relaxation; CP-SAT is given what is left).

A phase that has a plan when the deadline passes answers with it (FEASIBLE, its proven gap);
a phase that cannot have one yet (the import, building the problem) raises `TimeUp`, which
names the phase and how far it got. The deadline only ever stops work early: while it has not
passed nothing reads it, so a run under a generous limit does exactly what a run without one
does (the same plan, byte for byte).

    >>> ticks = iter(range(10)).__next__          # a clock that moves 1 s per reading
    >>> deadline = Deadline.start(2.5, ticks)     # started at 0
    >>> deadline.passed(), deadline.passed(), deadline.passed()
    (False, False, True)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from autoshard.errors import AutoshardError


class TimeUp(AutoshardError):
    """The time limit ran out in a phase that has no plan to answer with."""


@dataclass(frozen=True)
class Deadline:
    """`seconds` of `clock` (monotonic: a changed system clock moves no deadline) from
    `started`. A clock is injectable, so that a test can make a phase run out at a point of
    its own choosing rather than at one a loaded machine chooses."""

    seconds: float
    started: float
    clock: Callable[[], float] = field(default=time.monotonic, compare=False, repr=False)

    @classmethod
    def start(cls, seconds: float, clock: Callable[[], float] = time.monotonic) -> Deadline:
        return cls(seconds, clock(), clock)

    def left(self) -> float:
        """The seconds left (0 once passed; infinite for `NEVER`)."""
        if math.isinf(self.seconds):
            return math.inf
        return max(0.0, self.seconds - (self.clock() - self.started))

    def passed(self) -> bool:
        return self.left() <= 0.0

    def check(self, phase: str, progress: str = "") -> None:
        """`TimeUp` naming `phase` (`building the problem`) and how far it got (`memory: 312
        of 747 values`) once the deadline has passed."""
        if self.passed():
            raise TimeUp(self.ran_out(f"while {phase}" + (f" ({progress})" if progress else "")))

    def ran_out(self, where: str) -> str:
        """`the time limit (3 s of wall clock) ran out WHERE; raise --time-limit`."""
        return (
            f"the time limit ({self.seconds:g} s of wall clock) ran out {where}; raise --time-limit"
        )


NEVER = Deadline(math.inf, 0.0)
"""No deadline: what a library call without one runs under."""
