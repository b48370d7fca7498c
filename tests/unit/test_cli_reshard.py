"""`autoshard reshard`: the planner as a user command (issue 3 item 4)."""

import json

import pytest

from autoshard.cli.main import main


def test_text_output_names_each_collective_with_its_bytes(capsys):
    """The 2x2x2 case of docs/design/resharding.md: 4x4 float32 from [[0], [1, 2]] to [[0, 1], [2]].
    Local shards are 2x1 = 8 B: a permute of whole shards (8 B) then an all_to_all over axis 1 (half
    of 8 B)."""
    assert main(["reshard", "--mesh", "2x2x2", "--shape", "4x4",
                 "--from", "[[0], [1, 2]]", "--to", "[[0, 1], [2]]"]) == 0  # fmt: skip
    assert capsys.readouterr().out.splitlines() == [
        "[[0], [1, 2]] -> [[0, 1], [2]] on mesh 2x2x2: 2 collectives",
        "  permute mesh_axes = [1, 2]  [[0], [1, 2]] -> [[0], [2, 1]]  (8 B)",
        "  all_to_all mesh_axes = [1] split_axis = 0 concat_axis = 1"
        "  [[0], [2, 1]] -> [[0, 1], [2]]  (4 B)",
        "bytes per device: 12",
    ]


def test_json_output(capsys):
    """Partial over axis 1 into a split over [0, 1]: one reduce_scatter; the 4x4 float32 local
    shard [[0]] is 2x4 = 32 B, half of it sent."""
    args = ["reshard", "--mesh", "2x2", "--shape", "4x4", "--json",
            "--from", "[[0]] partial = sum[1]", "--to", "[[0, 1]]"]  # fmt: skip
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == {
        "collectives": [
            {
                "kind": "reduce_scatter",
                "mesh_axes": [1],
                "from": "[[0], []] partial = sum[1]",
                "to": "[[0, 1], []]",
                "bytes_per_device": 16,
                "scatter_axis": 0,
                "reduction": "sum",
            }
        ],
        "bytes_per_device": 16,
    }


@pytest.mark.parametrize(
    "source, target, message",
    [
        ("[[0]]", "[[3]]", "unknown mesh axis 3"),
        ("[[0]]", "[[0]] partial = sum[1]", "cannot become partial over new mesh axes"),
        ("[[0], [0]]", "[[]]", "mesh axis 0"),
    ],
)
def test_bad_shardings_are_one_line_errors(capsys, source, target, message):
    args = ["reshard", "--mesh", "2x2", "--shape", "4x4", "--from", source, "--to", target]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoshard: error: ") and message in err and len(err.splitlines()) == 1
