"""Cost fidelity: every op of a plan's per-device program timed at its local shapes, against
the cost model's estimate of it (`autoshard.execute.fidelity`).

    python bench/cost_fidelity.py                          # CPU, onnxruntime: calibrates first
    python bench/cost_fidelity.py --cluster cluster.json   # a file `autoshard calibrate` wrote
    python bench/cost_fidelity.py --probe torch --device cuda --cluster dgx-h100 --mesh 1 \
        --models /tmp/fidelity/llama.onnx --dim batch=8 --dim seq=2048
    python bench/cost_fidelity.py --models gpt2 bert --mesh 2 --dim batch=4 --dim seq=256
    python bench/cost_fidelity.py --measured bench/data/h100/fidelity.json   # no GPU needed

For each model (a bundled model's name, or a path): `autoshard plan` on `--mesh` with the
cluster, then device 0's program of the partition, each op timed alone by the probe
(onnxruntime on the CPU in float32, or torch: bfloat16 with CUDA events on `--device cuda`,
float32 on the CPU) and priced by the roofline at the probe's dtype. Without `--cluster`
the probe's own calibration of this machine is taken (`autoshard calibrate --quick`).
Printed per class (matmul, memory-bound, views) and in total: measured, estimated and their
ratio (estimate / measured; 1.00 is exact); `--json FILE` writes the same rows and every op's.

`--measured FILE` re-prices times an earlier run kept (bench/data/h100: an H100's, with
the models of bench/fidelity_models.py) on `--cluster` (default dgx-h100): how the cost model
fares against that GPU, on any machine.

Collectives are not in these sums: the links are `autoshard calibrate --ranks N`'s.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from autoshard.cost.cluster import make_cluster
from autoshard.cost.measure.calibrate import calibrate
from autoshard.cost.measure.probes import OnnxRuntimeProbe, TorchProbe
from autoshard.execute.fidelity import Fidelity, measure, recorded
from autoshard.ir.onnx_import import unbound_dims
from autoshard.pipeline import PlanRequest, RequestedPlan, plan_request
from autoshard.program import Compute

MODELS = Path(__file__).resolve().parents[1] / "models"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fidelity_models  # noqa: E402

DIMS = {"batch": 4, "seq": 128, "dec_seq": 64}


def model_path(model: str) -> Path:
    path = Path(model)
    return path if path.suffix == ".onnx" else MODELS / f"{model}.onnx"


def planned(path: Path, mesh: str, dims: dict[str, int], cluster: str) -> RequestedPlan:
    """`autoshard plan` of the model at `path` with the dims it has of `dims`."""
    wanted = unbound_dims(path)
    request = PlanRequest(
        model_path=path, cluster=make_cluster(mesh, file=cluster),
        dims={k: v for k, v in dims.items() if k in wanted}, time_limit=30.0,
    )  # fmt: skip
    return plan_request(request)


def run(model: str, mesh: str, dims: dict[str, int], cluster: str, probe) -> Fidelity:
    return measure(planned(model_path(model), mesh, dims, cluster), probe)


def recorded_runs(path: Path, cluster: str) -> list[tuple[dict[str, int], dict[str, Fidelity]]]:
    """Per run a file kept (its dims), each model's recorded times priced on `cluster`."""
    data = json.loads(path.read_text())
    with tempfile.TemporaryDirectory(prefix="autoshard-fidelity-") as folder:
        models = Path(folder)
        fidelity_models.write(models, data["layers"])
        return [(run_["dims"], _priced(run_, models, data, cluster)) for run_ in data["runs"]]


def _priced(run_: dict, models: Path, data: dict, cluster: str) -> dict[str, Fidelity]:
    """Each model's kept times priced; every op of its program must have one (the models
    made today are the run's), or the totals would leave some out."""
    results = {}
    for name, measured in run_["measured_s"].items():
        requested = planned(models / f"{name}.onnx", data["mesh"], run_["dims"], cluster)
        steps = requested.planned.program.steps
        if missing := sorted({s.op.name for s in steps if isinstance(s, Compute)} - set(measured)):
            raise SystemExit(f"{name}: no time kept for {missing[:5]} (the models changed?)")
        results[name] = recorded(requested, measured, data["dtype"])
    return results


def table(results: dict[str, Fidelity]) -> list[list[str]]:
    rows = [["model", "class", "ops", "measured ms", "estimated ms", "est/meas"]]
    for model, found in results.items():
        for total in found.classes():
            rows.append([
                model, total.kind, str(total.ops), f"{total.measured * 1e3:.3f}",
                f"{total.estimated * 1e3:.3f}", f"{total.ratio:.2f}",
            ])  # fmt: skip
    return rows


def show(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.rjust(w) if i >= 2 else c.ljust(w)
                        for i, (c, w) in enumerate(zip(r, widths, strict=True))))  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", help="a cluster file or preset (default: calibrate now)")
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt2", "bert", "gpt2_dynamo"])
    parser.add_argument("--mesh", default="2")
    parser.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE")
    parser.add_argument("--probe", choices=("onnxruntime", "torch"), default="onnxruntime")
    parser.add_argument("--device", default="cpu", help="torch's device: cpu or cuda")
    parser.add_argument("--worst", type=int, default=0, metavar="N",
                        help="also list each model's N ops the estimate misses most")  # fmt: skip
    parser.add_argument("--json", metavar="FILE", help="write the rows and every op here")
    parser.add_argument("--measured", type=Path, metavar="FILE",
                        help="price the times a run kept (bench/data/h100)")  # fmt: skip
    args = parser.parse_args()
    if args.measured:
        for dims, results in recorded_runs(args.measured, args.cluster or "dgx-h100"):
            print(" x ".join(f"{k} {v}" for k, v in dims.items()))
            show(table(results))
        return 0
    dims = DIMS | {k: int(v) for k, v in (d.split("=") for d in args.dim)}
    probe = OnnxRuntimeProbe() if args.probe == "onnxruntime" else TorchProbe(args.device)
    cluster = args.cluster
    if cluster is None:
        calibration = calibrate(True, lambda m: print(m, file=sys.stderr), probe)
        cluster = str(Path(tempfile.mkdtemp(prefix="autoshard-fidelity-")) / "cluster.json")
        Path(cluster).write_text(json.dumps(calibration.to_json()))
    results = {}
    for model in args.models:
        found = results[model] = run(model, args.mesh, dims, cluster, probe)
        misses = sorted(found.ops, key=lambda o: abs(o.measured - o.estimated))
        for o in reversed(misses[-args.worst :] if args.worst else []):
            print(f"{model}: {o.type} {o.name.rsplit('/', 1)[-1]} ({o.kind}) measured "
                  f"{o.measured * 1e6:.1f} us, estimated {o.estimated * 1e6:.1f} us")  # fmt: skip
        for name, why in found.skipped:
            print(f"{model}: not timed: {name}: {why}")
    rows = table(results)
    show(rows)
    if args.json:
        data = {
            "probe": f"{probe.name} {probe.dtype} on {getattr(probe, 'device', 'cpu')}",
            "cluster": cluster, "mesh": args.mesh, "dims": dims,
            "rows": [dict(zip(rows[0], r, strict=True)) for r in rows[1:]],
            "ops": {m: [o.__dict__ for o in f.ops] for m, f in results.items()},
            "skipped": {m: dict(f.skipped) for m, f in results.items()},
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(data, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
