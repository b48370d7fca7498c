"""The CI cost-regression report: exact Markdown for a constructed baseline/current pair with
one regression, one improvement, one new and one removed plan; exit codes; JSON; errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from autoshard.cli.main import main
from autoshard.document.plan_document import SCHEMA
from autoshard.explain.report import (
    ReportError,
    compare,
    comparison_markdown,
    format_seconds,
    load_entries,
    parse_threshold,
)


def plan(
    file: str, mesh: str, dims: dict[str, int], memory: int, comm_bytes: int, comm_s: float,
    compute_s: float, solve_s: float,
) -> dict[str, Any]:  # fmt: skip
    """The parts of a plan document (`autoshard plan --json`) that the report reads."""
    return {
        "schema": SCHEMA,  # what `autoshard plan` writes, so the two schemas cannot drift
        "model": {"name": "main_graph", "file": file, "sha256": "0" * 64, "dims": dims},
        "mesh": mesh,
        "cost": {"objective": comm_s + compute_s, "comm_bytes_per_device": comm_bytes,
                 "comm_time_s": comm_s, "compute_time_s": compute_s,
                 "memory_bytes_per_device": memory, "comm_by_mesh_axes": {}},
        "solver": {"status": "OPTIMAL"},
        "timing": {"build_s": 0.0, "solve_s": solve_s},
    }  # fmt: skip


GPT2 = ("gpt2.onnx", "4x8", {"batch": 8, "seq": 128})
MLP = ("mlp.onnx", "2x2", {"batch": 8})
BASELINE = {
    # memory +10%: a regression; solve time +80%: reported, never gated
    "gpt2-4x8": plan(*GPT2, 1_000_000, 1024, 2e-6, 1e-3, 0.5),
    # memory -43.6%: an improvement; compute +1%: within the 2% threshold
    "mlp-2x2": plan(*MLP, 73344, 2048, 5e-6, 2e-9, 0.01),
    "cnn-2x2": plan("cnn.onnx", "2x2", {"batch": 8}, 84200, 0, 0.0, 1.6e-8, 0.002),  # removed
}
CURRENT = {
    "gpt2-4x8": plan(*GPT2, 1_100_000, 1024, 2e-6, 1e-3, 0.9),
    "mlp-2x2": plan(*MLP, 41344, 2048, 5e-6, 2.02e-9, 0.01),
    "bert-2x4": plan("bert.onnx", "2x4", {"batch": 8, "seq": 128}, 1122193, 0, 0.0, 5.1e-7, 1.6),
}

EXPECTED = """\
## autoshard cost report

**1 regression** beyond 2% in 1 of 2 compared plans; 1 improvement, 1 new, 1 removed.

### Regressions

| model | mesh | metric | baseline | current | change |
| --- | --- | --- | ---: | ---: | ---: |
| gpt2.onnx batch=8 seq=128 | 4x8 | memory per device | 976.56 KiB | 1.05 MiB | +97.66 KiB (+10.0%) |

### Improvements

| model | mesh | metric | baseline | current | change |
| --- | --- | --- | ---: | ---: | ---: |
| mlp.onnx batch=8 | 2x2 | memory per device | 71.62 KiB | 40.38 KiB | -31.25 KiB (-43.6%) |

### New

| model | mesh | memory per device | comm bytes per device | comm time | compute time | objective | step time | solve time |
| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
| bert.onnx batch=8 seq=128 | 2x4 | 1.07 MiB | 0 B | 0 s | 510 ns | 510 ns | 510 ns | 1.6 s |

### Removed

| model | mesh | memory per device | comm bytes per device | comm time | compute time | objective | step time | solve time |
| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
| cnn.onnx batch=8 | 2x2 | 82.23 KiB | 0 B | 0 s | 16 ns | 16 ns | 16 ns | 2 ms |

### All compared plans (current, change from baseline)

| model | mesh | memory per device | comm bytes per device | comm time | compute time | objective | step time | solve time |
| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
| gpt2.onnx batch=8 seq=128 | 4x8 | **1.05 MiB (+10.0%)** | 1.00 KiB | 2 µs | 1 ms | 1 ms | 1 ms | 900 ms (+80.0%) |
| mlp.onnx batch=8 | 2x2 | 40.38 KiB (-43.6%) | 2.00 KiB | 5 µs | 2.02 ns (+1.0%) | 5 µs (+0.0%) | 5 µs (+0.0%) | 10 ms |

### What changed in the regressed plans

- gpt2.onnx batch=8 seq=128 on 4x8: `autoshard diff {root}/baseline/gpt2-4x8.json {root}/current/gpt2-4x8.json`

Solve time is reported but never fails the check: it depends on the machine.
"""


def write(folder: Path, documents: dict[str, dict[str, Any]]) -> Path:
    folder.mkdir()
    for name, document in documents.items():
        (folder / f"{name}.json").write_text(json.dumps(document, indent=2))
    return folder


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    return write(tmp_path / "baseline", BASELINE), write(tmp_path / "current", CURRENT)


def test_markdown(pair: tuple[Path, Path]) -> None:
    baseline, current = map(load_entries, pair)
    root = pair[0].parent
    assert comparison_markdown(compare(baseline, current, 0.02)) == EXPECTED.format(root=root)


def test_cli_fails_on_a_regression_and_writes_markdown(pair, tmp_path, capsys) -> None:
    out = tmp_path / "report.md"
    code = main(["report", "--baseline", str(pair[0]), "--current", str(pair[1]),
                 "--markdown", str(out)])  # fmt: skip
    assert code == 1
    expected = EXPECTED.format(root=pair[0].parent)
    assert capsys.readouterr().out == expected
    assert out.read_text() == expected


def test_cli_threshold_above_the_change_passes(pair, capsys) -> None:
    code = main(["report", "--baseline", str(pair[0]), "--current", str(pair[1]),
                 "--threshold", "15%"])  # fmt: skip
    assert code == 0
    assert capsys.readouterr().out.splitlines()[2] == (
        "No regression beyond 15% in 2 compared plans; 1 improvement, 1 new, 1 removed."
    )


def test_cli_json(pair, capsys) -> None:
    code = main(["report", "--baseline", str(pair[0]), "--current", str(pair[1]), "--json"])
    assert code == 1
    data = json.loads(capsys.readouterr().out)
    assert data["threshold"] == 0.02 and data["regressed"] is True
    gpt2 = data["compared"][0]
    assert (gpt2["model"], gpt2["mesh"]) == ("gpt2.onnx batch=8 seq=128", "4x8")
    assert gpt2["metrics"]["memory"] == {"baseline": 1e6, "current": 1.1e6, "delta": 1e5,
                                         "relative": 0.1, "verdict": "regression"}  # fmt: skip
    assert gpt2["metrics"]["solve_time"]["verdict"] == "ungated"
    assert [e["model"] for e in data["new"]] == ["bert.onnx batch=8 seq=128"]
    assert [e["model"] for e in data["removed"]] == ["cnn.onnx batch=8"]


def test_a_plan_compared_with_itself_passes(pair, capsys) -> None:
    code = main(["report", "--baseline", str(pair[1]), "--current", str(pair[1])])
    assert code == 0
    out = capsys.readouterr().out
    assert "No regression beyond 2% in 3 compared plans; 0 improvements, 0 new, 0 removed." in out


def test_from_zero_is_a_regression(tmp_path: Path) -> None:
    before = write(tmp_path / "a", {"m": plan(*MLP, 100, 0, 0.0, 1e-9, 0.1)})
    after = write(tmp_path / "b", {"m": plan(*MLP, 100, 64, 1e-6, 1e-9, 0.1)})
    text = comparison_markdown(compare(load_entries(before), load_entries(after), 0.02))
    assert (
        "| mlp.onnx batch=8 | 2x2 | comm bytes per device | 0 B | 64 B | +64 B (from 0) |" in text
    )


@pytest.mark.parametrize(
    ("text", "value"), [("2%", 0.02), ("2", 0.02), ("0.5%", 0.005), (" 10 % ", 0.1)]
)
def test_threshold(text: str, value: float) -> None:
    assert parse_threshold(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["two", "-1%", "nan"])
def test_bad_threshold(text: str) -> None:
    with pytest.raises(ReportError, match="threshold"):
        parse_threshold(text)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0, "0 s"), (1.5, "1.5 s"), (0.00128, "1.28 ms"), (6.15e-10, "0.615 ns"), (-2e-6, "-2 µs")],
)
def test_format_seconds(seconds: float, text: str) -> None:
    assert format_seconds(seconds) == text


def test_errors_are_one_line(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    other = tmp_path / "other.json"
    other.write_text('{"schema": "something/1"}')
    duplicate = write(
        tmp_path / "dup", {"a": plan(*MLP, 1, 0, 0, 0, 0), "b": plan(*MLP, 2, 0, 0, 0, 0)}
    )
    cases = {
        str(tmp_path / "missing"): f"{tmp_path / 'missing'}: no such file or directory",
        str(empty): f"no plan JSON files (*.json) in directory {empty}",
        str(other): f"{other} is not an autoshard plan (schema autoshard.plan/1)",
        str(duplicate): f"{duplicate / 'b.json'} and {duplicate / 'a.json'} are both plans of "
        "mlp.onnx batch=8 on mesh 2x2; keep one per (model, mesh)",
    }
    for path, message in cases.items():
        assert main(["report", "--baseline", path, "--current", path]) == 2
        assert capsys.readouterr().err == f"autoshard: error: {message}\n"


def test_a_training_plan_is_compared_with_the_training_plan(tmp_path: Path) -> None:
    """The training step of a model is another plan than its forward pass, on the same mesh."""
    forward = plan(*MLP, 100, 0, 0.0, 1e-9, 0.1)
    step = plan(*MLP, 300, 64, 1e-6, 3e-9, 0.1) | {"mode": "training"}
    entries = load_entries(write(tmp_path / "a", {"f": forward, "t": step}))
    assert sorted(entries) == [("mlp.onnx batch=8", "2x2"), ("mlp.onnx batch=8 (training)", "2x2")]


def test_step_time_is_the_schedules_where_a_plan_has_one(tmp_path: Path) -> None:
    """A training plan's step time is its schedule's critical path (`cost.step_time_s`); a
    baseline from before the schedule reads its objective as its step time."""
    before = plan(*MLP, 1000, 0, 4e-6, 6e-6, 0.01)
    after = dict(before, cost=dict(before["cost"], step_time_s=8e-6))
    found = compare(load_entries(write(tmp_path / "b", {"mlp": before})),
                    load_entries(write(tmp_path / "c", {"mlp": after})), 0.02)  # fmt: skip
    changes = {c.metric: c for c in found.compared[0][2]}
    assert changes["step_time"].baseline == before["cost"]["objective"]
    assert changes["step_time"].current == 8e-6
    assert changes["step_time"].verdict == "improvement"
    assert changes["objective"].verdict == "same"
