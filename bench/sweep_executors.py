"""Time `autoshard sweep` of the 32-layer decoder's training step on the local process pool
and on a local Ray, with the same workers.

    python bench/sweep_executors.py [--mesh 4x8,8x8,16x8,32x8] [--memory 40GiB,80GiB]
                                    [--workers 2] [--executors local ray]

Each executor sweeps into a fresh folder (nothing resumed): the dgx-h100 preset, batch 256 x
seq 2048, a price of 2.5 per device-hour. The table gives each executor's wall time end to end
(Ray's start and stop included) and its points planned; the last line says whether the
executors' tables agree point for point on status, step time, memory and plan (the error text
of an infeasible point may differ: the lowest feasible budget it names is searched under the
wall clock).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "decoder_32l_shape_only.onnx"
SAME = ("key", "status", "step_time_s", "memory_bytes_per_device", "plan_sha256")


def sweep(executor: str, args: argparse.Namespace, out: Path) -> float:
    command = [
        sys.executable, "-m", "autoshard", "sweep", str(MODEL), "-o", str(out), "-q",
        "--cluster", "dgx-h100", "--mode", "training", "--dim", "batch=256", "--dim", "seq=2048",
        "--price-per-device-hour", "2.5", "--workers", str(args.workers), "--executor", executor,
        "--memory", args.memory,
        *(["--mesh", args.mesh] if args.mesh else ["--devices", args.devices]),
    ]  # fmt: skip
    started = time.monotonic()
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mesh", default="4x8,8x8,16x8,32x8")
    parser.add_argument("--devices", default="32-256", help="used when --mesh is ''")
    parser.add_argument("--memory", default="40GiB,80GiB")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--executors", nargs="+", default=["local", "ray"])
    args = parser.parse_args()
    tables = {}
    print(f"{'executor':10} {'points':>6} {'wall s':>8}")
    with tempfile.TemporaryDirectory() as folder:
        for executor in args.executors:
            out = Path(folder) / executor
            seconds = sweep(executor, args, out)
            points = json.loads((out / "points.json").read_text())["points"]
            tables[executor] = [{k: p[k] for k in SAME} for p in points]
            print(f"{executor:10} {len(points):>6} {seconds:>8.1f}")
    first = next(iter(tables.values()))
    print("tables agree" if all(t == first for t in tables.values()) else "tables DIFFER")


if __name__ == "__main__":
    main()
