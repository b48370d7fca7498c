"""The memory model's live conditions: `Literals.running` is `combine` of every prefix."""

from __future__ import annotations

import random

import pytest

from autoshard.search.memory.literals import Literals
from autoshard.search.memory.rows import Chosen

SIZES = [3, 4, 2]


def _literal(rng: random.Random) -> Chosen | int | bool:
    kind = rng.randrange(6)
    if kind == 0:
        return rng.random() < 0.5
    if kind == 1:
        return rng.randrange(5)  # an indicator made before
    group = rng.randrange(len(SIZES))
    return Chosen(group, frozenset(rng.sample(range(SIZES[group]), rng.randint(1, SIZES[group]))))


@pytest.mark.parametrize("every", [False, True], ids=["or", "and"])
@pytest.mark.parametrize("seed", range(40))
def test_running_is_the_combination_of_each_prefix(every: bool, seed: int) -> None:
    rng = random.Random(seed)
    literals = [_literal(rng) for _ in range(rng.randint(1, 12))]
    one_pass, one_by_one = Literals(SIZES), Literals(SIZES)
    running = one_pass.running(every, literals)
    combined = [one_by_one.combine(every, literals[: j + 1]) for j in range(len(literals))]
    assert running == combined
    assert one_pass.indicators == one_by_one.indicators  # the same, made in the same order


def test_an_or_of_every_choice_of_a_group_is_true_from_then_on() -> None:
    literals = Literals(SIZES)
    a, b, c = Chosen(0, frozenset({0})), Chosen(0, frozenset({1, 2})), Chosen(1, frozenset({0}))
    assert literals.running(False, [a, c, False, b, c]) == [a, 0, 0, True, True]
    assert literals.indicators[0].literals == (a, c)


def test_a_constant_is_not_taken_for_the_indicator_it_equals() -> None:
    literals = Literals(SIZES)  # True == 1 and False == 0 in Python: the cache keeps them apart
    assert literals.combine(False, [True]) is True
    assert literals.combine(False, [1]) == 1 and literals.combine(False, [1]) is not True
    assert literals.combine(True, [False]) is False
    assert literals.combine(True, [0]) == 0 and literals.combine(True, [0]) is not False
