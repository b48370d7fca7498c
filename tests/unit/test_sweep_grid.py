"""`autoshard sweep`'s pure parts: the grid, the meshes of a device count, the Pareto front
(checked by hand and by brute force), the results file, and bad input (one line, exit 2)."""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path

import pytest

from autoshard.cli.main import main
from autoshard.sweep.front import pareto_front, step_cost
from autoshard.sweep.grid import (
    Point,
    SweepError,
    device_counts,
    expand,
    factorisations,
    meshes,
    point_key,
)
from autoshard.sweep.results import Results, read_results

MLP = str(Path(__file__).parents[2] / "models" / "mlp.onnx")


def test_factorisations_of_8() -> None:
    assert factorisations(8) == [(8,), (4, 2), (2, 4), (2, 2, 2)]
    assert factorisations(8, max_axes=1) == [(8,)]
    assert factorisations(1) == [(1,)]
    assert factorisations(7) == [(7,)]


@pytest.mark.parametrize("devices", [12, 64, 96, 256])
@pytest.mark.parametrize("max_axes", [1, 2, 4])
def test_factorisations_are_every_ordered_product(devices: int, max_axes: int) -> None:
    """Brute force: every tuple of factors >= 2 of at most `max_axes` axes whose product is
    `devices`, each once."""
    divisors = [d for d in range(2, devices + 1) if devices % d == 0]
    expected = {
        shape
        for axes in range(1, max_axes + 1)
        for shape in itertools.product(divisors, repeat=axes)
        if math.prod(shape) == devices
    }
    found = factorisations(devices, max_axes)
    assert len(found) == len(set(found)) and set(found) == expected


def test_256_devices_have_64_meshes_of_at_most_4_axes() -> None:
    # Compositions of 8 (256 = 2^8) into at most 4 parts: 1 + 7 + 21 + 35.
    assert len(factorisations(256)) == 64


def test_device_counts() -> None:
    assert device_counts("32-256") == [32, 64, 128, 256]
    assert device_counts("8, 12,8") == [8, 12]
    assert device_counts("8,32-64") == [8, 32, 64]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("abc", "'abc' is not a count or a range like 32-256"),
        ("0", "'0' is outside 1..65536"),
        ("100000", "'100000' is outside 1..65536"),
        ("64-32", "runs backwards"),
        ("24-96", "a range starts at a power of two, not 24"),
    ],
)
def test_bad_device_counts(text: str, message: str) -> None:
    with pytest.raises(SweepError, match=message):
        device_counts(text)


def test_given_meshes_and_axis_limit() -> None:
    assert meshes([], ["8x8", "4x16", "8x8"], 4) == ["8x8", "4x16"]
    with pytest.raises(SweepError, match="--mesh 2x2x2 has 3 axes; the search takes at most 2"):
        meshes([], ["2x2x2"], 2)
    assert meshes([4], [], 2) == ["4", "2x2"]


def test_expand_varies_the_mesh_fastest_and_keeps_each_point_once() -> None:
    points = expand(["4", "2x2"], [None], [None], ["1GiB", "1GiB"], {"batch": [8, 16]},
                    "inference", {})  # fmt: skip
    assert [str(p) for p in points] == [
        "4 memory=1GiB batch=8", "2x2 memory=1GiB batch=8",
        "4 memory=1GiB batch=16", "2x2 memory=1GiB batch=16",
    ]  # fmt: skip
    with pytest.raises(SweepError, match="the grid is empty"):
        expand([], [None], [None], [None], {}, "inference", {})


def test_point_key_is_stable_and_names_what_is_asked() -> None:
    point = Point(mesh="2x2", dims=(("batch", 8),))
    key = point_key("abc", point, {"objective": "time", "time_limit": 60.0})
    assert key == point_key("abc", Point(mesh="2x2", dims=(("batch", 8),)),
                            {"time_limit": 60.0, "objective": "time"})  # fmt: skip
    assert key != point_key("abd", point, {"objective": "time", "time_limit": 60.0})
    assert key != point_key("abc", point, {"objective": "time", "time_limit": 30.0})
    assert key != point_key("abc", Point(mesh="4", dims=(("batch", 8),)), {"objective": "time"})


def test_pareto_front_by_hand() -> None:
    # (devices, step time): (16, 2.5) is beaten by (16, 2.0); (32, 2.0) by (16, 2.0);
    # (64, 1.0) stands; (8, 3.0) is the fewest devices.
    toy = [(32, 2.0), (8, 3.0), (16, 2.5), (64, 1.0), (16, 2.0), (128, 1.0)]
    assert pareto_front(toy) == [1, 4, 3]
    assert pareto_front([]) == []
    assert pareto_front([(8, 1.0), (8, 1.0)]) == [0]  # of equal points the first


@pytest.mark.parametrize("seed", range(5))
def test_pareto_front_brute_force(seed: int) -> None:
    import random

    rng = random.Random(seed)
    points = [(rng.choice([8, 16, 32, 64]), float(rng.randint(1, 6))) for _ in range(12)]

    def dominated(i: int) -> bool:
        a = points[i]
        return any(
            (b[0] <= a[0] and b[1] <= a[1] and b != a) or (b == a and j < i)
            for j, b in enumerate(points)
        )

    assert sorted(pareto_front(points)) == [i for i in range(len(points)) if not dominated(i)]


def test_step_cost() -> None:
    assert step_cost(64, 1.8, 2.0) == pytest.approx(64 * 1.8 * 2.0 / 3600)


def test_results_skip_a_line_the_kill_cut_and_append_after_it(tmp_path: Path) -> None:
    (tmp_path / "results.jsonl").write_text(json.dumps({"key": "a"}) + '\n{"key": "b", "sta')
    assert set(read_results(tmp_path)) == {"a"}
    results = Results(tmp_path)
    results.add({"key": "b", "status": "ok"})
    results.close()
    assert set(read_results(tmp_path)) == {"a", "b"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--devices", "4", "--mesh", "2x2"], "give --devices or --mesh, not both"),
        (["--devices", "4", "--ray-address", "x:1"], "--ray-address runs on Ray"),
        ([], "the grid is empty: give --devices or --mesh"),
        (["--devices", "0"], "'0' is outside 1..65536"),
        (["--devices", "4", "--max-axes", "5"], "--max-axes 5: choose 1..4"),
        (["--devices", "4", "--cluster", "dgx-h200"], "unknown cluster 'dgx-h200': a preset"),
        (["--devices", "4", "--memory", "lots"], "lots"),
        (["--devices", "4", "--micro-batches", "2"], "--micro-batches plans a training step"),
        (["--devices", "4", "--dim", "batch=a"], "--dim 'batch=a' is not NAME=SIZES"),
        (
            ["--devices", "4", "--schedule", "zigzag"],
            "unknown schedule 'zigzag'; choose one of: gpipe, 1f1b, interleaved[:V], zb-h1",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["sweep", MLP, "-o", str(tmp_path / "out"), "--executor", "local", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_output_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tmp_path.chmod(0o500)
    try:
        code = main(["sweep", MLP, "-o", str(tmp_path / "out"), "--devices", "2",
                     "--dim", "batch=8", "--executor", "local"])  # fmt: skip
    finally:
        tmp_path.chmod(0o700)
    assert code == 2 and "cannot write the sweep's output" in capsys.readouterr().err


def test_output_that_is_a_file_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "out").write_text("")
    code = main(["sweep", MLP, "-o", str(tmp_path / "out"), "--devices", "2",
                 "--dim", "batch=8", "--executor", "local"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "cannot write the sweep's output" in err and len(err.splitlines()) == 1
