"""The resharding planner: docs/design/resharding.md's examples, and every plan executed on all
devices."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.errors import ShardingError
from autoshard.execute.simulate import reduce, run_collectives, shard
from autoshard.mesh import Mesh
from autoshard.reshard import ReshardPrices, plan_reshard
from autoshard.reshard.basis import (
    StepGraph,
    axes_mask,
    mask_axes,
    paths_of,
    shape_classes,
    step_graph,
)
from autoshard.reshard.planner import walk
from autoshard.sharding import ReductionKind, Sharding


def steps(src, dst, shape, mesh, itemsize=1):
    plan = plan_reshard(Sharding.parse(src), Sharding.parse(dst), shape, Mesh.parse(mesh), itemsize)
    return [f"{c} | {c.bytes_per_device}" for c in plan]


# Each example of docs/design/resharding.md ("Seed" below): the planner's steps (with bytes per
# device for int8 elements, as its tensor<..xi8>), and how they compare with its algorithm.
SEED_002 = {
    # Seed: swap contents on devices with the same linear index. Same: one permute; 3 bytes is
    # the one row that device 0 sends to device 1 (and device 1's to device 3).
    "2x3 [[0,1]]->[[1,0]]": (
        ("[[0, 1]]", "[[1, 0]]", (2, 3), "2x3"),
        ["permute mesh_axes = [0, 1] | 3"],
    ),
    # Seed: all-gather along mesh axis 0 (which its slip-drawn diagram needs). By the index maps
    # (1-row shards), every target shard already lies on some device: one permute along axis 0
    # (rows 0 and 1 go from devices (0, 0), (0, 1) to (1, 0), (1, 1)), 3 bytes, cheaper than
    # any gather.
    "2x3 [[0,1]]->[[1]]": (
        ("[[0, 1]]", "[[1]]", (2, 3), "2x3"),
        ["permute mesh_axes = [0] | 3"],
    ),
    # Seed: all-gather along mesh axis 1. Same.
    "4x6 [[],[0,1]]->[[],[0]]": (
        ("[[], [0, 1]]", "[[], [0]]", (4, 6), "2x3"),
        ["all_gather mesh_axes = [1] gather_axis = 1 | 8"],
    ),
    # Seed: not one all-gather along axis 1; [[0], [1, 2]] -> [[0], [2, 1]] -> [[0], [2]].
    # Same: a permute (4 bytes), then all_gather over axis 1 (4 bytes).
    "4x8 [[0],[1,2]]->[[0],[2]]": (
        ("[[0], [1, 2]]", "[[0], [2]]", (4, 8), "2x2x2"),
        ["permute mesh_axes = [1, 2] | 4", "all_gather mesh_axes = [1] gather_axis = 1 | 4"],
    ),
    # Seed: TODO; its basis gives all-gather 1 -> all-to-all 0 -> slice 1 (12 + 9 bytes).
    # Cheaper (11 bytes): no gather at all, three all-to-alls moving the 6-byte shards' axes:
    # axis 0 to dim 1 (3), both axes to dim 0 (5), axis 0 back to dim 1 (3).
    "6x6 2x3 [[0],[1]]->[[1],[0]]": (
        ("[[0], [1]]", "[[1], [0]]", (6, 6), "2x3"),
        [
            "all_to_all mesh_axes = [0] split_axis = 1 concat_axis = 0 | 3",
            "all_to_all mesh_axes = [1, 0] split_axis = 0 concat_axis = 1 | 5",
            "all_to_all mesh_axes = [0] split_axis = 1 concat_axis = 0 | 3",
        ],
    ),
    # Seed: TODO. Same shape of plan on 2x6: 3 + 5 bytes.
    "6x6 2x6 [[0],[1]]->[[1],[0]]": (
        ("[[0], [1]]", "[[1], [0]]", (6, 6), "2x6"),
        [
            "all_gather mesh_axes = [0] gather_axis = 0 | 3",
            "all_to_all mesh_axes = [1] split_axis = 0 concat_axis = 1 | 5",
            "all_slice mesh_axes = [0] slice_axis = 1 | 0",
        ],
    ),
    # Seed: all_to_all mesh_axes = [0] split_axis = 1 concat_axis = 0. Same.
    "6x6 3 [[0],[]]->[[],[0]]": (
        ("[[0], []]", "[[], [0]]", (6, 6), "3"),
        ["all_to_all mesh_axes = [0] split_axis = 1 concat_axis = 0 | 8"],
    ),
    # Seed: one all_to_all over axis 2 is not enough; [[0], [1, 2]] -> [[0], [2, 1]] ->
    # [[0, 1], [2]]. Same: a permute (2 bytes) and an all_to_all over axis 1 (1 byte).
    "4x4 [[0],[1,2]]->[[0,1],[2]]": (
        ("[[0], [1, 2]]", "[[0, 1], [2]]", (4, 4), "2x2x2"),
        [
            "permute mesh_axes = [1, 2] | 2",
            "all_to_all mesh_axes = [1] split_axis = 0 concat_axis = 1 | 1",
        ],
    ),
    # Seed's basis example: all-gather along 1, all-to-all along 0, slice along 1. Cheaper:
    # gather the other axis first (see the 6x6 case); on a square 4x4 over 2x2 every target
    # block is a source block, so one permute of the 4-byte shard does it.
    "4x4 2x2 [[0],[1]]->[[1],[0]]": (
        ("[[0], [1]]", "[[1], [0]]", (4, 4), "2x2"),
        ["permute mesh_axes = [0, 1] | 4"],
    ),
    # Seed's 4-D example: a2a 1, a2a 2, all-gather 3, a2a 0 (2 + 2 + 4 + 4 bytes). Cheaper
    # (11): permute the 4-byte shards so that one all-to-all over axes [1, 2] (3) and the
    # all-gather over 3 (4) finish it.
    "[[3,2],[],[0,1]]->[[0],[1,2],[]]": (
        ("[[3, 2], [], [0, 1]]", "[[0], [1, 2], []]", (4, 4, 4), "2x2x2x2"),
        [
            "permute mesh_axes = [0, 1, 2, 3] | 4",
            "all_to_all mesh_axes = [1, 2] split_axis = 1 concat_axis = 2 | 3",
            "all_gather mesh_axes = [3] gather_axis = 0 | 4",
        ],
    ),
}


@pytest.mark.parametrize("case", SEED_002, ids=list(SEED_002))
def test_seed_002_examples(case):
    (src, dst, shape, mesh), expected = SEED_002[case]
    assert steps(src, dst, shape, mesh) == expected
    _check_execution(Mesh.parse(mesh), shape, Sharding.parse(src), Sharding.parse(dst))


@pytest.mark.parametrize(
    "src, dst, shape, mesh, expected",
    [
        # Partial sum to a split: one reduce_scatter, (n-1) * out = 1 * 2x4x4 floats = 128 B.
        (
            "[[]] partial = sum[0]",
            "[[], [], [0]]",
            (2, 4, 8),
            "2",
            ["reduce_scatter mesh_axes = [0] reduction = sum scatter_axis = 2 | 128"],
        ),
        # Partial sum to replicated: all_reduce, 2(n-1)/n * T = 2 * 3/4 * 64 floats = 384 B.
        (
            "[[]] partial = sum[0]",
            "[[]]",
            (8, 8),
            "4",
            ["all_reduce mesh_axes = [0] reduction = sum | 384"],
        ),
        # Replicated to split: local slices, free (their order is the deterministic tie-break).
        (
            "[[]]",
            "[[1], [0]]",
            (8, 8),
            "2x2",
            [
                "all_slice mesh_axes = [0] slice_axis = 1 | 0",
                "all_slice mesh_axes = [1] slice_axis = 0 | 0",
            ],
        ),
        # Split to replicated over two axes: one all_gather, (n-1) * in = 3 * 16 floats.
        (
            "[[0, 1]]",
            "[[]]",
            (8, 8),
            "2x2",
            ["all_gather mesh_axes = [0, 1] gather_axis = 0 | 192"],
        ),
        # Max stays max.
        (
            "[[0]] partial = max[1]",
            "[[0]]",
            (4, 4),
            "2x2",
            ["all_reduce mesh_axes = [1] reduction = max | 32"],
        ),
    ],
)
def test_single_collectives(src, dst, shape, mesh, expected):
    assert steps(src, dst, shape, mesh, itemsize=4) == expected


def test_uneven_dim_is_gathered_whole():
    # 5 rows over 2x2: shards 2, 2, 1, 0. Gathering only axis 1 would give rows [0:4) and
    # [4:5), not the [0:3), [3:5) of a 2-way split, so the planner gathers both axes.
    plan = steps("[[0, 1]]", "[[0]]", (5,), "2x2")
    assert plan == [
        "all_gather mesh_axes = [0, 1] gather_axis = 0 | 6",
        "all_slice mesh_axes = [0] slice_axis = 0 | 0",
    ]
    _check_execution(Mesh.parse("2x2"), (5,), Sharding.parse("[[0, 1]]"), Sharding.parse("[[0]]"))


def test_a_reshard_uses_only_the_axes_of_its_two_shardings():
    # Slicing the replicated 64 KiB over axis 0 first would halve the all_reduce (49152 B, then
    # 32768 B to gather axis 0 back: 81920 < 98304), over axis 0's links, whose speed the
    # planner does not know: an axis neither sharding uses stays out of the plan.
    assert steps("[[]] partial = sum[1]", "[[]]", (64, 256), "2x4", itemsize=4) == [
        "all_reduce mesh_axes = [1] reduction = sum | 98304"
    ]


def test_a_graph_too_big_to_tabulate_is_searched_pair_by_pair():
    # Rank 4 over the four axes of 2x2x2x2: 1457 shardings (2424 with partial axes), too many
    # for the shortest-path table; the pair is searched alone, over the steps that make
    # progress towards the target, and the plan still computes it.
    mesh, shape = Mesh.parse("2x2x2x2"), (4, 4, 4, 4)
    cases = {
        ("[[0, 1, 2, 3]]", "[[], [3, 2, 1, 0]]"): [
            "permute mesh_axes = [0, 1, 2, 3] | 64",
            "all_to_all mesh_axes = [3, 2, 1, 0] split_axis = 1 concat_axis = 0 | 60",
        ],
        ("[[]] partial = sum[0, 1]", "[[2], [3], [0, 1]]"): [
            "all_slice mesh_axes = [2] slice_axis = 0 | 0",
            "all_slice mesh_axes = [3] slice_axis = 1 | 0",
            "reduce_scatter mesh_axes = [0, 1] reduction = sum scatter_axis = 2 | 48",
        ],
    }
    for (src, dst), expected in cases.items():
        assert steps(src, dst, shape, "2x2x2x2") == expected
        _check_execution(mesh, shape, Sharding.parse(src), Sharding.parse(dst))


def test_cannot_create_partial():
    with pytest.raises(ShardingError, match="cannot become partial over new mesh axes"):
        plan_reshard(
            Sharding.parse("[[0]]"), Sharding.parse("[[0]] partial = sum[1]"), (4,), Mesh((2, 2))
        )


# ---- every plan, executed --------------------------------------------------------------------


def _partial_pieces(global_array, sharding, mesh, rng):
    """Per-device local tensors whose reduction over the partial axes is the global shard."""
    pieces = {}
    axes = sharding.partial_axes
    count = mesh.group_size(axes)
    for group in mesh.device_groups(axes):
        # The devices of a group agree outside the partial axes, so they share one shard.
        bounds = sharding.slices(mesh, global_array.shape, group[0])
        block = global_array[tuple(slice(a, b) for a, b in bounds)]
        if sharding.partial_type is ReductionKind.SUM:
            parts = [rng.integers(-50, 50, block.shape) for _ in range(count - 1)]
            parts.append(block - sum(parts, np.zeros_like(block)))
        else:  # MAX: one piece is the value, the others below it
            parts = [block - rng.integers(0, 5, block.shape) for _ in range(count - 1)] + [block]
        for d, part in zip(group, parts, strict=True):
            pieces[d] = part
    return pieces


def _check_execution(mesh, shape, src, dst, seed=0):
    rng = np.random.default_rng(seed)
    global_array = rng.integers(-100, 100, shape)
    if src.partial_axes:
        local = _partial_pieces(global_array, src, mesh, rng)
    else:
        local = shard(global_array, src, mesh)
    plan = plan_reshard(src, dst, shape, mesh)
    result = run_collectives(plan, mesh, local)
    expected = shard(global_array, Sharding(dst.split_axes), mesh)
    if dst.partial_axes:
        for group in mesh.device_groups(dst.partial_axes):
            total = reduce(dst.partial_type, [result[d] for d in group])
            for d in group:
                np.testing.assert_array_equal(total, expected[d])
    else:
        for device in mesh.devices():
            np.testing.assert_array_equal(
                result[device], expected[device], err_msg=f"device {device}"
            )
    return plan


@st.composite
def cases(draw):
    mesh = Mesh(tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))))
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=rank, max_size=rank)))

    def sharding(partial_ok):
        split = [[] for _ in range(rank)]
        partial = []
        for axis in draw(st.permutations(range(mesh.ndim))):
            where = draw(st.integers(-2 if partial_ok else -1, rank - 1))
            if where >= 0:
                split[where].append(axis)
            elif where == -2:
                partial.append(axis)
        return split, partial

    kind = draw(st.sampled_from([ReductionKind.SUM, ReductionKind.MAX]))
    split, partial = sharding(True)
    src = Sharding(tuple(map(tuple, split)), tuple(partial), kind)
    dst_split, _ = sharding(False)
    used = {a for axes in dst_split for a in axes}
    kept = tuple(a for a in partial if a not in used and draw(st.booleans()))
    dst = Sharding(tuple(map(tuple, dst_split)), kept, kind)
    return mesh, shape, src, dst


@settings(max_examples=300, deadline=None)
@given(case=cases())
def test_every_plan_computes_the_target(case):
    mesh, shape, src, dst = case
    _check_execution(mesh, shape, src, dst)


@settings(max_examples=100, deadline=None)
@given(case=cases())
def test_plan_is_never_dearer_than_gather_all_then_slice(case):
    # The naive route (reduce, gather everything, slice) is always available; the planner's
    # bytes never exceed it.
    mesh, shape, src, dst = case
    plan = plan_reshard(src, dst, shape, mesh)
    naive = 0
    local = 4
    for size, axes in itertools.zip_longest(shape, src.split_axes, fillvalue=()):
        local *= -(-size // mesh.group_size(axes)) if axes else size
    pending = [a for a in src.partial_axes if a not in dst.partial_axes]
    if pending:
        n = mesh.group_size(pending)
        naive += 2 * (n - 1) * -(-local // n)
    for axes in src.split_axes:
        if axes:
            n = mesh.group_size(axes)
            naive += (n - 1) * local
            local *= n
    assert sum(c.bytes_per_device for c in plan) <= naive


def _price(collective):
    """Sensitive to the kind, the axes and the bytes of every collective."""
    kinds = ["all_gather", "all_slice", "all_to_all", "all_reduce", "reduce_scatter", "permute"]
    weight = 1 + kinds.index(collective.kind.value)
    return collective.bytes_per_device * weight + 7 * sum(a + 1 for a in collective.mesh_axes)


@settings(max_examples=200, deadline=None)
@given(case=cases())
def test_prices_are_the_planned_collectives_priced(case):
    # The search prices every pair at once from the planner's tables; each is the sum over
    # the very collectives plan_reshard emits.
    mesh, shape, src, dst = case
    replicated = Sharding()
    complete = [replicated, Sharding(dst.split_axes), Sharding(src.split_axes)]
    prices = ReshardPrices(mesh, _price)
    for start, targets in [(src, [dst, *complete]), (replicated, complete)]:
        got = prices.matrix([start], targets, shape, 4)[0]
        for target, cost in zip(targets, got, strict=True):
            expected = sum(_price(x) for x in plan_reshard(start, target, shape, mesh))
            assert cost == pytest.approx(expected, rel=1e-12, abs=0)


# ---- shape classes: one path table for tensors alike but for scale ------------------------------


def test_shape_classes_by_hand():
    # On 2x4 over both axes a dim of 16 splits evenly 8 ways (a dim of 8, twice the bytes), 3
    # does not: (16, 3, 8) of 2-byte elements is (8, 3, 8) of 1-byte ones, 2 * 2 * 1 times,
    # or of 2-byte ones, twice; or itself.
    mesh = Mesh.parse("2x4")
    assert shape_classes((16, 3, 8), mesh, 2, (0, 1)) == (
        ((8, 3, 8), 1, 4),
        ((8, 3, 8), 2, 2),
        ((16, 3, 8), 2, 1),
    )
    assert shape_classes((8, 3), mesh, 1, (0, 1)) == (((8, 3), 1, 1),)
    assert shape_classes((3, 5), mesh, 4, (0, 1)) == (((3, 5), 4, 1),)
    assert shape_classes((), mesh, 4, (0,)) == (((), 4, 1),)
    # (8, 3) on 2x2 is (4, 3): its all_to_all of axis 1 from dim 0 ([[0, 1]], shard 1 x 3)
    # to dim 1 moves a ceil-sized half of its 3 one-byte elements, 2 bytes, where (8, 3)'s
    # 6-element shard moves 3, not twice 2: that class is not even, and a tensor of 1-byte
    # elements gets paths of its own; of 4-byte ones (half of 12 bytes, 6, where (8, 3)
    # moves 12) it shares (4, 3)'s at twice the bytes.
    two = Mesh.parse("2x2")
    assert not paths_of((4, 3), two, 1, (0, 1), False).even
    graph = step_graph((8, 3), two, 1, (0, 1), False)
    assert graph.scale == 1 and graph.paths is paths_of((8, 3), two, 1, (0, 1), False)
    graph = step_graph((8, 3), two, 4, (0, 1), False)
    assert graph.scale == 2 and graph.paths is paths_of((4, 3), two, 4, (0, 1), False)


@st.composite
def classed_cases(draw):
    """Cases whose dims are often multiples of the mesh's devices (a shape class of scale > 1)."""
    mesh, _, src, dst = draw(cases())
    rank = max(len(src.split_axes), len(dst.split_axes), 1)
    rank = draw(st.integers(rank, 3))
    dims = st.one_of(st.integers(1, 7), st.integers(1, 3).map(lambda k: k * mesh.size))
    return mesh, tuple(draw(st.lists(dims, min_size=rank, max_size=rank))), src, dst


@settings(max_examples=150, deadline=None)
@given(case=classed_cases(), itemsize=st.sampled_from([1, 2, 4]))
def test_a_shape_class_plans_and_prices_as_the_tensor_own_graph(case, itemsize):
    # The planner walks (and the search prices) the paths of the tensor's shape class, its
    # steps scaled; the graph of the tensor itself, searched from scratch, gives the same
    # collectives, byte for byte, and the same prices.
    mesh, shape, src, dst = case
    replicated = Sharding()
    pairs = [(src, dst), (src, Sharding(dst.split_axes)), (replicated, Sharding(src.split_axes))]
    prices = ReshardPrices(mesh, _price)
    for start, target in pairs:
        axes = mask_axes(axes_mask(start) | axes_mask(target))
        partial = bool(start.partial_axes)
        paths = paths_of(shape, mesh, itemsize, axes, partial)
        own = StepGraph(shape, mesh, itemsize, axes, paths, 1)
        expected = walk(own, start, target)
        assert plan_reshard(start, target, shape, mesh, itemsize) == expected
        got = prices.matrix([start], [target], shape, itemsize)[0, 0]
        assert got == pytest.approx(sum(_price(c) for c in expected), rel=1e-12, abs=0)
