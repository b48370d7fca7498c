"""The search's objective beside the program's: where they read differently, the summary and
the last progress line say why (a reshard the search counts more than once)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from autoshard.cli.main import main
from autoshard.cli.summaries import objective_note

MODELS = Path(__file__).resolve().parents[2] / "models"
# At 1 MiB, GPT-2's plan reads one reshard in two groups: the search counts it once.
GPT2_1MIB = [str(MODELS / "gpt2.onnx"), "--mesh", "2x4", "--dim", "batch=8", "--dim", "seq=128",
             "--memory", "1MiB"]  # fmt: skip
MLP = [str(MODELS / "mlp.onnx"), "--mesh", "4x8", "--dim", "batch=8"]


def test_a_reshard_read_by_two_groups_is_counted_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *GPT2_1MIB, "-v"]) == 0
    out, err = capsys.readouterr()
    assert "objective (compute + communication): 0.145 ms" in out
    assert "search objective" not in out + err
    assert "objective 145 µs" in err.splitlines()[-2]


def test_objectives_that_agree_get_no_note(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *MLP, "-v"]) == 0
    out, err = capsys.readouterr()
    assert "search objective" not in out + err


def cost(objective: float, sent: int) -> SimpleNamespace:
    return SimpleNamespace(objective=objective, comm_bytes_per_device=sent)


@pytest.mark.parametrize(
    "searched, program, objective, note",
    [
        (4.2e-3, cost(3.5e-3, 0), "time",
         "search objective 4.2 ms (a reshard counted per reader); the program: 3.5 ms"),
        (3.50004e-3, cost(3.5e-3, 0), "time", None),  # as shown, the same
        (284064.1, cost(1e-3, 255392), "bytes",
         "search objective 277.41 KiB (a reshard counted per reader); the program: 249.41 KiB"),
        (1023.99998, cost(1e-3, 1024), "bytes", None),  # (1024 B, 1.00 KiB: scaling alone)
        (9.999999e-4, cost(1e-3, 0), "time", None),
        (3.4e-3, cost(3.5e-3, 0), "time", "search objective 3.4 ms; the program: 3.5 ms"),
    ],
    ids=["time-over", "time-same", "bytes-over", "bytes-same", "time-scaling", "under-no-reason"],
)  # fmt: skip
def test_objective_note(searched, program, objective, note) -> None:
    assert objective_note(searched, program, objective) == note
