"""A weight tied across pipeline stages (gpt2_dynamo's token table, also its LM head) as the
report, `autoshard explain` and `autoshard diff` show it, beside the stages they show; a
pipeline without one (gpt2.onnx: its head is its own weight) shows nothing new."""

import json
from pathlib import Path

import pytest

from autoshard.cli.main import main
from autoshard.explain.diff import pipeline_words, tied_words
from autoshard.html.stages import tied_table
from autoshard.mesh import Mesh
from autoshard.sharding import Sharding
from autoshard.units import format_bytes, format_seconds

MODELS = Path(__file__).resolve().parents[2] / "models"
TIED = "lm.lm_head.weight"
FLAGS = ["--mode", "training", "--dim", "batch=2", "--dim", "seq=16", "--micro-batches", "2",
         "--optimizer", "sgd", "-q"]  # fmt: skip


def _plan(out: Path, model: str, mesh: str, html: bool = True) -> dict:
    argv = ["plan", str(MODELS / model), "--mesh", mesh, *FLAGS, "-o", str(out)]
    assert main(argv + (["--html", str(out.with_suffix(".html"))] if html else [])) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """gpt2_dynamo on pp=2,tp=2 (tied), gpt2 on pp=2,tp=2 (untied) and gpt2_dynamo on 2x2 (no
    pipeline), planned once for the module: (directory, the three documents)."""
    at = tmp_path_factory.mktemp("tied")
    tied = _plan(at / "tied.json", "gpt2_dynamo.onnx", "pp=2,tp=2")
    untied = _plan(at / "untied.json", "gpt2.onnx", "pp=2,tp=2")
    flat = _plan(at / "flat.json", "gpt2_dynamo.onnx", "2x2", html=False)
    return at, tied, untied, flat


def _gradient_bytes(document: dict) -> int:
    """The tied weight's gradient as a device of a stage holds it: [512, 64] bfloat16, split
    as the stage's plan holds it."""
    held = Sharding.parse(document["values"][f"{TIED}@grad"]["sharding"])
    mesh = Mesh.parse(document["mesh"])
    rows, cols = held.local_shape(mesh, (512, 64), next(iter(mesh.devices())))
    return rows * cols * 2


def test_the_words_name_the_weight_its_stages_and_its_sum():
    trained = {"weight": "w", "stages": [0, 3], "copy_bytes_per_device": 3072,
               "sync": {"bytes_per_device": 1024, "time_s": 2.5e-6}}  # fmt: skip
    assert tied_words(trained) == (
        "tied w on stages 0 and 3, its gradients summed (1.00 KiB per device, 2.5 µs)"
    )
    inference = trained | {"sync": {"bytes_per_device": 0, "time_s": 0.0}}
    assert tied_words(inference) == "tied w on stages 0 and 3"
    assert tied_table({"stages": []}) == ""


def test_the_report_shows_the_tied_weight_beside_the_stages(plans):
    at, tied, untied, _ = plans
    (entry,) = tied["pipeline"]["tied"]
    sync = entry["sync"]
    assert entry["weight"] == TIED and sync["bytes_per_device"] == _gradient_bytes(tied)
    page = (at / "tied.html").read_text()
    table = (
        '<table class="tied"><tr><th>tied weight</th><th>copy on stages</th>'
        "<th>copy per device</th><th>gradient sum per device</th><th>gradient sum</th></tr>"
        f"<tr><td>{TIED}</td><td>0 and 1</td>"
        f"<td>{format_bytes(entry['copy_bytes_per_device'])}</td>"
        f"<td>{format_bytes(_gradient_bytes(tied))}</td>"
        f"<td>{sync['time_s'] * 1e3:.3f} ms</td></tr></table>"
    )
    stages = page[page.index('<section id="stages">') :]
    stages = stages[: stages.index("</section>")]
    assert stages.endswith(table)  # after the table of stages, in their section
    assert page.count('class="tied"') == 1
    # A pipeline with no tied weight: its section is as before, no table, no word of it.
    other = (at / "untied.html").read_text()
    assert "tied" not in untied["pipeline"]
    assert 'class="tied"' not in other and "tied" not in other.split('<section id="stages">')[1]


def test_explain_and_diff_name_the_tied_weight(plans, capsys):
    at, tied, untied, _ = plans
    (entry,) = tied["pipeline"]["tied"]
    said = (f"; tied {TIED} on stages 0 and 1, its gradients summed "
            f"({format_bytes(_gradient_bytes(tied))} per device, "
            f"{format_seconds(entry['sync']['time_s'])})")  # fmt: skip
    words = pipeline_words(tied["pipeline"])
    assert words.endswith(said) and words.count("tied") == 1
    capsys.readouterr()
    argv = ["explain", str(at / "tied.json"), TIED, "--model", str(MODELS / "gpt2_dynamo.onnx")]
    assert main(argv) == 0
    assert f"  pipeline: {words}; the plan above is each stage's" in capsys.readouterr().out
    # diff: the plan without a pipeline against the tied one names the weight on B's side.
    assert main(["diff", str(at / "flat.json"), str(at / "tied.json")]) == 0
    assert f"pipeline A: none\npipeline B: {words}\n" in capsys.readouterr().out
    assert main(["diff", str(at / "untied.json"), str(at / "tied.json")]) == 0
    out = capsys.readouterr().out
    assert f"pipeline B: {words}\n" in out
    (line,) = [x for x in out.splitlines() if x.startswith("pipeline A: ")]
    assert "tied" not in line and line == f"pipeline A: {pipeline_words(untied['pipeline'])}"
