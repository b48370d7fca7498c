"""`autoshard export`: a saved plan written for the user's framework (DTensor, JAX, ONNX)."""

from __future__ import annotations

import argparse
from pathlib import Path

from autoshard.cli.commands import emit
from autoshard.errors import AutoshardError
from autoshard.holding import words_of


def cmd_export(args: argparse.Namespace) -> int:
    from autoshard.export import Target, export_plan
    from autoshard.files import write_atomic

    target = Target(args.to)
    if target is Target.ONNX and not args.out:
        raise AutoshardError("--to onnx writes a model: give -o OUT.onnx")
    exported = export_plan(args.plan, target, args.model, args.checkpoint)
    if args.out:
        write_atomic(Path(args.out), exported.payload)
    document = exported.document
    if args.json:
        emit(document)
        return 0
    if target is Target.ONNX:
        print(
            f"{document['nodes_annotated']} of {document['nodes']} nodes annotated for "
            f"{document['devices']} devices (IR version {document['ir_version']})"
        )
    else:
        if target is Target.DTENSOR and document["parallelize"]["fallback"]:
            print(f"no parallel style applies: {document['parallelize']['fallback']}")
        for name, entry in document["parameters"].items():
            value = entry["placements"] if target is Target.DTENSOR else entry["text"]
            line = f"  {name}: {', '.join(value) if isinstance(value, list) else value}"
            if "style" in entry:
                line += f"  [{entry['style']}]"
            if "strategy" in entry:
                state = entry["optimizer_state"]
                line += f"  {words_of(entry['strategy'])}; optimizer state "
                line += ", ".join(state) if isinstance(state, list) else state
            print(line)
        for weight, why in document["unnamed"].items():
            print(f"  ONNX weight {weight}: {why}")
    if "pipeline" in document:
        print(pipeline_line(document["pipeline"]))
    for warning in document["warnings"]:
        print(f"warning: {warning}")
    if args.out:
        print(f"{target} export written to {args.out}")
    return 0


def pipeline_line(block: dict) -> str:
    """A pipelined plan's stage split in a line: `pipeline: 2 stages over pp, split before
    lm.model.layers.2 (SplitPoint.BEGINNING), Schedule1F1B, 4 micro-batches`."""
    points = ", ".join(p if isinstance(p, str) else p["module"] for p in block["split_points"])
    where = f", split before {points} (SplitPoint.BEGINNING)" if points else ""
    how = f", {block['schedule_class']}" if "schedule_class" in block else ""
    return (f"pipeline: {block['stages']} stages over {block['axis']}{where}{how}, "
            f"{block['micro_batches']} micro-batches")  # fmt: skip
