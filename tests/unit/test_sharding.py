"""Sharding: validation, canonical form, text forms and the index maps of
docs/design/resharding.md."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.errors import ShardingError
from autoshard.mesh import Mesh
from autoshard.sharding import ReductionKind, Sharding, parse_sharding


def ceildiv(a, b):
    return -(-a // b)


# ---- index maps ------------------------------------------------------------------------------


def test_index_map_check_t13_17():
    # docs/design/resharding.md: sharding [[0], [1]] on an MxN = 3x4 mesh, K x L = 16x23 tensor:
    # t[13, 17] = d(13 floordiv 6, 17 floordiv 6)[13 % 6, 17 % 6] = d(2, 2)[1, 5].
    mesh, shape, sharding = Mesh((3, 4)), (16, 23), Sharding.parse("[[0], [1]]")
    holders = [d for d in mesh.devices() if _holds(sharding, mesh, shape, d, (13, 17))]
    assert holders == [(2, 2)]
    (r0, _), (c0, _) = sharding.slices(mesh, shape, (2, 2))
    assert (13 - r0, 17 - c0) == (1, 5)


def test_index_map_transposed_sharding():
    # Sharding [[1], [0]], M=5, N=2, K=27, L=14. The map,
    #   t[i, j] -> d(j floordiv (L ceildiv M), i floordiv (K ceildiv N))[i % .., j % ..],
    # checked on t[9, 13]: d(13 floordiv 3, 9 floordiv 14)[9 % 14, 13 % 3] = d(4, 0)[9, 1].
    mesh, shape, sharding = Mesh((5, 2)), (27, 14), Sharding.parse("[[1], [0]]")
    holders = [d for d in mesh.devices() if _holds(sharding, mesh, shape, d, (9, 13))]
    assert holders == [(4, 0)]
    (r0, _), (c0, _) = sharding.slices(mesh, shape, (4, 0))
    assert (9 - r0, 13 - c0) == (9, 1)
    # The seed's own device/offset formulas, for every element: each lands on exactly one device.
    K, L, M, N = 27, 14, 5, 2
    for i, j in itertools.product(range(K), range(L)):
        device = (j // ceildiv(L, M), i // ceildiv(K, N))
        (r0, r1), (c0, c1) = sharding.slices(mesh, shape, device)
        assert r0 <= i < r1 and c0 <= j < c1
        assert (i - r0, j - c0) == (i % ceildiv(K, N), j % ceildiv(L, M))


def test_uneven_last_shards_are_smaller_or_empty():
    # 10 rows over 4 devices: ceil(10/4) = 3 -> 3, 3, 3, 1. 5 rows over 4: 2, 2, 1, 0.
    mesh = Mesh((4,))
    sharding = Sharding.parse("[[0]]")
    assert [sharding.local_shape(mesh, (10,), (i,)) for i in range(4)] == [(3,), (3,), (3,), (1,)]
    assert [sharding.slices(mesh, (5,), (i,)) for i in range(4)] == [
        ((0, 2),),
        ((2, 4),),
        ((4, 5),),
        ((5, 5),),
    ]


def test_offsets_seed_003():
    # mesh1d_4, split_axes = [[], [0]], sharded_dims_offsets = [0, 2, 5, 9, 14] on 4x14:
    # shard shapes 4x2, 4x3, 4x4, 4x5.
    mesh = Mesh((4,), name="mesh1d_4")
    sharding = Sharding.parse("[[], [0]] sharded_dims_offsets = [0, 2, 5, 9, 14]")
    assert [sharding.local_shape(mesh, (4, 14), (i,)) for i in range(4)] == [
        (4, 2),
        (4, 3),
        (4, 4),
        (4, 5),
    ]


def test_offsets_32x32x32_seed_003():
    # 32x32x32 with the first 2 dims sharded, offsets [0, 24, 32, 0, 20, 32]: the first device
    # gets 24x20x32 and the second 8x12x32 (on a mesh of 2x2, device (1, 1)).
    mesh = Mesh((2, 2))
    sharding = Sharding.parse("[[0], [1]] sharded_dims_offsets = [0, 24, 32, 0, 20, 32]")
    assert sharding.local_shape(mesh, (32, 32, 32), (0, 0)) == (24, 20, 32)
    assert sharding.local_shape(mesh, (32, 32, 32), (1, 1)) == (8, 12, 32)


def test_halos_widen_shards_within_the_tensor():
    # halo_sizes = [1, 2]: one extra row before, two after, clipped at the tensor's edges.
    mesh = Mesh((2, 2))
    sharding = Sharding.parse("[[0]] halo_sizes = [1, 2]")
    assert sharding.slices(mesh, (8, 8), (0, 1)) == ((0, 6), (0, 8))
    assert sharding.slices(mesh, (8, 8), (1, 0)) == ((3, 8), (0, 8))


# ---- validation --------------------------------------------------------------------------------


MESH = Mesh((2, 2))


@pytest.mark.parametrize(
    "text, shape, message",
    [
        ("[[3]]", None, r"unknown mesh axis 3 in [[3]]; mesh @mesh0 has axes 0..1"),
        ("[[0], [0]]", None, "mesh axis 0 splits on dims 0 and 1 in [[0], [0]]"),
        ("[[0, 0]]", None, "mesh axis 0 splits twice on dim 0 in [[0, 0]]"),
        ("[[0]] partial = sum[0]", None, "mesh axis 0 is both split (dim 0) and partial"),
        ("[[0]] partial = sum[1, 1]", None, "partial axes repeat"),
        (
            "[[], [], [1]]",
            (4, 4),
            "sharding [[], [], [1]] has 3 dims but the tensor 4x4 has rank 2",
        ),
        (
            "[[0]] sharded_dims_offsets = [0, 3, 2]",
            (4,),
            "sharded_dims_offsets [0, 3, 2] of dim 0 in [[0]] sharded_dims_offsets = [0, 3, 2] "
            "must start at 0 and never decrease",
        ),
        ("[[0]] sharded_dims_offsets = [0, 2, 5]", (4,), "end at 5, not at the dim size 4"),
        (
            "[[0]] sharded_dims_offsets = [0, 4]",
            (4,),
            "has 2 sharded_dims_offsets; mesh 2x2 needs 3",
        ),
        (
            "[[0]] halo_sizes = [1, 1] sharded_dims_offsets = [0, 2, 4]",
            None,
            "has both halo_sizes and sharded_dims_offsets; they are mutually exclusive",
        ),
        ("[[0], [1]] halo_sizes = [1, 1]", None, "has 2 halo sizes; it needs 2 per split dim (4)"),
    ],
)
def test_invalid(text, shape, message):
    with pytest.raises(ShardingError) as error:
        Sharding.parse(text).check(MESH, shape)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[[0], [1", "expected ',' or ']' at column 9"),
        ("[[a]]", "expected an integer at column 3"),
        ("[[0]] partial = foo[1]", "unknown reduction 'foo' (valid: sum, max, min, product"),
        ("[[0]] extra = [1]", "unexpected 'extra'"),
        ("[[?]]", "dynamic '?' sizes are not supported"),
        ("[[-1]]", "expected an integer >= 0 at column 3"),
        ("[[0]] halo_sizes = [-1, 1]", "expected an integer >= 0 at column 21"),
        ("[[0],]", "expected a list item after ',' at column 6"),
        ("[[0,], [1]]", "expected a list item after ',' at column 5"),
        ("[[0]] partial = sum[1,]", "expected a list item after ',' at column 23"),
        ("[[0]]]", "unexpected ']' at column 6"),
        ("[[0]] [1]", "unexpected '[' at column 7"),
        ("[[0], [1]", "expected ',' or ']' at column 10"),
        ("[[0] [1]]", "expected ',' or ']' at column 6"),
        ("mesh.sharding mesh0 split_axes = [[0]]", "expected the mesh symbol, like @mesh0"),
        ("[[0]] : !mesh.sharding junk", "unexpected 'junk'"),
    ],
)
def test_parse_errors(text, message):
    with pytest.raises(ShardingError) as error:
        Sharding.parse(text)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


# ---- canonical form and text ------------------------------------------------------------------


def test_trailing_empty_dims_are_insignificant():
    assert Sharding.parse("[[0], [], []]") == Sharding.parse("[[0]]") == Sharding(((0,), (), ()))
    assert str(Sharding.parse("[[0], [], []]")) == "[[0]]"
    assert Sharding.parse("[[0]]").text(rank=3) == "[[0], [], []]"
    assert (
        str(Sharding()) == "[[]]" and Sharding.parse("[]") == Sharding.parse("[[]]") == Sharding()
    )


def test_partial_type_is_irrelevant_without_partial_axes():
    assert Sharding(((0,),), (), ReductionKind.MAX) == Sharding(((0,),))


@pytest.mark.parametrize(
    "terse, mlir",
    [
        ("[[0], [1, 2]]", "mesh.sharding @mesh0 split_axes = [[0], [1, 2]] : !mesh.sharding"),
        (
            "[[0]] partial = sum[1]",
            "mesh.sharding @mesh0 split_axes = [[0]] partial = sum[1] : !mesh.sharding",
        ),
        (
            "[[0]] partial = max[1]",
            "mesh.sharding @mesh0 split_axes = [[0]] partial = max[1] : !mesh.sharding",
        ),
        (
            "[[0]] halo_sizes = [1, 2]",
            "mesh.sharding @mesh0 split_axes = [[0]] halo_sizes = [1, 2] : !mesh.sharding",
        ),
        (
            "[[], [0]] sharded_dims_offsets = [0, 2, 5, 9, 14]",
            "mesh.sharding @mesh0 split_axes = [[], [0]] sharded_dims_offsets = [0, 2, 5, 9, 14]"
            " : !mesh.sharding",
        ),
        ("[[]]", "mesh.sharding @mesh0 split_axes = [[]] : !mesh.sharding"),
    ],
)
def test_text_forms(terse, mlir):
    sharding = Sharding.parse(terse)
    assert str(sharding) == terse
    assert sharding.to_mlir() == mlir
    assert parse_sharding(mlir) == ("mesh0", sharding)
    assert parse_sharding(terse) == (None, sharding)


@st.composite
def meshes(draw):
    return Mesh(tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))))


@st.composite
def shardings(draw, mesh, rank):
    """A random valid sharding: each mesh axis split on some dim (any order), partial, or unused."""
    split = [[] for _ in range(rank)]
    partial = []
    for axis in draw(st.permutations(range(mesh.ndim))):
        where = draw(st.integers(-2, rank - 1))
        if where >= 0:
            split[where].append(axis)
        elif where == -1:
            partial.append(axis)
    kind = draw(st.sampled_from(list(ReductionKind)))
    return Sharding(tuple(map(tuple, split)), tuple(partial), kind)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_text_round_trips(data):
    mesh = data.draw(meshes())
    rank = data.draw(st.integers(0, 3))
    sharding = data.draw(shardings(mesh, rank))
    split_dims = len(sharding.sharded_dims)
    if split_dims and data.draw(st.booleans()):
        halos = data.draw(
            st.lists(st.integers(0, 3), min_size=2 * split_dims, max_size=2 * split_dims)
        )
        sharding = Sharding(
            sharding.split_axes, sharding.partial_axes, sharding.partial_type, tuple(halos)
        )
    assert Sharding.parse(str(sharding)) == sharding
    assert Sharding.parse(sharding.text(rank)) == sharding
    assert parse_sharding(sharding.to_mlir("m")) == ("m", sharding)
    assert eval(repr(sharding), {"Sharding": Sharding, "ReductionKind": ReductionKind}) == sharding


# ---- tiling: every element is held by exactly the devices the sharding says ---------------


def _holds(sharding, mesh, shape, device, element):
    bounds = sharding.slices(mesh, shape, device)
    return all(a <= e < b for e, (a, b) in zip(element, bounds, strict=True))


def _expected_holders(sharding, mesh, shape, element):
    """The index map of docs/design/resharding.md, written independently: on dim k split over axes A
    (outer to inner), the element at e lies in shard e floordiv ceil(K / |A|), and device d holds
    shard sum(d[a] * prod(sizes of later axes in A))."""
    holders = []
    for device in mesh.devices():
        ok = True
        for k, size in enumerate(shape):
            axes = sharding.split_axes[k] if k < len(sharding.split_axes) else ()
            if not axes:
                continue
            count = math.prod(mesh.shape[a] for a in axes)
            shard = 0
            for a in axes:
                shard = shard * mesh.shape[a] + device[a]
            ok &= element[k] // ceildiv(size, count) == shard
        if ok:
            holders.append(device)
    return holders


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_slices_tile_the_tensor(data):
    mesh = data.draw(meshes())
    shape = tuple(data.draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
    sharding = data.draw(shardings(mesh, len(shape)))
    split_devices = math.prod(mesh.shape[a] for axes in sharding.split_axes for a in axes)
    for element in itertools.product(*(range(s) for s in shape)):
        holders = [d for d in mesh.devices() if _holds(sharding, mesh, shape, d, element)]
        assert holders == _expected_holders(sharding, mesh, shape, element)
        # Exactly one shard per split group: the copies are the devices on unsplit axes.
        assert len(holders) == mesh.size // split_devices
    # The shards of one replica tile the tensor without overlap.
    total = sum(math.prod(sharding.local_shape(mesh, shape, d)) for d in mesh.devices())
    assert total == math.prod(shape) * (mesh.size // split_devices)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_offsets_tile_the_tensor(data):
    mesh = data.draw(meshes())
    shape = tuple(data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=2)))
    sharding = data.draw(shardings(mesh, len(shape)))
    offsets = []
    for dim in sharding.sharded_dims:
        cuts = sorted(
            data.draw(
                st.lists(
                    st.integers(0, shape[dim]),
                    min_size=sharding.shard_count(mesh, dim) - 1,
                    max_size=sharding.shard_count(mesh, dim) - 1,
                )
            )
        )
        offsets += [0, *cuts, shape[dim]]
    sharding = Sharding(
        sharding.split_axes,
        sharding.partial_axes,
        sharding.partial_type,
        sharded_dims_offsets=tuple(offsets),
    )
    sharding.check(mesh, shape)
    split_devices = math.prod(mesh.shape[a] for axes in sharding.split_axes for a in axes)
    for element in itertools.product(*(range(s) for s in shape)):
        holders = [d for d in mesh.devices() if _holds(sharding, mesh, shape, d, element)]
        assert len(holders) == mesh.size // split_devices
