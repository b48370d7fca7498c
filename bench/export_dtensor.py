"""The DTensor export applied to the torch modules the ONNX models came from, run on gloo.

    python bench/export_dtensor.py                    # gpt2 and llama, both exporters
    python bench/export_dtensor.py --models gpt2 --exporters dynamo --meshes tp=2

For each Hugging Face model of models/make_zoo.py (tiny configs, seeded random weights, nothing
downloaded) and each torch exporter: export to ONNX, `autoshard plan` it on each mesh under a
memory budget that forces the weights to be split (inference), `autoshard export --to dtensor`,
then on a gloo group of one process per device apply the generated `apply_plan` to the
*original torch module*, run a forward pass under `implicit_replication` and compare the
logits with the single-process module's. Columns: parameters split by the plan, weights with
no recovered name, the parallel styles `apply_plan` uses (parameters per style), the largest
relative error, and whether every parameter ends with the
placements the export planned (a tied pair the TorchScript exporter unties keeps the first
one's: `tied`). Needs torch, transformers and onnxscript.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "models"))

BUDGET = {2: "600KB", 4: "300KB"}  # below the replicated weights (~700 KB): the plan splits


def _worker(rank, world, port, module_path, name, feeds, out) -> None:
    import make_zoo
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        spec = importlib.util.spec_from_file_location("apply_plan_module", module_path)
        generated = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(generated)
        mesh = torch.distributed.device_mesh.init_device_mesh(
            "cpu", generated.MESH_SHAPE, mesh_dim_names=generated.MESH_DIM_NAMES
        )
        model = make_zoo.MODELS[name][0](None).model  # seeded: the same weights in every rank
        with torch.no_grad():
            expected = model(*feeds)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                generated.apply_plan(model, mesh)
            with implicit_replication():
                got = model(*feeds)
        got = got.full_tensor() if isinstance(got, DTensor) else got
        error = float((got - expected).abs().max() / expected.abs().max())
        held = generated.held_placements(model, mesh)
        same = all(tuple(held[n]) == tuple(p) for n, p in generated.PLACEMENTS.items())
        tied = sum("is tied to" in str(w.message) for w in caught)
        if rank == 0:
            Path(out).write_text(json.dumps({"error": error, "same": same, "tied": tied}))
    finally:
        dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    parser.add_argument("--exporters", nargs="+", default=["ts", "dynamo"])
    parser.add_argument("--meshes", nargs="+", default=["tp=2", "dp=2,tp=2"])
    args = parser.parse_args()

    import make_zoo
    import torch

    # Ranks fork from a server that imported torch only: a fork of this process, which has
    # run torch ops, can hang in OpenMP.
    torch.multiprocessing.set_forkserver_preload(["torch", "torch.distributed.tensor"])

    from autoshard.cli.main import main as autoshard
    from autoshard.mesh import Mesh

    print("| model | exporter | mesh | split | unnamed | styles | plan s | run s | rel err | "
          "placements |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in args.models:
            for exporter in args.exporters:
                (result,) = [r for r in make_zoo.build_one(name, exporter, folder)][-1:]
                if result.status != "ok":
                    print(f"| {name} | {exporter} | - | export failed: {result.reason} |")
                    continue
                model_path = folder / f"{name}_{exporter}.onnx"
                case = make_zoo.MODELS[name][0](None)
                numpy_feeds = case.make_feeds(4, 16)
                feeds = tuple(torch.from_numpy(numpy_feeds[k]) for k in case.inputs)
                for mesh_text in args.meshes:
                    mesh = Mesh.parse(mesh_text)
                    plan, module = folder / "plan.json", folder / "apply.py"
                    export = folder / "export.json"
                    started = time.perf_counter()
                    with open(os.devnull, "w") as devnull, _stdout(devnull):
                        code = autoshard([
                            "plan", str(model_path), "--mesh", mesh_text, "--dim", "batch=4",
                            "--dim", "seq=16", "--memory", BUDGET[mesh.size], "-o", str(plan),
                        ])  # fmt: skip
                    plan_s = time.perf_counter() - started
                    if code:
                        print(f"| {name} | {exporter} | {mesh_text} | plan failed |")
                        continue
                    with open(os.devnull, "w") as devnull, _stdout(devnull):
                        autoshard(["export", str(plan), "--to", "dtensor", "-o", str(module)])
                    with open(export, "w") as f, _stdout(f):
                        autoshard(["export", str(plan), "--to", "dtensor", "--json"])
                    document = json.loads(export.read_text())
                    split = sum(
                        any(p != "Replicate()" for p in e["placements"])
                        for e in document["parameters"].values()
                    )
                    styles = _styles(document)
                    out = folder / "result.json"
                    started = time.perf_counter()
                    try:
                        torch.multiprocessing.start_processes(
                            _worker, args=(mesh.size, _port(), str(module), name, feeds, str(out)),
                            nprocs=mesh.size, start_method="forkserver",
                        )  # fmt: skip
                    except Exception as error:  # torch's DTensor refused the program: say so
                        print(error, file=sys.stderr)
                        why = str(error).strip().splitlines()[-1]
                        row = f"{styles} | {plan_s:.1f} | - | - | torch failed: {why}"
                        print(f"| {name} | {exporter} | {mesh_text} | {split}/"
                              f"{len(document['parameters'])} | {len(document['unnamed'])} | "
                              f"{row} |", flush=True)  # fmt: skip
                        continue
                    run_s = time.perf_counter() - started
                    r = json.loads(out.read_text())
                    placements = "as planned" if r["same"] else "DIFFER"
                    placements += f" ({r['tied']} tied)" if r["tied"] else ""
                    print(
                        f"| {name} | {exporter} | {mesh_text} | {split}/"
                        f"{len(document['parameters'])} | {len(document['unnamed'])} | "
                        f"{styles} | {plan_s:.1f} | {run_s:.1f} | {r['error']:.1e} | "
                        f"{placements} |",
                        flush=True,
                    )
    return 0


def _styles(document: dict) -> str:
    """How many parameters each parallel style applies, most first (or why none does)."""
    if document["parallelize"]["fallback"]:
        return "distribute (no style: " + document["parallelize"]["fallback"] + ")"
    counts: dict[str, int] = {}
    for entry in document["parameters"].values():
        counts[entry["style"]] = counts.get(entry["style"], 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


class _stdout:
    """Send stdout to a file for a block (the CLI prints the JSON)."""

    def __init__(self, f) -> None:
        self.f = f

    def __enter__(self) -> None:
        self.old, sys.stdout = sys.stdout, self.f

    def __exit__(self, *exc: object) -> None:
        sys.stdout = self.old


if __name__ == "__main__":
    sys.exit(main())
