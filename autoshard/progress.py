"""What a long run shows while it works: its stage, the seconds since it started, what it is
doing in that stage, and during a solve the best objective found and the bound the solver has
proven. A `Tracker` is told each change (the stages by the pipeline, the rest by the search and
CP-SAT's callbacks) and hands each new `Progress` to a view: `TerminalView` (one line redrawn
in place), `LinesView` (plain lines, for logs and pipes), or the service's job row.

Watching changes nothing of what is solved: the solver's callbacks only read its state, and a
single-worker CP-SAT search with a fixed seed takes the same path with or without them.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import IO, Any

from autoshard.units import in_units


@dataclass(frozen=True, kw_only=True)
class Progress:
    """One moment of a run. `objective` and `bound` are those of the solve under way (the
    bound proven so far: no plan costs less), in `unit`: `s` (a time objective) or `B`."""

    stage: str
    elapsed_s: float
    detail: str = ""
    objective: float | None = None
    bound: float | None = None
    unit: str = "s"

    @property
    def gap(self) -> float | None:
        """How far the best plan may be from the optimum, as a fraction of its objective."""
        if self.objective is None or self.bound is None:
            return None
        return max(0.0, self.objective - self.bound) / self.objective if self.objective else 0.0

    def figures(self) -> str:
        """`objective 1.28 ms, bound 1.2 ms (gap 6.3%)`; empty outside a solve."""
        parts = []
        if self.objective is not None:
            parts.append(f"objective {in_units(self.objective, self.unit)}")
        if self.bound is not None:
            parts.append(f"bound {in_units(self.bound, self.unit)}")
        gap = self.gap
        return ", ".join(parts) + (f" (gap {gap:.1%})" if gap is not None else "")

    def __str__(self) -> str:
        """`[2.4 s] search: solving 412 groups; objective 1.28 ms, bound 1.2 ms (gap 6.3%)`."""
        text = f"[{self.elapsed_s:.1f} s] {self.stage}"
        if self.detail:
            text += f": {self.detail}"
        figures = self.figures()
        return text + (f"; {figures}" if figures else "")

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage, "detail": self.detail, "elapsed_s": round(self.elapsed_s, 3),
            "objective": self.objective, "bound": self.bound, "unit": self.unit,
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Progress:
        return cls(**data)


View = Callable[[Progress], None]


class Tracker:
    """The run's progress as it changes; each change goes to `view`. Thread-safe: CP-SAT's
    callbacks and the terminal's ticker may come from other threads."""

    def __init__(self, view: View, clock: Callable[[], float] = time.monotonic) -> None:
        self._view, self._clock = view, clock
        self._started = clock()
        self._lock = threading.Lock()
        self.current = Progress(stage="start", elapsed_s=0.0)

    def stage(self, name: str, detail: str = "") -> None:
        """A stage begins (the pipeline names it: `pipeline.PipelineStage`)."""
        self._show(lambda _: Progress(stage=name, elapsed_s=0.0, detail=detail))

    def detail(self, text: str) -> None:
        """What the stage is doing now; a solve's figures start afresh after it."""
        self._show(lambda now: Progress(stage=now.stage, elapsed_s=0.0, detail=text))

    def solved(self, text: str) -> None:
        """The solve under way ended (`text` says how); its last figures stay shown until the
        next step (an exact solve's are told only at its end)."""
        self._show(lambda now: replace(now, elapsed_s=0.0, detail=text))

    def solution(self, objective: float | None, bound: float, unit: str) -> None:
        """The solve under way found a better plan (`objective`) or proved a better bound."""
        self._show(lambda now: replace(now, objective=objective, bound=bound, unit=unit))

    def _show(self, change: Callable[[Progress], Progress]) -> None:
        with self._lock:
            changed = change(self.current)
            if replace(changed, elapsed_s=0.0) == replace(self.current, elapsed_s=0.0):
                return  # nothing new (CP-SAT repeats a bound)
            self.current = replace(changed, elapsed_s=self._clock() - self._started)
            self._view(self.current)


class LinesView:
    """Plain lines for a stream that is not a terminal: one when the stage or what it does
    changes, and of a solve's improvements the first, then at most one every `every` seconds,
    and the last (so a log shows the solve converge without a line per solution). Nothing
    before `delay` seconds: a quick run prints nothing."""

    def __init__(self, out: IO[str], delay: float = 0.0, every: float = 1.0) -> None:
        self.out, self.delay, self.every = out, delay, every
        self._last: Progress | None = None  # the last one printed
        self._pending: Progress | None = None  # figures not printed yet

    def __call__(self, progress: Progress) -> None:
        if progress.elapsed_s < self.delay:
            return
        last = self._last
        if last is None or (progress.stage, progress.detail) != (last.stage, last.detail):
            self._flush()  # the last figures of the step that ended
            self._print(progress)
        elif last.objective is None and last.bound is None:
            self._print(progress)  # the step's first figures
        elif progress.elapsed_s - last.elapsed_s >= self.every:
            self._print(progress)
        else:
            self._pending = progress

    def _flush(self) -> None:
        if self._pending is not None:
            self._print(self._pending)

    def _print(self, progress: Progress) -> None:
        print(f"autoshard: {progress}", file=self.out, flush=True)
        self._last, self._pending = progress, None

    def close(self) -> None:
        self._flush()


class TerminalView:
    """One line on a terminal, redrawn in place as the run goes and every `tick` seconds (so
    the elapsed time moves while the solver works); during a solve a bar fills as the gap
    between the best plan and the proven bound closes. Cleared when the run ends. Nothing
    before `delay` seconds."""

    WIDTH = 16  # characters of the bar

    def __init__(
        self, out: IO[str], delay: float = 0.0, tick: float = 0.25, columns: int | None = None
    ) -> None:
        self.out, self.delay = out, delay
        self.columns = columns or shutil.get_terminal_size().columns
        self._progress: Progress | None = None
        self._received = 0.0
        self._drawn = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, args=(tick,), daemon=True)
        self._ticker.start()

    def __call__(self, progress: Progress) -> None:
        with self._lock:
            self._progress, self._received = progress, time.monotonic()
            self._draw()

    def _tick(self, tick: float) -> None:
        while not self._stop.wait(tick):
            with self._lock:
                self._draw()

    def line(self, progress: Progress, elapsed: float) -> str:
        """`search 2.4 s [##########------] objective 1.28 ms, bound 1.2 ms (gap 6.3%);
        CP-SAT on 10 of 81 groups`: the figures first, the line cut at the terminal's width."""
        text = f"{progress.stage} {elapsed:.1f} s"
        gap = progress.gap
        if gap is not None:
            full = round((1 - min(gap, 1.0)) * self.WIDTH)
            text += " [" + "#" * full + "-" * (self.WIDTH - full) + "]"
        rest = "; ".join(part for part in (progress.figures(), progress.detail) if part)
        text += f" {rest}" if rest else ""
        return text[: self.columns - 1]

    def _draw(self) -> None:
        progress = self._progress
        if progress is None:
            return
        elapsed = progress.elapsed_s + time.monotonic() - self._received
        if elapsed < self.delay:
            return
        # \r: back to the line's start; ESC[K: erase what a longer line left.
        self.out.write("\r" + self.line(progress, elapsed) + "\x1b[K")
        self.out.flush()
        self._drawn = True

    def close(self) -> None:
        self._stop.set()
        self._ticker.join()
        with self._lock:
            if self._drawn:
                self.out.write("\r\x1b[K")
                self.out.flush()
