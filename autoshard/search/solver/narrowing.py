"""CP-SAT on the choices a plan below a threshold may take, the threshold rising until the
best plan found is proven optimal or the time is spent (`Narrowing`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from autoshard.search.problem import Problem
from autoshard.search.solver import tuning
from autoshard.search.solver.marginals import still_possible
from autoshard.search.solver.outcome import (
    Attempt,
    Found,
    Improvements,
    Limit,
    OutOfTime,
    in_whole,
    kept_among,
    renumbered,
    time_left,
)


class Narrowing:
    """CP-SAT on the choices a plan of a value below a threshold may take (reduced-cost
    fixing, `marginals.still_possible`): few, where the relaxation's bound is close. A plan
    below the threshold takes only choices kept, so if CP-SAT proves its best plan there
    below the threshold, it is the optimum; if that best is at the threshold or above (or
    there is none), no plan is below it anywhere, which raises the bound to the threshold,
    or to that best, if lower, or the least value a choice left out allows (`beyond`).
    The thresholds: the bound plus `FIRST_GAP` of it, doubling the distance each time, but
    none keeping more than `FIRST_SHARE` of the choices, doubling that share each time (and
    again while either is at the bound or under: a threshold there keeps what a try held); at
    most the value of the best plan found (whose choices are then kept, so that CP-SAT
    proves it or finds better), and that value next once a try finds no plan below its
    threshold but one above; where `halfway` and that value keeps `MOST` of the choices or
    more, halfway to it first, once, unless the shares' next threshold is lower; where that
    value, or halfway to it, keeps too many to narrow, the shares' thresholds go on. Where
    few choices are left out (more than `whole_share` kept, or no min-marginals), the whole
    problem is solved. At the best's value and halfway to it, `tighten` leaves out more of
    the choices a try keeps (`marginals.tightened`), given them, the threshold and the best
    plan.

    Worked example (`test_no_plan_yet_narrows_up_to_the_whole_share`): two groups of 16
    choices, min-marginals 100..115 in each, the bound 100. Below 102 keeps 4 choices (an
    eighth): no plan; below 104, 8: no plan; below 108, 16 (half, under `WHOLE_SHARE`): a
    plan of 110, none below, so the bound is 108. That value keeps 20 choices, `MOST` or
    more: halfway to it first, below 109 (18 choices), none below; then below 110 (20),
    where the plan of 110 is proven optimal."""

    def __init__(
        self,
        problem: Problem,
        marginals: Sequence[np.ndarray] | None,
        attempt: Callable[[Problem, Sequence[int], int, Limit], Attempt],
        watch: Improvements | None,
        what: str,
        whole_share: float,
        halfway: bool = False,
        tighten: Callable[[list[list[int]], int, Sequence[int]], list[list[int]]] | None = None,
    ) -> None:
        self.problem, self.marginals, self.attempt = problem, marginals, attempt
        self.watch, self.what, self.whole_share = watch, what, whole_share
        self.halfway, self.tighten = halfway, tighten
        self.variables = self.constraints = 0
        flat = np.concatenate(marginals) if marginals else np.zeros(0)
        self.sorted = np.sort(flat[np.isfinite(flat)])  # (infinite: in no plan that fits)

    def run(
        self,
        best: Found | None,
        bound: int,
        limit: Limit,
        start: tuple[int, ...] = (),
        enough: int = -1,
    ) -> tuple[Found | None, int, float]:
        """The best plan found (None: none fits), the bound proven and the work spent.
        `start`: where CP-SAT starts on the whole problem while no plan is found (the
        memory-aside optimum, which it repairs: `WHOLE_SHARE` says why); `enough`: a value
        at which to stop, once a plan reaches it."""
        spent, distance, first = 0.0, max(1, math.ceil(tuning.FIRST_GAP * abs(bound))), bound
        share, least, halfway = tuning.FIRST_SHARE, 0, self.halfway
        while best is None or (bound < best.value and best.value > enough):
            while first + distance <= bound:
                distance *= 2
            by_share = self.keeping(share)
            while by_share is not None and by_share <= bound:
                share *= 2
                by_share = self.keeping(share)
            reach = first + distance if by_share is None else min(first + distance, by_share)
            threshold = max(bound + 1, least, reach)
            distance, share = distance * 2, share * 2
            if best is not None and threshold >= best.value:
                threshold = best.value
            kept = self.tried(threshold, best, threshold == least)
            narrowed = self.problem if kept is None else self.problem.restricted(kept)
            self.tell(narrowed, kept, threshold, bound)
            given = dataclasses.replace(limit, seconds=time_left(limit.seconds, spent))
            try:
                if kept is None and start:  # the whole problem: no bound, from a plan
                    got = self.attempt(narrowed, best.choice if best else start, 0, given)
                else:
                    got = self.attempt(narrowed, renumbered(best, kept), bound, given)
            except OutOfTime:
                if best is None:
                    raise
                return best, bound, spent + given.seconds
            spent += got.work
            self.variables, self.constraints = got.variables, got.constraints
            if got.value is not None:
                plan = Found(in_whole(got.choice, kept), got.value)
                best = plan if best is None or plan.value < best.value else best
            if kept is None:  # the whole problem: what CP-SAT proved
                return best, max(bound, got.bound if got.value is not None else bound), spent
            if not got.optimal:
                return best, max(bound, min(got.bound, threshold)), spent
            # The optimum of the choices kept: none below the threshold elsewhere, nor below
            # it, or below the least value a choice left out allows (`beyond`), whichever
            # is lower: where that is the best's value, the best is the optimum.
            if got.value is not None and got.value < threshold:
                return best, got.value, spent
            proven = min(self.beyond(kept), math.inf if got.value is None else got.value)
            if proven == math.inf:  # every choice of a plan that fits was kept, and none fits
                return best, threshold, spent
            bound = threshold if proven <= threshold else int(proven)
            if best is None:
                continue
            if bound >= best.value:
                bound = best.value
            elif got.value is not None and (at_best := self.possible(best.value, best)) is not None:
                # One there, none below: its value next (far fewer tries than doubling from
                # a low bound), unless that keeps most choices: then halfway to it, once (a
                # try of fewer choices), but not past the shares' next threshold, a try of
                # fewer choices still that may find a plan near the optimum where the best is
                # far from it; neither where it would send CP-SAT the whole problem (the
                # shares' smaller tries find better plans than the whole problem's).
                distance = max(distance, best.value - first)
                if halfway and self.many(at_best, tuning.MOST):
                    halfway, middle = False, (bound + best.value) // 2
                    by_share = self.keeping(share)
                    shares_first = by_share is not None and by_share < middle
                    if not shares_first and self.kept(middle, best) is not None:
                        least, distance = middle, middle - first
                elif self.narrowed(at_best) is not None:
                    share = 1.0
        return best, bound, spent

    def tell(
        self, narrowed: Problem, kept: list[list[int]] | None, threshold: int, bound: int
    ) -> None:
        """Tell the tracker what the next try holds, and the bounds its solve may tell."""
        if self.watch is None:
            return
        left = "all" if kept is None else f"{narrowed.variables} of"
        below = "" if kept is None else f": {self.what} below {self.watch.say(threshold)}?"
        self.watch.tracker.detail(f"CP-SAT on {left} {self.problem.variables} choices{below}")
        self.watch.floor = bound
        self.watch.ceiling = math.inf if kept is None else threshold

    def keeping(self, share: float) -> int | None:
        """The highest threshold keeping at most `share` of the choices (by their min-marginals
        alone); None where that is all of them: no threshold is too high (past every
        min-marginal, the choices `tighten` leaves may still be fewer)."""
        at = int(share * self.problem.variables)
        return None if at >= len(self.sorted) else math.floor(self.sorted[at])

    def kept(self, threshold: int, best: Found | None) -> list[list[int]] | None:
        """The choices a plan below `threshold` may take, and the best plan's; None when
        they are `whole_share` of them or more (or when there are no min-marginals)."""
        return self.narrowed(self.possible(threshold, best))

    def possible(self, threshold: int, best: Found | None) -> list[list[int]] | None:
        """The choices a plan below `threshold` may take, and the best plan's (None: no
        min-marginals)."""
        if self.marginals is None:
            return None
        return still_possible(self.marginals, threshold, best.choice if best else None)

    def tried(self, threshold: int, best: Found | None, halfway: bool) -> list[list[int]] | None:
        """The choices the try below `threshold` holds: those a plan below it may take, and
        the best plan's, fewer (`tighten`) at the best plan's value or `halfway` to it; None
        where they are `whole_share` of them or more. Tightened, a try finds no plan above
        its threshold that needs a choice left out: at the best's value none is better, but
        a try at a threshold the shares set is also the search for plans better than the
        best, which tightening there would miss."""
        possible = self.possible(threshold, best)
        proving = best is not None and (halfway or threshold == best.value)
        if possible is not None and best is not None and self.tighten is not None and proving:
            possible = self.tighten(possible, threshold, best.choice)
        return self.narrowed(possible)

    def beyond(self, kept: list[list[int]]) -> float:
        """The highest threshold below which every plan takes only choices `kept` (their
        min-marginals alone say so; infinite where every choice left out is in no plan that
        fits): a try proving that none of them reaches a value below its optimum proves it of
        every plan below this too, and spares a next try that keeps the same choices for the
        same answer."""
        if self.marginals is None:
            return -math.inf
        out = [np.delete(m, k) for m, k in zip(self.marginals, kept, strict=True)]
        least = min((float(m.min()) for m in out if len(m)), default=math.inf)
        if least == math.inf:
            return math.inf
        # still_possible keeps a choice whose min-marginal is at most `below` - 1 plus its
        # rounding (relative: 10 at 1e10): the highest `below` leaving the least out is
        # one of these.
        highest = math.floor(least - tuning.ROUNDING * max(1.0, abs(least))) + 2
        for threshold in range(highest, highest - 4, -1):
            if kept_among(self.possible(threshold, None), kept):
                return threshold
        return -math.inf

    def narrowed(self, possible: list[list[int]] | None) -> list[list[int]] | None:
        """Those choices, or None where they are `whole_share` of them or more."""
        return None if possible is None or self.many(possible, self.whole_share) else possible

    def many(self, possible: list[list[int]], share: float) -> bool:
        """Whether these are `share` of the problem's choices or more."""
        return sum(map(len, possible)) >= share * self.problem.variables
