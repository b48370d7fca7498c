"""What FSDP's collectives cost per step for a Llama 3 8B-shaped model over 128 devices.

    python bench/multinode_fsdp.py [--mesh 16x8] [--cluster dgx-h100]

Every weight of the model (bf16, Llama 3 8B's shapes: 32 layers of hidden 4096, 8 KV heads of
128, FFN 14336, vocabulary 128256) is sharded on its first dim over every mesh axis, as
FSDP (ZeRO-3) holds it; a step all-gathers each weight twice (forward and backward) and
reduce-scatters its gradient once. The collectives are `plan_reshard`'s, priced by
`cost.price.collective_time`, the function the search and the plan's cost use, so the
table is what a plan of this layout is charged. Run it with another checkout's package on
PYTHONPATH to compare pricing rules.
"""

from __future__ import annotations

import argparse

from autoshard.cost.cluster import make_cluster
from autoshard.cost.price import collective_time
from autoshard.reshard import plan_reshard
from autoshard.sharding import Sharding

HIDDEN, KV, FFN, VOCAB, LAYERS = 4096, 1024, 14336, 128256, 32


def weights() -> list[tuple[tuple[int, ...], int]]:
    """(shape, count) of Llama 3 8B's weights."""
    layer = [
        ((HIDDEN, HIDDEN), 2),  # q, o
        ((HIDDEN, KV), 2),  # k, v
        ((HIDDEN, FFN), 2),  # gate, up
        ((FFN, HIDDEN), 1),  # down
        ((HIDDEN,), 2),  # the two norms
    ]
    rest = [((VOCAB, HIDDEN), 2), ((HIDDEN,), 1)]  # embedding, LM head, final norm
    return [(shape, count * LAYERS) for shape, count in layer] + rest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mesh", default="16x8")
    parser.add_argument("--cluster", default="dgx-h100")
    args = parser.parse_args(argv)
    cluster = make_cluster(mesh=args.mesh, file=args.cluster)
    every = list(range(len(cluster.mesh.shape)))
    sharded = Sharding.parse(f"[[{', '.join(map(str, every))}]]")
    partial = Sharding.parse(f"[[]] partial = sum[{', '.join(map(str, every))}]")
    rows = {
        "all_gather (forward)": (sharded, Sharding.parse("[[]]"), 1),
        "all_gather (backward)": (sharded, Sharding.parse("[[]]"), 1),
        "reduce_scatter (gradients)": (partial, sharded, 1),
    }
    params = sum(count * _prod(shape) for shape, count in weights())
    print(f"Llama 3 8B shapes: {params / 1e9:.2f} B parameters, bf16, mesh {cluster.mesh}")
    print(f"{'collective':<28} {'GB per device':>14} {'seconds':>9}")
    total = 0.0
    for name, (src, dst, _) in rows.items():
        sent, seconds = 0, 0.0
        for shape, count in weights():
            for c in plan_reshard(src, dst, shape, cluster.mesh, itemsize=2):
                sent += count * c.bytes_per_device
                seconds += count * collective_time(c, cluster)
        total += seconds
        print(f"{name:<28} {sent / 1e9:>14.2f} {seconds:>9.3f}")
    print(f"{'FSDP per step':<28} {'':>14} {total:>9.3f}")
    return 0


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    raise SystemExit(main())
