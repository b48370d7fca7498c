"""Plan a shape-only Llama-3-8B training step at long and short context: does it split the
attention by context (ring attention, all-gather K/V), by heads (Ulysses), and does it fit?

    python bench/plan_context.py [--seqs 8192 131072] [--mesh 4x8] [--device h100]

The decoder (32 layers, hidden 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256, float16,
weights absent) is written by models/make_models.py and planned as `autoshard plan
--training` does (`pipeline.plan_request`: batch 1, one sequence of `seq` tokens, attention
fused on the GPU presets, recomputation chosen), on the device's memory. Each row: the peak per
device against the budget, the step's compute and communication seconds, and the plan's
story (its attention: "ring attention", "context parallel attention", "Ulysses", "Megatron").
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import onnx

from autoshard.cost.cluster import make_cluster
from autoshard.pipeline import PlanRequest, plan_request
from autoshard.training import Recompute, Training

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "models"))

from make_models import build_decoder_shape_only  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", nargs="+", type=int, default=[8192, 131072])
    parser.add_argument("--mesh", default="4x8")
    parser.add_argument("--device", default="h100")
    parser.add_argument("--time-limit", type=float, default=120.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "llama3_8b.onnx"
        built = build_decoder_shape_only(
            32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256
        )  # fmt: skip
        onnx.save(built.proto, path)
        for seq in args.seqs:
            request = PlanRequest(
                model_path=path, cluster=make_cluster(args.mesh, args.device),
                dims={"batch": 1, "seq": seq}, time_limit=args.time_limit,
                training=Training(recompute=Recompute.AUTO),
            )  # fmt: skip
            started = time.perf_counter()
            requested = plan_request(request)
            cost = requested.planned.cost
            print(
                f"seq {seq}: peak {cost.memory_bytes_per_device / 1e9:.1f} GB of "
                f"{requested.cluster.memory / 1e9:.1f} GB, compute {cost.compute_time_s:.3f} s, "
                f"comm {cost.comm_time_s:.3f} s, planned in "
                f"{time.perf_counter() - started:.1f} s\n  {requested.document.story}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
