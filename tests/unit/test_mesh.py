"""Mesh: parsing, linear/multi-index and device groups (docs/design/sharding.md)."""

import pytest

from autoshard.errors import MeshError
from autoshard.mesh import Mesh


@pytest.mark.parametrize(
    "text, shape, names",
    [
        ("4x8", (4, 8), ()),
        ("2x2x2", (2, 2, 2), ()),
        ("8", (8,), ()),
        (" 2 x 3 ", (2, 3), ()),
        ("dp=4,tp=8", (4, 8), ("dp", "tp")),
        ("dp=2, pp=1, tp=4", (2, 1, 4), ("dp", "pp", "tp")),
    ],
)
def test_parse(text, shape, names):
    mesh = Mesh.parse(text)
    assert (mesh.shape, mesh.axis_names) == (shape, names)
    assert Mesh.parse(str(mesh)) == mesh


@pytest.mark.parametrize(
    "text, message",
    [
        ("0", "invalid mesh '0': axis 0 has size 0; sizes must be >= 1"),
        ("4x-2", "invalid mesh '4x-2': axis 1 has size -2; sizes must be >= 1"),
        ("4x2.5", "invalid mesh '4x2.5': axis 1 size '2.5' is not an integer"),
        ("4x?", "axis 1 has dynamic size '?'; MLIR allows dynamic mesh axes, but a plan needs"),
        ("", "empty mesh spec"),
        ("dp=4,tp", "'tp' is not NAME=SIZE"),
        ("dp=4,dp=2", "mesh axis names repeat: dp, dp"),
        ("4x", "axis 1 size '' is not an integer"),
    ],
)
def test_parse_rejects(text, message):
    with pytest.raises(MeshError, match=message.replace("?", r"\?").replace(".", r"\.")):
        Mesh.parse(text)


def test_linear_index_seed_003():
    # mesh.process_linear_index: on (10, 20, 30), device (1, 2, 3) is 3 + 30*2 + 20*30*1.
    mesh = Mesh((10, 20, 30))
    assert mesh.linear_index((1, 2, 3)) == 3 + 30 * 2 + 20 * 30 * 1 == 663
    assert mesh.multi_index(663) == (1, 2, 3)


def test_linear_index_is_row_major_bijection():
    mesh = Mesh((2, 3, 4))
    devices = list(mesh.devices())
    assert [mesh.linear_index(d) for d in devices] == list(range(24))
    assert [mesh.multi_index(i) for i in range(24)] == devices
    with pytest.raises(MeshError, match="device 24 is not on mesh 2x3x4; it has devices 0..23"):
        mesh.multi_index(24)


def test_device_groups_seed_003():
    # Mesh 2x3x4x5, mesh_axes [0, 1]: groups {(i, j, k, m) | i<2, j<3} indexed by (k, m).
    mesh = Mesh((2, 3, 4, 5))
    groups = mesh.device_groups([0, 1])
    assert len(groups) == 4 * 5
    assert all(len(g) == 6 for g in groups)
    group_of = {d: mesh.group_index(d, [0, 1]) for g in groups for d in g}
    assert group_of[(1, 0, 2, 3)] == group_of[(1, 1, 2, 3)] == (2, 3)
    assert group_of[(1, 0, 2, 4)] == (2, 4)
    # Groups are listed by their index on the other axes, row-major.
    assert [mesh.group_index(g[0], [0, 1]) for g in groups] == [
        (k, m) for k in range(4) for m in range(5)
    ]
    assert groups[0] == tuple((i, j, 0, 0) for i in range(2) for j in range(3))


def test_device_group_order_seed_003():
    # Axis list [3, 1]: device (i, 1, k, 0) precedes (i, 0, k, 1) and (i, 2, k, 0).
    mesh = Mesh((2, 3, 4, 5))
    i, k = 1, 2
    group = next(g for g in mesh.device_groups([3, 1]) if (i, 1, k, 0) in g)
    position = group.index
    assert position((i, 1, k, 0)) < position((i, 0, k, 1))
    assert position((i, 1, k, 0)) < position((i, 2, k, 0))
    # The order is (axis 3, axis 1) lexicographic: outer axis listed first.
    assert group[:4] == ((i, 0, k, 0), (i, 1, k, 0), (i, 2, k, 0), (i, 0, k, 1))
    assert [mesh.in_group_index(d, [3, 1]) for d in group] == list(range(15))


def test_device_group_errors():
    mesh = Mesh((2, 2))
    with pytest.raises(MeshError, match=r"unknown mesh axis 3 in \[3\]; mesh @mesh0 has axes 0..1"):
        mesh.device_groups([3])
    with pytest.raises(MeshError, match=r"repeat"):
        mesh.device_groups([0, 0])


def test_named_axes():
    mesh = Mesh.parse("dp=2,tp=4")
    assert mesh.axis("tp") == 1 and mesh.axis("0") == 0
    with pytest.raises(
        MeshError, match=r"unknown mesh axis 'pp'; mesh dp=2,tp=4 has axes 0..1 \(dp, tp\)"
    ):
        mesh.axis("pp")
