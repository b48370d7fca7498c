"""`autoshard run` against the in-process `verify`, and measured collective times against the
cost model, per bundled model and mesh (Megatron tensor parallelism on the mesh's last axis).

    python bench/run_verify.py [--meshes 2,2x2,2x4] [--bandwidth 2GB/s] [--latency 100us]
                               [--backend gloo]

Columns: in-process verify seconds; `run` seconds (one process per device, after a warm-up
run that starts the process server); then per collective kind the measured seconds (the
slowest rank's total, as a step waits for its slowest member) and the cost model's estimate
for the given link bandwidth and latency (`collective_time`, the planner's own formula). gloo
on one host runs over loopback TCP: set --bandwidth/--latency to what you want to compare
with. With several GPUs, --backend nccl (one GPU cannot host several NCCL ranks).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from autoshard.cost.cluster import make_cluster
from autoshard.cost.price import collective_time
from autoshard.execute.artifacts import verify_folder, write_partition
from autoshard.ir.onnx_import import import_onnx, unbound_dims
from autoshard.mesh import Mesh
from autoshard.pipeline import Setup, build_setup
from autoshard.run import run_partition
from autoshard.search.baselines import megatron

MODELS = Path(__file__).resolve().parents[1] / "models"
DIMS = {"batch": 4, "seq": 8}
NAMES = ("mlp", "cnn", "gpt2", "bert")


def row(name: str, mesh: Mesh, args: argparse.Namespace, folder: Path) -> list[str]:
    path = MODELS / f"{name}.onnx"
    dims = {k: v for k, v in DIMS.items() if k in unbound_dims(path)}
    graph = import_onnx(path, dims)
    setup = Setup(model=path, mesh=mesh, dims=dims,
                  annotations=tuple(megatron(graph, mesh, mesh.ndim - 1)))  # fmt: skip
    out = folder / f"{name}-{mesh}"
    write_partition(setup, out)
    program = build_setup(setup).program
    cluster = make_cluster(str(mesh), None, args.bandwidth, args.latency, None, None)
    estimate: dict[str, float] = defaultdict(float)
    for step in program.communications:
        estimate[str(step.collective.kind)] += collective_time(step.collective, cluster)
    started = time.perf_counter()
    verify_folder(out, path, dims)
    verified = time.perf_counter() - started
    report = run_partition(out, args.backend, check=path)
    assert report is not None and report.ok, f"{name} on {mesh}: run differs from onnxruntime"
    measured: dict[str, float] = defaultdict(float)
    for rank in report.ranks:
        for kind, stats in rank["collectives"].items():  # type: ignore[attr-defined]
            measured[kind] = max(measured[kind], stats["seconds"])
    kinds = "  ".join(
        f"{kind} {measured[kind] * 1e3:.2f}/{estimate[kind] * 1e3:.3f} ms"
        for kind in sorted(set(measured) | set(estimate))
    )
    return [name, str(mesh), f"{verified:.2f}", f"{report.wall_s:.2f}", kinds or "-"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", default="2,2x2,2x4")
    parser.add_argument("--bandwidth", default="2GB/s", help="link bandwidth for the estimate")
    parser.add_argument("--latency", default="100us", help="link latency for the estimate")
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args()
    header = ["model", "mesh", "verify s", "run s", "collectives: measured/estimated"]
    print(f"{header[0]:<6} {header[1]:<5} {header[2]:>8} {header[3]:>6}  {header[4]}")
    with tempfile.TemporaryDirectory() as temp:
        folder = Path(temp)
        warm = row("mlp", Mesh.parse("2"), args, folder)  # starts the process server
        del warm
        for text in args.meshes.split(","):
            for name in NAMES:
                cells = row(name, Mesh.parse(text), args, folder)
                print(f"{cells[0]:<6} {cells[1]:<5} {cells[2]:>8} {cells[3]:>6}  {cells[4]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
