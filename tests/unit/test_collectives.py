"""The `Collective` value: its kind decides which of dim, to_dim, reduction and pairs it sets."""

import pytest

from autoshard.collectives import FIELDS, Collective, CollectiveKind
from autoshard.errors import CollectiveError
from autoshard.sharding import ReductionKind, Sharding

K = CollectiveKind
SUM = ReductionKind.SUM
SPLIT = Sharding(((0,), ()))

# Each kind with the fields it sets: a collective of that kind is built with exactly these.
GOOD = {
    K.ALL_GATHER: {"dim": 0},
    K.ALL_SLICE: {"dim": 1},
    K.ALL_TO_ALL: {"dim": 1, "to_dim": 0},
    K.ALL_REDUCE: {"reduction": SUM},
    K.REDUCE_SCATTER: {"dim": 0, "reduction": SUM},
    K.PERMUTE: {"pairs": ((0, 1), (1, 0))},
}

# A kind, the fields given, and the message that refuses them.
BAD = {
    "all_gather without dim": (K.ALL_GATHER, {}, "collective all_gather needs `dim`"),
    "all_slice without dim": (K.ALL_SLICE, {}, "collective all_slice needs `dim`"),
    "all_to_all without dim": (
        K.ALL_TO_ALL,
        {"to_dim": 0},
        "collective all_to_all needs `dim`",
    ),
    "all_to_all without to_dim": (
        K.ALL_TO_ALL,
        {"dim": 1},
        "collective all_to_all needs `to_dim`",
    ),
    "all_reduce without reduction": (
        K.ALL_REDUCE,
        {},
        "collective all_reduce needs `reduction`",
    ),
    "reduce_scatter without dim": (
        K.REDUCE_SCATTER,
        {"reduction": SUM},
        "collective reduce_scatter needs `dim`",
    ),
    "reduce_scatter without reduction": (
        K.REDUCE_SCATTER,
        {"dim": 0},
        "collective reduce_scatter needs `reduction`",
    ),
    "all_gather with to_dim": (
        K.ALL_GATHER,
        {"dim": 0, "to_dim": 1},
        "collective all_gather takes no `to_dim` (it sets `dim`), got to_dim=1",
    ),
    "all_gather with reduction": (
        K.ALL_GATHER,
        {"dim": 0, "reduction": SUM},
        "collective all_gather takes no `reduction` (it sets `dim`), "
        "got reduction=ReductionKind.SUM",
    ),
    "all_slice with pairs": (
        K.ALL_SLICE,
        {"dim": 0, "pairs": ((0, 1),)},
        "collective all_slice takes no `pairs` (it sets `dim`), got pairs=((0, 1),)",
    ),
    "all_to_all with reduction": (
        K.ALL_TO_ALL,
        {"dim": 1, "to_dim": 0, "reduction": SUM},
        "collective all_to_all takes no `reduction` (it sets `dim` and `to_dim`), "
        "got reduction=ReductionKind.SUM",
    ),
    "all_reduce with dim 0": (
        K.ALL_REDUCE,
        {"dim": 0, "reduction": SUM},
        "collective all_reduce takes no `dim` (it sets `reduction`), got dim=0",
    ),
    "all_reduce with pairs": (
        K.ALL_REDUCE,
        {"reduction": SUM, "pairs": ((0, 1),)},
        "collective all_reduce takes no `pairs` (it sets `reduction`), got pairs=((0, 1),)",
    ),
    "reduce_scatter with to_dim": (
        K.REDUCE_SCATTER,
        {"dim": 0, "to_dim": 1, "reduction": SUM},
        "collective reduce_scatter takes no `to_dim` (it sets `dim` and `reduction`), got to_dim=1",
    ),
    "permute with dim": (
        K.PERMUTE,
        {"dim": 0, "pairs": ((0, 1),)},
        "collective permute takes no `dim` (it sets `pairs`), got dim=0",
    ),
    "permute with reduction": (
        K.PERMUTE,
        {"reduction": SUM},
        "collective permute takes no `reduction` (it sets `pairs`), "
        "got reduction=ReductionKind.SUM",
    ),
}


def test_every_kind_has_its_fields():
    assert set(FIELDS) == set(CollectiveKind) == set(GOOD)
    for kind, fields in GOOD.items():
        assert tuple(fields) == FIELDS[kind]


@pytest.mark.parametrize("kind", GOOD, ids=str)
def test_a_kind_takes_its_fields(kind):
    collective = Collective(kind, (0,), SPLIT, SPLIT, (4, 4), 8, **GOOD[kind])
    for name, value in GOOD[kind].items():
        assert getattr(collective, name) == value


def test_a_permute_may_move_nothing():
    """A permute across size-1 axes moves no shard: its pairs are empty, and that is allowed."""
    assert Collective(K.PERMUTE, (), SPLIT, SPLIT, (4, 4), 0).pairs == ()


@pytest.mark.parametrize("case", BAD.values(), ids=list(BAD))
def test_a_field_the_kind_does_not_decide_is_refused(case):
    kind, fields, message = case
    with pytest.raises(CollectiveError) as error:
        Collective(kind, (0,), SPLIT, SPLIT, (4, 4), 8, **fields)
    assert str(error.value) == message
