"""Elimination steps remembered across solves (`solver.steps`): the same answers as fresh
solves, each large step computed once per content."""

from __future__ import annotations

import numpy as np
import pytest

from autoshard.search.solver import tuning
from autoshard.search.solver.factors import Factor, _eliminate, minimize
from autoshard.search.solver.steps import Steps
from tests.search.test_factors import exhaustive, random_factors


def restricted(
    sizes: list[int], found: list[Factor], kept: list[list[int]]
) -> tuple[list[int], list[Factor]]:
    """The factors over the choices `kept` of each group (`recipe_prices`' restriction)."""
    tables = [Factor(f.scope, f.table[np.ix_(*(kept[g] for g in f.scope))]) for f in found]
    return [len(k) for k in kept], tables


@pytest.mark.parametrize("seed", range(20))
def test_remembered_steps_answer_each_restriction_as_a_fresh_solve(seed, monkeypatch):
    """Random tables (ties among them: small integers), restricted to one choice of each group
    in turn and to all, solved with one `Steps` for all: the choice and value of a fresh
    solve, the least sum (brute force); solving them again computes no step anew."""
    monkeypatch.setattr(tuning, "SMALL", 0)  # every step remembered
    sizes, found = random_factors(seed, np.int64, groups=7)
    found = [Factor(f.scope, f.table % 7) for f in found]  # ties
    pins = [[list(range(n)) for n in sizes]]
    for g, n in enumerate(sizes):
        pins += [[[n - 1] if h == g else list(range(m)) for h, m in enumerate(sizes)]]
    steps = Steps()
    answers = []
    for kept in pins:
        small, tables = restricted(sizes, found, kept)
        fresh, shared = minimize(small, tables), minimize(small, tables, steps=steps)
        assert fresh is not None and shared == fresh
        assert shared.value == exhaustive(small, tables)[0]
        answers.append(shared)
    seen = len(steps.seen)
    assert seen > 0
    for kept, answer in zip(pins, answers, strict=True):
        assert minimize(*restricted(sizes, found, kept), steps=steps) == answer
    assert len(steps.seen) == seen


def test_a_step_of_the_same_tables_is_computed_once_and_kept_read_only():
    """The same bucket (its table a transposed copy: the same entries, another layout) is
    answered from memory; other entries, or a step of at most `tuning.SMALL` entries, are
    computed."""
    rng = np.random.default_rng(0)
    sizes = [300, 300, 2]  # group 0 against 300: 90,000 entries, past SMALL
    table = rng.integers(0, 100, (300, 300))
    calls = []

    def step(g, neighbours, bucket, sizes):
        calls.append(g)
        return _eliminate(g, neighbours, bucket, sizes)

    steps = Steps()
    first = steps.eliminated(0, (1,), [((0, 1), table)], sizes, step)
    again = steps.eliminated(0, (1,), [((0, 1), np.asfortranarray(table))], sizes, step)
    assert calls == [0] and again is first
    np.testing.assert_array_equal(first[0], table.min(axis=0))
    assert not first[0].flags.writeable
    steps.eliminated(0, (1,), [((0, 1), table + 1)], sizes, step)
    assert calls == [0, 0]
    small = rng.integers(0, 100, (2, 300))
    for _ in range(2):
        steps.eliminated(2, (1,), [((2, 1), small)], sizes, step)
    assert calls == [0, 0, 2, 2] and len(steps.seen) == 2
