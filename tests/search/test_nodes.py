"""Collectives across nodes as NCCL runs them (`cost.price.collective_time`), against the
formulas written out by hand: the ring over every NIC of a node, the two-stage hierarchical
algorithm, the faster of the two; and how a group sits on the nodes (`Cluster.stages`)."""

import pytest

from autoshard.collectives import ring_bytes
from autoshard.cost.cluster import _spread, make_cluster
from autoshard.cost.price import collective_time
from autoshard.reshard import plan_reshard
from autoshard.sharding import Sharding

S = Sharding.parse
DGX = make_cluster(mesh="16x8", file="dgx-h100")  # 16 nodes of 8: 50 GB/s, 5 us; 450 GB/s, 1 us


def only(src, dst, shape, cluster=DGX, itemsize=4):
    (collective,) = plan_reshard(S(src), S(dst), shape, cluster.mesh, itemsize)
    return collective


def test_128_way_all_gather_of_a_large_weight_runs_the_ring_over_every_nic():
    """A 1 GiB fp32 tensor (16384 x 16384) sharded 128 ways, 8 MiB each, gathered: 127 x 8 MiB
    per device. The ring's 127 steps of 5 us at min(450, 8 x 50) GB/s: 3.30 ms; the two
    stages (15 shards across nodes at 50 GB/s in 15 steps of 5 us, 112 in the node at 450
    GB/s in 7 of 1 us): 4.69 ms. The ring wins; one 50 GB/s NIC would take 21.9 ms."""
    c = only("[[0, 1]]", "[[]]", (16384, 16384))
    local = 2**23
    assert c.bytes_per_device == 127 * local
    ring = 127 * 5e-6 + 127 * local / 400e9
    staged = 15 * 5e-6 + 7 * 1e-6 + 15 * local / 50e9 + 112 * local / 450e9
    assert ring < staged
    assert collective_time(c, DGX) == pytest.approx(ring)
    assert collective_time(c, DGX) < (127 * 5e-6 + 127 * local / 50e9) / 6


def test_128_way_reduce_scatter_of_a_small_gradient_goes_in_two_stages():
    """A partial sum of 4 MiB (1024 x 1024 fp32) scattered 128 ways: 127 pieces of 32 KiB.
    The ring: 127 x 5 us + 127 x 32 KiB / 400 GB/s = 645 us; the two stages: 15 x 5 us +
    7 x 1 us + 15 x 32 KiB / 50 GB/s + 112 x 32 KiB / 450 GB/s = 100 us. Latency decides."""
    c = only("[[]] partial = sum[0, 1]", "[[0, 1]]", (1024, 1024))
    piece = 2**15
    assert c.bytes_per_device == 127 * piece
    ring = 127 * 5e-6 + 127 * piece / 400e9
    staged = 15 * 5e-6 + 7 * 1e-6 + 15 * piece / 50e9 + 112 * piece / 450e9
    assert staged < ring
    assert collective_time(c, DGX) == pytest.approx(staged)


def test_all_reduce_over_both_axes_takes_twice_the_steps_of_each_stage():
    """all_reduce of 64 MiB (4096 x 4096 fp32) over 128: 2 x 127 pieces of 512 KiB. Ring:
    254 x 5 us + 254 x 512 KiB / 400 GB/s; stages: 30 x 5 us + 14 x 1 us + 30 x 512 KiB /
    50 GB/s + 224 x 512 KiB / 450 GB/s."""
    c = only("[[]] partial = sum[0, 1]", "[[]]", (4096, 4096))
    piece = 2**19
    assert c.bytes_per_device == 2 * 127 * piece
    ring = 254 * 5e-6 + 254 * piece / 400e9
    staged = 30 * 5e-6 + 14 * 1e-6 + 30 * piece / 50e9 + 224 * piece / 450e9
    assert collective_time(c, DGX) == pytest.approx(min(ring, staged))


def test_one_device_per_node_is_a_plain_ring_over_its_nic():
    """all_gather over axis 0 of 16x8 (one device in each of 16 nodes, 8 such groups sharing
    each node's NICs): 15 shards of 4 MiB at 50 GB/s in 15 steps of 5 us, as before."""
    c = only("[[0]]", "[[]]", (16384, 1024))
    assert c.bytes_per_device == 15 * 2**22
    assert collective_time(c, DGX) == pytest.approx(15 * 5e-6 + 15 * 2**22 / 50e9)


def test_an_axis_of_16_with_8_per_node():
    """A flat mesh of 16 H100s is two nodes of 8; its one axis runs on the network's 50 GB/s,
    but NCCL's ring leaves each node through 8 NICs: all_gather of 15 shards of 64 MiB takes
    15 x 5 us + 15 x 64 MiB / min(450, 400) GB/s (the stages: 1 shard across at 50 GB/s,
    14 in the node at NVLink's 450, 1 x 5 us + 7 x 1 us)."""
    flat = make_cluster(mesh="16", device="h100")
    c = only("[[0]]", "[[]]", (16384, 16384), flat)
    shard = 2**26
    assert c.bytes_per_device == 15 * shard
    ring = 15 * 5e-6 + 15 * shard / 400e9
    staged = 5e-6 + 7e-6 + shard / 50e9 + 14 * shard / 450e9
    assert collective_time(c, flat) == pytest.approx(min(ring, staged)) == pytest.approx(ring)


def test_all_to_all_across_nodes_sends_the_other_nodes_part_over_the_nics():
    """all_to_all over both axes of 16x8: of the 127 pieces a device sends, 120 go to other
    nodes (at its 50 GB/s share) while 7 stay in the node (at 450 GB/s), at once."""
    c = only("[[0, 1]]", "[[], [0, 1]]", (1024, 1024))
    assert c.bytes_per_device == ring_bytes(c.kind, 128, 2**15)
    piece = c.bytes_per_device / 127
    expected = 127 * 5e-6 + max(120 * piece / 50e9, 7 * piece / 450e9)
    assert collective_time(c, DGX) == pytest.approx(expected)


def test_a_group_within_a_node_is_priced_as_before():
    c = only("[[1]]", "[[]]", (1024, 1024))
    assert collective_time(c, DGX) == pytest.approx(7 * 1e-6 + 7 * 2**19 / 450e9)


@pytest.mark.parametrize(
    "shape, axes, node_size, expected",
    [
        ((16, 8), (0, 1), 8, (8, 16)),
        ((16, 8), (0,), 8, (1, 16)),
        ((16, 8), (1,), 8, (8, 1)),
        ((4, 4), (0,), 8, (2, 2)),  # two rows of axis 0 in each node
        ((2, 8, 2), (0, 2), 8, (2, 2)),  # axis 1 spans half a node: axis 2's pairs share it
        ((3, 4), (0,), 8, (1, 2)),  # uneven: {0, 4} in node 0 and {8} in node 1
    ],
    ids=str,
)
def test_groups_on_nodes(shape, axes, node_size, expected):
    """(devices per node, nodes) of the groups, by counting devices // node_size."""
    assert _spread(shape, axes, node_size) == expected
