"""The DTensor export of training plans trained on gloo: predicted against counted bytes.

    python bench/export_dtensor_train.py                  # the MLP plans, Llama and GPT-2
    python bench/export_dtensor_train.py --cases mlp-dp llama-tp-dp

For each model and plan (the cases of tests/export/test_dtensor_train.py and
test_dtensor_train_hf.py), `autoshard export --to dtensor`, then on one start of gloo ranks
(one per device) the generated `apply_plan` applied to the torch module trains 3 steps (the
batch split as the plan's, `sync_gradients`, FSDP2), every collective counted per phase and kind
(tests/export/traffic.py, CommDebugMode beside it). One row per phase and collective kind: the
plan's own communication for the phase (its program's collectives, `cost.phases`), the
export's estimate (`traffic` of the export document, torch's collectives priced by the same
ring formula), what torch moved (bytes per device per step, on rank 0), and the largest
relative error of the loss, gradients and weights against the single-process steps. Needs
torch and transformers.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _prepare(case: str, folder: Path) -> tuple[str, str, float]:
    """Plan and export one case into `folder`: (model name, optimizer, learning-rate scale)."""
    import shutil

    from tests.export import test_dtensor_train as mlp
    from tests.export import test_dtensor_train_hf as hf
    from tests.export.train_cases import HF_SCALE, export_case, plan_hf, plan_mlp

    folder.mkdir(parents=True)
    if case.startswith("mlp-"):
        mesh, optimizer, flags, written = mlp.CASES[case.removeprefix("mlp-")]
        shutil.copy(mlp.MODELS / "mlp.onnx", folder / "model.onnx")
        plan_mlp(folder, folder / "model.onnx", mesh, mlp.BATCH, optimizer, flags, written)
        return "mlp", optimizer, 1.0
    from tests.export.test_hf_models import BATCH, build, export
    from tests.export.train_cases import batch_of

    name, recipe, mesh, optimizer, budget = hf.CASES[case]
    model, batch = batch_of(name)
    (folder / "model.onnx").write_bytes(export(build(model), "ts", batch or BATCH))
    plan_hf(folder, folder / "model.onnx", mesh, recipe, optimizer, budget)
    export_case(folder, folder / "model.onnx")
    return name, optimizer, HF_SCALE


def main() -> int:
    from tests.export import test_dtensor_train as mlp
    from tests.export import test_dtensor_train_hf as hf

    every = [f"mlp-{c}" for c in mlp.CASES] + list(hf.CASES)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=every, choices=every)
    args = parser.parse_args()

    from tests.export.gloo import run_on_ranks
    from tests.export.train_cases import STEPS, train_worker

    print("| model, plan | mesh | phase | kind | plan's phase | export estimate | counted | "
          "rel err |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        prepared: dict[int, dict[str, tuple[str, str, float]]] = {}
        for case in args.cases:
            folder = Path(tmp) / case
            with contextlib.redirect_stdout(io.StringIO()):  # the plans' summaries
                spec = _prepare(case, folder)
            shape = json.loads((folder / "export.json").read_text())["mesh"]["shape"]
            prepared.setdefault(len(shape), {})[case] = spec
        for ndim, cases in sorted(prepared.items()):
            run_on_ranks(train_worker, 2**ndim, tmp, cases)
        for case in args.cases:
            _rows(case, Path(tmp) / case, STEPS)
    return 0


def _rows(case: str, folder: Path, steps: int) -> None:
    export = json.loads((folder / "export.json").read_text())
    plan = json.loads((folder / "plan.json").read_text())
    import torch

    result = torch.load(folder / "rank0.pt")
    error = max(result["errors"].values())
    estimate, counted = export["traffic"]["bytes_per_device"], result["bytes"]
    mesh = "x".join(map(str, export["mesh"]["shape"]))
    for phase in ("forward", "backward", "gradient_sync", "optimizer"):
        planned = plan["cost"]["phases"].get(phase, {}).get("comm_bytes_per_device", 0)
        kinds = sorted(set(estimate.get(phase, {})) | set(counted.get(phase, {}))) or ["-"]
        for kind in kinds:
            want = estimate.get(phase, {}).get(kind, 0)
            got = counted.get(phase, {}).get(kind, 0) // steps
            mark = "" if want == got else " (differs)"
            print(f"| {case} | {mesh} | {phase} | {kind} | {planned} | {want} | {got}{mark} | "
                  f"{error:.1e} |")  # fmt: skip
            planned = ""  # once per phase
    if export["traffic"]["unmodeled"]:
        print(f"| {case} | {mesh} | not modeled: {'; '.join(export['traffic']['unmodeled'])} |")


if __name__ == "__main__":
    raise SystemExit(main())
