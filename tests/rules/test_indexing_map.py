"""IndexingMap keeps the loops of each dim worked out once: what `loops` answers must be what
the dims say, and the kept tuple must not change equality, hashing or the repr."""

from dataclasses import replace

from autoshard.rules.base import IndexingMap


def test_loops_are_the_dims_loops_in_order() -> None:
    strided = IndexingMap((((2, 0), (1, 3)), (), ((1, 1),)))
    assert [strided.loops(d) for d in range(3)] == [(0, 3), (), (1,)]
    assert IndexingMap.of(2, None, 0).loops(0) == (2,)
    assert IndexingMap.of(2, None, 0).loops(1) == ()


def test_a_replaced_map_answers_its_own_loops() -> None:
    before = IndexingMap.of(0, 1)
    after = replace(before, dims=(((1, 4),), ((1, 5),)))
    assert (after.loops(0), after.loops(1)) == ((4,), (5,))
    assert before.loops(0) == (0,)


def test_the_kept_loops_change_neither_equality_nor_repr() -> None:
    one, two = IndexingMap.of(0, None), IndexingMap((((1, 0),), ()))
    assert one == two and hash(one) == hash(two)
    assert one != IndexingMap.of(1, None)
    assert repr(one) == "IndexingMap(dims=(((1, 0),), ()))"
