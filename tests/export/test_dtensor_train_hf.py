"""The DTensor export of Hugging Face models trains: GPT-2 and Llama built from tiny configs
(tests/export/test_hf_models.py: seeded, nothing downloaded), exported to ONNX by the TorchScript
exporter and planned for training under each standard recipe (DDP, ZeRO-2, FSDP, Megatron TP x
DP: `train_cases.plan_hf`) and by the search alone, on 2x2, and on 2x2x2 Megatron, GPT-2's
ZeRO-2 and Llama's FSDP (at batch 8: split over all 8 devices). The `apply_plan` of each
export, on the original module, trains 3 steps (SGD; Adam for Llama's searched plan) on gloo
(4 ranks, or 8) equal to the single-process steps (rel 1e-5: the loss, every gradient and
weight after steps 1 and 3, each step from the ranks' state after the one before), and the
bytes counted per phase and kind are the export's estimate on every rank, CommDebugMode's calls
ours. Where each plan lands in torch: ZeRO's states split over both axes and FSDP's weights
(one dim over dp and tp) held by `_hold_as`; GPT-2's Conv1D modules under the swapped column
and row styles; its tied LM head and token table one tensor (the head's input gradient partial
over tp, all-reduced in the final norm's backward); the searched plan's column-split MLP output
added to the residual stream, which DTensor keeps split until each layer norm gathers it;
Llama's searched plan's attention styled over dp and its MLP over tp (2-D tensor parallel, the
attention's output gathered over dp for its output projection, which holds no split)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.export.gloo import run_on_ranks
from tests.export.traffic import mismatches
from tests.export.train_cases import HF_SCALE, STEPS, batch_of, export_case, plan_hf, train_worker

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SQUARE, CUBE = "dp=2,tp=2", "dp=2,dq=2,tp=2"
# case -> (model, recipe, mesh, optimizer, the search's memory budget): SGD for the recipes;
# each search's budget is below the model's replicated footprint, so it splits weights.
CASES = {
    **{f"{m}-{r}": (m, r, SQUARE, "sgd", "") for m in ("gpt2", "llama")
       for r in ("dp", "zero", "fsdp", "tp-dp")},
    "gpt2-searched": ("gpt2", "searched", SQUARE, "sgd", "1.5MB"),
    "llama-searched": ("llama", "searched", SQUARE, "adam", "1.2MB"),
    "gpt2-tp-dp-2x2x2": ("gpt2", "tp-dp", CUBE, "sgd", ""),
    "llama-tp-dp-2x2x2": ("llama", "tp-dp", CUBE, "sgd", ""),
    # batch 8: the batch split over all 8 devices
    "gpt2-zero-2x2x2": ("gpt2@8", "zero", CUBE, "sgd", ""),
    "llama-fsdp-2x2x2": ("llama@8", "fsdp", CUBE, "sgd", ""),
}  # fmt: skip
# What each recipe must come to in torch: a style every parameter has (a str), or one some has.
EVERY = {"dp": {"replicate"}, "zero": {"replicate", "replicate+zero"},
         "fsdp": {"replicate", "replicate+fsdp"}}  # fmt: skip
SOME = {"zero": "+zero", "fsdp": "+fsdp", "tp-dp": "rowwise", "searched": "colwise"}
# The Llama's searched plan reads the attention's heads split over dp and the MLP's hidden over
# tp (the batch whole): each module's style over its own mesh dim.
TWO_DIMS = {"llama-searched": {"dp", "tp"}}
PARAMS = list(CASES)


def _ranks(case: str) -> int:
    return 2 ** CASES[case][2].count("=")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    from tests.export.test_hf_models import BATCH, build, export

    folder = tmp_path_factory.mktemp("hf-train")
    for name in sorted({v[0] for v in CASES.values()}):
        model, batch = batch_of(name)
        (folder / f"{name}.onnx").write_bytes(export(build(model), "ts", batch or BATCH))
    for case, (name, recipe, mesh, *_) in CASES.items():
        path = folder / case
        path.mkdir()
        plan_hf(path, folder / f"{name}.onnx", mesh, recipe, *CASES[case][3:])
        export_case(path, folder / f"{name}.onnx")
    for ranks in (4, 8):
        cases = {c: (v[0], v[3], HF_SCALE) for c, v in CASES.items() if _ranks(c) == ranks}
        run_on_ranks(train_worker, ranks, str(folder), cases)
    return folder


@pytest.mark.parametrize("case", PARAMS)
def test_the_hf_export_trains_as_one_process(trained, case):
    export = json.loads((trained / case / "export.json").read_text())
    assert export["parallelize"]["fallback"] is None
    styles = {e["style"] for e in export["parameters"].values()}
    recipe = CASES[case][1]
    assert styles <= EVERY.get(recipe, styles), styles
    assert any(SOME.get(recipe, "") in style for style in styles), styles
    modules = export["parallelize"]["modules"].values()
    axes = {m.get("axis", export["parallelize"]["tp"]) for m in modules if m["style"] == "colwise"}
    assert axes == TWO_DIMS.get(case, axes), axes
    for rank in range(_ranks(case)):
        result = torch.load(trained / case / f"rank{rank}.pt")
        bad = {k: e for k, e in result["errors"].items() if e > 1e-5}
        assert not bad, (case, rank, bad)


@pytest.mark.parametrize("case", PARAMS)
def test_the_hf_exports_counted_bytes_are_its_estimate(trained, case):
    estimate = json.loads((trained / case / "export.json").read_text())["traffic"]
    assert not estimate["unmodeled"]
    for rank in range(_ranks(case)):
        result = torch.load(trained / case / f"rank{rank}.pt")
        assert not mismatches(estimate["bytes_per_device"], result["bytes"], STEPS), (case, rank)
        assert result["calls"] == result["debug"], (case, rank)
