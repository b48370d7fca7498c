"""How the depth of a model changes `autoshard plan`'s time: the 405B's width at two depths.

    python bench/plan_depth.py [--layers 32 126] [--modes inference training] [--mesh 8x8]

Each decoder (hidden 16384, 128 heads, 8 KV heads, SwiGLU 53248, vocab 128256, float16,
weights absent) is written to a temporary folder by models/make_models.py and planned by
`autoshard plan` in its own process, as a user runs it: batch 8, seq 2048, `--memory 1TB`
(memory no object), training with `--recompute none` (one recomputation planned, not the
ladder `auto` may try). Columns: CPU seconds of the process (user + system: on a shared
machine the closer to a quiet machine's wall time), wall seconds, the solver's status, and
each depth's CPU time over the first depth's. Target (issue 42): 32 -> 126 layers <= 2x.

Measured (session 28, branch depth, 2 cores at load 7-15, CPU s; main at 1406166 -> the
branch): inference 32 layers 2.28 -> 2.19, 126 layers 4.99 -> 4.89 (2.23x); training 32
layers 6.39 -> 6.09, 126 layers 18.31 -> 17.33 (2.85x: not met). The plans are the same.
Session 29, branch rows (e070be7 -> the branch, load 7-25, two runs each): training 32
layers 6.36, 7.51 -> 6.90, 6.51; 126 layers 19.34, 20.25 -> 18.69, 18.11 (the rows' indicator
spans made from their events during assembly); still about 2.7-2.8x. Where the branch's
126-layer training goes is mostly linear in the layers: 46192 memory rows of about 350
indicator terms each, rows that differ from their copies in other layers in their terms'
bytes, not only by a constant (none of the 32-layer model's 11788 rows differs from another
by its constant alone, and 45 are dominated termwise by a row of the same terms).
Session 30, branch depth30 (d32d1b9 -> the branch, load 12-22, two runs each, CPU s):
training 32 layers 5.22, 5.15 -> 4.48, 4.72; 126 layers 17.00, 16.70 -> 13.17, 13.44 (3.25x
-> 2.85-2.94x at this load); inference 32 layers 2.04, 2.05 -> 1.88, 1.93; 126 layers 4.76,
4.84 -> 4.01, 4.18. The saving: the collector's young passes every 100k allocations, not 700
(`cli.main.GC_THRESHOLD`; with the collector off the 126-layer plan took 11.9 CPU s), and the
repeated layers' periods scanned in numpy. The plans and both documents are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "models"))

from make_models import build_decoder_shape_only  # noqa: E402

WIDTH = dict(hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256)


def plan(model: Path, mesh: str, mode: str) -> tuple[float, float, str]:
    """CPU and wall seconds of one `autoshard plan` process, and the solver's status."""
    out = model.with_suffix(f".{mode}.json")
    command = [sys.executable, "-m", "autoshard.cli.main", "plan", str(model), "--mesh", mesh,
               "--dim", "batch=8", "--dim", "seq=2048", "--memory", "1TB", "--mode", mode,
               "--time-limit", "600", "-q", "-o", str(out)]  # fmt: skip
    if mode == "training":
        command += ["--recompute", "none"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started, before = time.perf_counter(), _children_cpu()
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    wall, cpu = time.perf_counter() - started, _children_cpu() - before
    if done.returncode:
        return cpu, wall, "error: " + (done.stderr.strip().splitlines() or ["?"])[-1][:80]
    return cpu, wall, json.loads(out.read_text())["solver"]["status"]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[32, 126])
    parser.add_argument("--modes", nargs="+", choices=["inference", "training"],
                        default=["inference", "training"])  # fmt: skip
    parser.add_argument("--mesh", default="8x8")
    args = parser.parse_args(argv)
    print(f"{'mode':>9} {'layers':>6} {'cpu s':>7} {'wall s':>7} {'status':>8} {'x first':>7}")
    with tempfile.TemporaryDirectory() as folder:
        models = {}
        for layers in args.layers:
            models[layers] = Path(folder) / f"decoder_{layers}l.onnx"
            onnx.save(build_decoder_shape_only(layers, **WIDTH).proto, models[layers])
        for mode in args.modes:
            first = 0.0
            for layers in args.layers:
                cpu, wall, status = plan(models[layers], args.mesh, mode)
                first = first or cpu
                print(f"{mode:>9} {layers:>6} {cpu:>7.2f} {wall:>7.2f} {status:>8} "
                      f"{cpu / first:>6.2f}x", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
