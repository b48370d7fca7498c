"""How fast memory-bound torch kernels move bytes by the way they read them: the rate of
each (bytes read + written over its device time, `cost.probes.TorchProbe`) against a
contiguous Add's, at the shapes a transformer's forward gives them.

    python bench/kernel_access.py --device cuda          # bfloat16, CUDA graphs
    python bench/kernel_access.py                        # float32 on the CPU, one thread

Why: the roofline prices a memory-bound op at its bytes over one streaming bandwidth; the
fidelity bench on an H100 (bench/gpu_session.sh) found broadcast operands (a bias, an
attention mask, a norm's divisor) and transposes running well below it. This table is the
evidence a model of it rests on.
"""

from __future__ import annotations

import argparse
import sys

from autoshard.cost.measure.probes import TorchProbe


def cases(torch, probe: TorchProbe, scale: int):
    b, s, h, d = 8 // scale, 2048 // scale, 32, 128
    hidden = h * d
    t = probe.tensor
    x = t(b * s, hidden)
    y = t(b * s, hidden)
    bias = t(hidden)
    column = t(b * s, 1)
    scalar = t(1)
    scores = t(b, h // 4, s, s)
    mask = t(b, 1, s, s)
    heads = t(b, s, h, d)
    qkv = t(b * s, 3 * hidden)
    size = x.element_size()
    big = scores.numel() * size
    act = x.numel() * size
    yield "add, same shape", lambda: torch.add(x, y), 3 * act
    yield "add, a bias row [hidden]", lambda: torch.add(x, bias), 2 * act
    yield "div, a column [rows, 1]", lambda: torch.div(x, column), 2 * act
    yield "mul, a one-element tensor", lambda: torch.mul(x, scalar), 2 * act
    yield "mul, a Python number", lambda: torch.mul(x, 0.125), 2 * act
    small = t(512, hidden)
    small_y = t(512, hidden)
    yield (
        "add, same shape, 12 MiB moved (L2)",
        lambda: torch.add(small, small_y),
        3 * small.numel() * size,
    )
    yield "add, a mask [b,1,s,s] to [b,h,s,s]", lambda: torch.add(scores, mask), 2 * big
    yield "copy, same shape", lambda: x.clone(), 2 * act
    yield (
        "transpose [b,s,h,d] -> [b,h,s,d]",
        lambda: heads.permute(0, 2, 1, 3).contiguous(),
        2 * act,
    )
    yield (
        "transpose [b,s,h,d] -> [b,h,d,s]",
        lambda: heads.permute(0, 2, 3, 1).contiguous(),
        2 * act,
    )
    yield (
        "split [rows, 3 hidden] in 3, each copied",
        (lambda: [p.contiguous() for p in torch.split(qkv, hidden, -1)]),
        2 * qkv.numel() * size,
    )
    yield "softmax, last axis", lambda: torch.softmax(scores, -1), 2 * big


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--scale", type=int, default=0, help="divide batch and seq (default: 1 on CUDA, 8 on a CPU)"
    )
    args = parser.parse_args()
    import torch

    probe = TorchProbe(args.device)
    scale = args.scale or (1 if probe.cuda else 8)
    rows = []
    for name, run, moved in cases(torch, probe, scale):
        seconds = probe.time(run)
        rows.append((name, seconds, moved / seconds))
    reference = rows[0][2]
    print(
        f"{'kernel':45s} {'us':>9s} {'GB/s':>8s} {'of add':>7s}  ({probe.dtype} on {args.device})"
    )
    for name, seconds, rate in rows:
        print(f"{name:45s} {seconds * 1e6:9.1f} {rate / 1e9:8.1f} {rate / reference:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
