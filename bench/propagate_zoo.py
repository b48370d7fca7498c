"""Propagate the baseline plans over the export zoo and count what they materialize.

    python models/make_zoo.py          # once: builds /tmp/autoshard-zoo (needs torch, transformers)
    python bench/propagate_zoo.py [--zoo DIR] [names...]

For every zoo file, on mesh [2]: data_parallel and megatron; on mesh 2x2: data_parallel over
both axes, megatron over axis 1, and dp_tp (batch over 0, weights over 1). Each plan is
propagated and materialized; the table gives the collectives by kind, the bytes each device
sends, the seconds (propagate + materialize) and, for Megatron plans, whether the all_reduces
are Megatron's pattern: one per vocabulary-split embedding lookup plus one per attention and
per MLP (or MoE) block (2 per encoder or decoder-only layer, 3 per decoder layer with
cross-attention), and for CNNs one per channel-split conv pair. `EXPECTED` holds those counts
for the zoo's tiny configs (2 layers each); a data-parallel plan must communicate nothing
(all_slice is local and free). Not a CI test: the zoo needs torch.
Exit status 1 if any plan fails or misses its expectation.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

from autoshard.errors import AutoshardError
from autoshard.ir.onnx_import import import_onnx, unbound_dims
from autoshard.mesh import Mesh
from autoshard.passes.materialize import materialize
from autoshard.propagate import propagate
from autoshard.search.baselines import data_parallel, dp_tp, megatron

DIMS = {"batch": 4, "seq": 8, "dec_seq": 4}
EXPECTED = {  # Megatron all_reduces: lookups + attention blocks + MLP blocks
    "gpt2": 1 + 2 * 2,
    "bert": 1 + 2 * 2,
    "llama": 1 + 2 * 2,
    "vit": 0 + 2 * 2,  # patch embedding is a Conv: no lookup
    "t5": 2 + 2 * 2 + 2 * 3,  # the shared table is looked up by encoder and decoder
    "bart": 2 + 2 * 2 + 2 * 3,
    "mixtral": 1 + 2 * 2,  # the MoE layer: one all_reduce, after the experts
    "resnet": 2,  # conv1-conv2 of each residual block; stem and shortcut stay whole
    "vgg": 1 + 1,  # conv0-conv2, and the classifier's Gemm-Relu-Gemm
    "densenet": 3,  # the 1x1-3x3 bottleneck of each dense layer
}
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "permute", "all_slice")


def plans(graph):
    """(mesh, plan label, annotations) for one model."""
    flat, square = Mesh((2,)), Mesh((2, 2))
    yield flat, "dp", lambda: data_parallel(graph, flat)
    yield flat, "megatron", lambda: megatron(graph, flat, 0)
    yield square, "dp[0,1]", lambda: data_parallel(graph, square, (0, 1))
    yield square, "megatron@1", lambda: megatron(graph, square, 1)
    yield square, "dp_tp", lambda: dp_tp(graph, square, 0, 1)


def run(path: Path, name: str) -> list[dict[str, object]]:
    graph = import_onnx(path, {d: DIMS[d] for d in unbound_dims(path)})
    rows = []
    for mesh, label, annotate in plans(graph):
        row: dict[str, object] = {"model": path.stem, "mesh": "x".join(map(str, mesh.shape))}
        row["plan"] = label
        start = time.perf_counter()
        try:
            annotations = annotate()
            plan = propagate(graph, mesh, annotations)
            program = materialize(graph, plan)
        except AutoshardError as error:
            row["error"] = f"{type(error).__name__}: {error}"
            rows.append(row)
            continue
        row["seconds"] = time.perf_counter() - start
        kinds = Counter(str(s.collective.kind) for s in program.communications)
        row["kinds"] = kinds
        row["bytes"] = program.bytes_per_device
        row["unruled"] = len(plan.unruled)
        row["annotated"] = len(annotations)
        paid = {k: v for k, v in kinds.items() if k != "all_slice"}
        if label == "dp" or label.startswith("dp["):
            row["ok"] = not paid
        else:
            want = EXPECTED.get(name)
            row["ok"] = want is not None and paid == {"all_reduce": want}
            row["want"] = want
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", type=Path, default=Path("/tmp/autoshard-zoo"))
    parser.add_argument("names", nargs="*", help="model names (gpt2, t5, ...); default: all")
    args = parser.parse_args(argv)
    files = sorted(args.zoo.glob("*.onnx"))
    if not files:
        print(f"no models in {args.zoo}; run python models/make_zoo.py first", file=sys.stderr)
        return 2
    header = ("model", "mesh", "plan", *KINDS, "bytes/dev", "sec", "unruled", "pattern")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    failed = 0
    for path in files:
        name = path.stem.rsplit("_", 1)[0]
        if args.names and name not in args.names:
            continue
        try:
            rows = run(path, name)
        except AutoshardError as error:
            rows = [{"model": path.stem, "mesh": "-", "plan": "import", "error": str(error)}]
        for row in rows:
            if "error" in row:
                failed += 1
                print(f"{row['model']} | {row['mesh']} | {row['plan']} | ERROR {row['error']}")
                continue
            kinds = row["kinds"]
            assert isinstance(kinds, Counter)
            verdict = "yes" if row["ok"] else "NO"
            if "want" in row:
                verdict += f" (want {row['want']} all_reduce)"
            failed += not row["ok"]
            cells = [row["model"], row["mesh"], row["plan"], *(kinds.get(k, 0) for k in KINDS)]
            cells += [row["bytes"], f"{row['seconds']:.2f}", row["unruled"], verdict]
            print(" | ".join(map(str, cells)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
