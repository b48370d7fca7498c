"""Layouts of docs/design/resharding.md's examples: which elements each device holds.

Each case lists, for every device in linear-index order, the element labels of its block
(row then column, 1-based; rows separated by '/'). The index maps of docs/design/resharding.md
are the specification.
"""

import json
import subprocess
import sys

import pytest

from autoshard.explain.layout import device_shards, draw_layout, layout_json
from autoshard.mesh import Mesh
from autoshard.sharding import Sharding


def labels(shard):
    if 0 in shard.shape:
        return "empty"
    (r0, r1), (c0, c1) = shard.slices
    return "/".join(" ".join(f"{r + 1}{c + 1}" for c in range(c0, c1)) for r in range(r0, r1))


CASES = {
    # By the maps, dim 0 (2 rows) splits into 6 shards of ceil(2/6) = 1 row; device (m, n) holds
    # shard 3m + n.
    "2x3-[[0,1]]": (
        "2x3",
        (2, 3),
        "[[0, 1]]",
        ["11 12 13", "21 22 23", "empty", "empty", "empty", "empty"],
    ),
    # [[1, 0]]: device (m, n) holds shard 2n + m.
    "2x3-[[1,0]]": (
        "2x3",
        (2, 3),
        "[[1, 0]]",
        ["11 12 13", "empty", "empty", "21 22 23", "empty", "empty"],
    ),
    # [[1]] splits the 2 rows into 3 shards of 1 row over axis 1.
    "2x3-[[1]]": ("2x3", (2, 3), "[[1]]", ["11 12 13", "21 22 23", "empty"] * 2),
    # Each device holds one whole column.
    "4x6-[[],[0,1]]": (
        "2x3",
        (4, 6),
        "[[], [0, 1]]",
        [f"1{c}/2{c}/3{c}/4{c}" for c in range(1, 7)],
    ),
    "4x6-[[],[0]]": (
        "2x3",
        (4, 6),
        "[[], [0]]",
        ["11 12 13/21 22 23/31 32 33/41 42 43"] * 3 + ["14 15 16/24 25 26/34 35 36/44 45 46"] * 3,
    ),
    "4x8-[[0],[1,2]]": (
        "2x2x2",
        (4, 8),
        "[[0], [1, 2]]",
        [
            "11 12/21 22",
            "13 14/23 24",
            "15 16/25 26",
            "17 18/27 28",
            "31 32/41 42",
            "33 34/43 44",
            "35 36/45 46",
            "37 38/47 48",
        ],
    ),
    "4x8-[[0],[2]]": (
        "2x2x2",
        (4, 8),
        "[[0], [2]]",
        ["11 12 13 14/21 22 23 24", "15 16 17 18/25 26 27 28"] * 2
        + ["31 32 33 34/41 42 43 44", "35 36 37 38/45 46 47 48"] * 2,
    ),
    "6x6-2x3-[[0],[1]]": (
        "2x3",
        (6, 6),
        "[[0], [1]]",
        [
            "11 12/21 22/31 32",
            "13 14/23 24/33 34",
            "15 16/25 26/35 36",
            "41 42/51 52/61 62",
            "43 44/53 54/63 64",
            "45 46/55 56/65 66",
        ],
    ),
    "6x6-2x3-[[1],[0]]": (
        "2x3",
        (6, 6),
        "[[1], [0]]",
        [
            "11 12 13/21 22 23",
            "31 32 33/41 42 43",
            "51 52 53/61 62 63",
            "14 15 16/24 25 26",
            "34 35 36/44 45 46",
            "54 55 56/64 65 66",
        ],
    ),
    # Device (0, 4) holds 25.
    "6x6-2x6-[[0],[1]]": (
        "2x6",
        (6, 6),
        "[[0], [1]]",
        [f"1{c}/2{c}/3{c}" for c in range(1, 7)] + [f"4{c}/5{c}/6{c}" for c in range(1, 7)],
    ),
    "6x6-2x6-[[1],[0]]": (
        "2x6",
        (6, 6),
        "[[1], [0]]",
        [f"{r}1 {r}2 {r}3" for r in range(1, 7)] + [f"{r}4 {r}5 {r}6" for r in range(1, 7)],
    ),
    "6x6-3-[[0],[]]": (
        "3",
        (6, 6),
        "[[0], []]",
        [
            "11 12 13 14 15 16/21 22 23 24 25 26",
            "31 32 33 34 35 36/41 42 43 44 45 46",
            "51 52 53 54 55 56/61 62 63 64 65 66",
        ],
    ),
    "6x6-3-[[],[0]]": (
        "3",
        (6, 6),
        "[[], [0]]",
        ["/".join(f"{r}{c} {r}{c + 1}" for r in range(1, 7)) for c in (1, 3, 5)],
    ),
    "4x4-[[0],[1,2]]": (
        "2x2x2",
        (4, 4),
        "[[0], [1, 2]]",
        ["11/21", "12/22", "13/23", "14/24", "31/41", "32/42", "33/43", "34/44"],
    ),
    # Device (0, 0, 1) holds 13 14.
    "4x4-[[0,1],[2]]": (
        "2x2x2",
        (4, 4),
        "[[0, 1], [2]]",
        ["11 12", "13 14", "21 22", "23 24", "31 32", "33 34", "41 42", "43 44"],
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_seed_002_layouts(case):
    mesh, shape, sharding, expected = CASES[case]
    shards = device_shards(Mesh.parse(mesh), shape, Sharding.parse(sharding))
    assert [labels(s) for s in shards] == expected


def test_drawing_4x6():
    drawing = draw_layout(Mesh.parse("2x3"), (4, 6), Sharding.parse("[[], [0]]"))
    assert drawing.splitlines()[3:9] == [
        "+----------+----------+----------+",
        "| 11 12 13 | 11 12 13 | 11 12 13 |",
        "| 21 22 23 | 21 22 23 | 21 22 23 |",
        "| 31 32 33 | 31 32 33 | 31 32 33 |",
        "| 41 42 43 | 41 42 43 | 41 42 43 |",
        "+----------+----------+----------+",
    ]
    assert "device (1, 2) #5: [0:4, 3:6] local 4x3" in drawing


def test_drawing_large_tensor_shows_bounds():
    drawing = draw_layout(Mesh.parse("2"), (1000, 64), Sharding.parse("[[0]] partial = sum[]"))
    assert "| [0:500, 0:64] | [500:1000, 0:64] |" in drawing


def test_layout_json():
    data = layout_json(Mesh.parse("2x3"), (4, 6), Sharding.parse("[[], [0, 1]] partial = max[]"))
    assert data["sharding"] == "[[], [0, 1]]"
    assert data["devices"][4] == {
        "index": [1, 1],
        "linear": 4,
        "slices": [[0, 4], [4, 5]],
        "partial": False,
    }
    data = layout_json(Mesh.parse("2x2"), (4,), Sharding.parse("[[0]] partial = sum[1]"))
    assert [d["partial"] for d in data["devices"]] == [True] * 4
    assert [d["slices"] for d in data["devices"]] == [[[0, 2]], [[0, 2]], [[2, 4]], [[2, 4]]]


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "autoshard", *args], capture_output=True, text=True, timeout=60
    )


def test_cli_layout_json():
    result = run(
        "layout", "--mesh", "2x3", "--shape", "4x6", "--sharding", "[[], [0, 1]]", "--json"
    )
    assert result.returncode == 0, result.stderr
    devices = json.loads(result.stdout)["devices"]
    assert [d["slices"][1] for d in devices] == [[i, i + 1] for i in range(6)]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mesh", "2x?", "--shape", "4x6", "--sharding", "[[0]]"], "axis 1 has dynamic size '?'"),
        (
            ["--mesh", "2x3", "--shape", "4x6", "--sharding", "[[3]]"],
            "unknown mesh axis 3 in [[3]]; mesh @mesh0 has axes 0..1",
        ),
        (
            ["--mesh", "2x3", "--shape", "4x6", "--sharding", "[[0], [], [1]]"],
            "has 3 dims but the tensor 4x6 has rank 2",
        ),
        (["--mesh", "2x3", "--shape", "4xz", "--sharding", "[[0]]"], "shape '4xz' is not like 4x6"),
        (["--mesh", "2x3", "--shape", "4x6"], "the following arguments are required: --sharding"),
    ],
)
def test_cli_layout_errors(args, message):
    result = run("layout", *args)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr
