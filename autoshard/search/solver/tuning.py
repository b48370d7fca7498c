"""Every tuning constant of the solver, in one place: the rule each sets and why.

The code reads them as `tuning.NAME`, so a test may change one for all the solver's modules.
What each was measured on, and the before and after of each change, is in
`docs/concepts/solver-tuning.md`.
"""

# ---- exact elimination (`factors`) -------------------------------------------------------------

MAX_ENTRIES = 2**24
"""The largest table `factors.minimize` builds by default (128 MiB of int64): a graph needing
a larger one is answered None at once, and solved another way."""

DIFFERENCES = 2**22
"""Entries `factors.undominated` takes at once, rows of an edge's matrix against rows: bounds
its memory (32 MiB of int64)."""

BLOCK = 2**20
"""Entries `factors.min_marginals` sums at once over a block of a group's choices: bounds its
memory (8 MiB of float64)."""

SMALL = 2**16
"""A step whose whole table has at most this many entries is summed at once, in cache; a
larger one a choice of its group at a time, to bound its memory."""

# ---- the problem (`search.reads`) -------------------------------------------------------------

SHARED_PAIRS = 2**10
"""The most choices a value's shared reshard group may have (pairs of the sharding held and the
one made once for readers of several groups): past it the value's reads are priced per group,
over-counting what several groups share, since on a 3-axis mesh the pairs run to thousands and
the memory-bound solve slows many times over."""

# ---- the relaxation's steps (`dual`) -----------------------------------------------------------

ITERATIONS = 20
"""Subgradient steps at most: the bound settles in fewer on the bundled models, and more
steps rarely change the plans found."""

WORK = 8 * 10**8
"""The work (table entries built and summed) all the steps may take: a large subproblem stops
after a few steps, where the bound is close to where many would take it."""

STEP_WORK = WORK // 4
"""A subproblem whose exact tables would take more work than this is bounded within the pairs
the edges join instead (weaker, as easy as the problem without memory): a step leaves room for
more."""

REACH = 0.05
"""While no plan fits, each step aims this much above the bound, relatively: doubled after a
step that raised the bound, halved (to this at least) after one that did not."""

LONGER = 40
"""Steps the first relaxation of `solve` may take past `ITERATIONS` while the bound still
rises: a bound still rising pays for more steps in a smaller search after."""

RISE_STEPS = 10
"""The steps over which `dual` checks whether the bound still rises (`RISE`)."""

RISE = 0.005
"""How much, relatively, the bound must have risen in the last `RISE_STEPS` steps for `dual`
to go on past its steps."""

STALLED = 5
"""Steps in a row that do not raise the bound after which the step length halves: Polyak's
length overshoots once the bound nears its best."""

PEAK_ROWS = 4
"""The rows at the first plan's peak that `least_peak` weighs alone: vertices of the simplex,
where its steps rarely land, and the least peak is often one row's least bytes."""

# ---- the relaxation's tables (`Relaxation`) ----------------------------------------------------

DENSE = 1 << 17
"""An indicator over at most this many combinations of its groups' choices is one exact table;
a larger one is bounded from below by tables of its parts, to keep each step cheap."""

DENSER = 1 << 19
"""`DENSE` where the bounds of larger indicators lose too much of a row (`LOOSE`): exact
tables cost more per step, but a loose bound leaves the multipliers nothing to raise."""

LOOSE = 0.9
"""The share of the bytes of the row at the memory-aside optimum's peak under which the
bounds of large indicators are too loose, and `DENSER` is used (`table_limit`)."""

HUB = 1 << 22
"""An indicator over more combinations than `DENSE` but at most this many may be exact too,
in one table per scope summing all such indicators (`_Hub`), where the step's work allows."""

BITS = 40
"""The indicators' bits a hub folds into its class codes before numbering them again: the
classes, fewer than `HUB`, shifted by this many bits stay within int64."""

ROOM = 64
"""The most tables an AND distributed over its ORs may take (`Bound.distributed`): past it,
the weaker bound of its parts is cheaper."""

HUB_TRIAL = 3
"""Steps that try the relaxation with its large indicators exact (`strengthened`): enough to
see whether they raise the bound, cheap where they do not."""

HUB_GAIN = 0.05
"""How much higher, relatively, the trial must take the bound for the rest of the search to
keep the exact hubs: they matter much where they matter at all."""

# ---- reduced-cost fixing (`marginals`) ---------------------------------------------------------

ROUNDING = 1e-9
"""The relative error a relaxation's float values may carry (its multipliers are floats): a
bound is rounded up only past it, so that no plan is left out by rounding."""

MARGINAL_ROWS = 16
"""How many rows `rows_alone` weighs alone: a row alone sees what a mix of rows blurs, and
each costs a pass of min-marginals."""

AGAIN = 0.1
"""The share of the choices rows alone must leave out for the relaxation of those left to be
solved again (`within_budget`): a second relaxation pays only where it no longer mixes in many
choices that cannot fit."""

TIGHTEN_STEPS = 8
"""Subgradient steps in each round of `tightened`: from the whole problem's multipliers, a few
reach most of the restricted problem's bound."""

TIGHTEN_ROUNDS = 8
"""The most rounds of `tightened`: each leaves out fewer choices than the one before."""

# ---- narrowing (`Narrowing`) ------------------------------------------------------------------

FIRST_GAP = 0.02
"""The first threshold tried lies at most this much past the relaxation's bound, relatively;
each try after doubles the distance."""

FIRST_SHARE = 1 / 8
"""The share of the choices the first threshold keeps at most, doubled each try: CP-SAT's time
grows with the choices kept, and flat min-marginals keep most of them at a small gap."""

WHOLE_SHARE = 0.8
"""A threshold keeping more than this share of the choices sends the cost's whole problem to
CP-SAT instead, from the best plan found: each failed try costs a solve, and past this share
narrowing saves little."""

MOST = 0.5
"""Where the best plan's value keeps this share of the choices or more, the cost's next
threshold is halfway to it first, once: a try of fewer choices proves more per second."""
