"""The DTensor export of Hugging Face models trains: Llama and GPT-2 built from tiny configs
(tests/export/test_hf_models.py: seeded, nothing downloaded), exported to ONNX by the TorchScript
exporter, planned for training on 2x2 and pinned to a recipe (`explain --why-not`): Llama under
Megatron TP x DP (torch's column and row styles on tp, `sync_gradients` over dp), GPT-2 under
ZeRO-2 (FSDP2 keeping every module gathered from forward to backward, its GPT-2 Conv1D modules
distributed). `apply_plan` on the original module trains 3 SGD steps on one start of 4 gloo
ranks equal to the single-process steps (rel 1e-5, after steps 1 and 3), and the bytes counted
per phase and kind are the export's estimate: GPT-2's tied LM head and token embedding (two
weights of one content in the ONNX file) one tensor, distributed whole, not fully_shard-ed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoshard.cli.main import main
from autoshard.export import Target, export_plan
from tests.export.gloo import run_on_ranks
from tests.export.traffic import mismatches

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CASES = {"llama-tp-dp": ("llama", "tp-dp"), "gpt2-zero": ("gpt2", "zero")}  # (model, recipe)
STEPS, SCALE = 3, 0.01  # SGD at lr 5e-4: the summed logits' gradients are large


def batches():
    from tests.export.test_hf_models import BATCH, SEQ, VOCAB

    generator = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator) for _ in range(STEPS)]


def _worker(rank: int, folder: str) -> None:
    from tests.export.test_hf_models import build
    from tests.export.train_step import distributed, reference, worst

    for case, (name, _) in CASES.items():
        path = Path(folder) / case
        got, traffic, _ = distributed(
            path / "apply.py", lambda n=name: build(n), batches(), "sgd", "input_ids", SCALE
        )
        want = reference(build(name), batches(), "sgd", SCALE)
        torch.save(
            {"errors": worst(got, want), "bytes": traffic.by_kind(), "calls": traffic.calls(),
             "debug": traffic.debug_calls()},
            path / f"rank{rank}.pt",
        )  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    from tests.export.test_hf_models import build, export

    folder = tmp_path_factory.mktemp("hf-train")
    for case, (name, recipe) in CASES.items():
        path = folder / case
        path.mkdir()
        model = path / f"{name}.onnx"
        model.write_bytes(export(build(name), "ts"))
        argv = ["plan", str(model), "--mesh", "dp=2,tp=2", "--mode", "training", "--precision",
                "fp32", "--optimizer", "sgd", "--memory", "1.2MB", "--time-limit", "30", "-q",
                "-o", str(path / "search.json")]  # fmt: skip
        assert main(argv) == 0, case
        pinned = ["explain", str(path / "search.json"), "--model", str(model), "--why-not",
                  recipe, "-o", str(path / "plan.json")]  # fmt: skip
        main(pinned)
        exported = export_plan(path / "plan.json", Target.DTENSOR, str(model))
        (path / "apply.py").write_bytes(exported.payload)
        (path / "export.json").write_text(json.dumps(exported.document))
    run_on_ranks(_worker, 4, str(folder))
    return folder


@pytest.mark.parametrize("case", list(CASES))
def test_the_hf_export_trains_as_one_process(trained, case):
    export = json.loads((trained / case / "export.json").read_text())
    assert export["parallelize"]["fallback"] is None
    styles = {e["style"] for e in export["parameters"].values()}
    if CASES[case][1] == "tp-dp":
        assert {"colwise", "rowwise"} <= styles, styles
    else:
        assert any(style.endswith("+zero") for style in styles), styles
    for rank in range(4):
        result = torch.load(trained / case / f"rank{rank}.pt")
        bad = {k: e for k, e in result["errors"].items() if e > 1e-5}
        assert not bad, (case, rank, bad)
        assert result["calls"] == result["debug"], (case, rank)


@pytest.mark.parametrize("case", list(CASES))
def test_the_hf_exports_counted_bytes_are_its_estimate(trained, case):
    estimate = json.loads((trained / case / "export.json").read_text())["traffic"]
    assert not estimate["unmodeled"]
    for rank in range(4):
        counted = torch.load(trained / case / f"rank{rank}.pt")["bytes"]
        assert not mismatches(estimate["bytes_per_device"], counted, STEPS), (case, rank)
