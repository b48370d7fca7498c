"""`autoshard partition`, `run` and `verify` of a pipelined plan: each stage's programs and the
sends between them written, the forward run as one process per device of the whole mesh."""

from __future__ import annotations

import argparse
import json
from typing import Any

from autoshard.cli.flags import dims_of
from autoshard.cli.summaries import print_checks
from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh


def is_pipelined(plan: str) -> bool:
    """Whether plan file `plan` is a pipelined plan."""
    from autoshard.document.plan_document import read_document

    return read_document(plan).pipeline is not None


def partition_pipelined(args: argparse.Namespace, annotations: tuple[Any, ...]) -> int:
    """`partition --plan` of a pipelined plan: each stage's programs and the sends between,
    of its training step (with `--forward`: of its forward)."""
    from autoshard.document.plan_document import planned_dims, read_document
    from autoshard.execute.pipe_folder import write_pipelined
    from autoshard.execute.stage_plans import pipelined_partition
    from autoshard.execute.stage_training import training_partition

    document = read_document(args.plan)
    assert document.pipeline is not None
    whole = str(document.pipeline["mesh"])
    if annotations or args.mode == "training":
        raise AutoshardError(
            f"plan {args.plan} is pipelined: its partition is the training step the plan "
            "decides (or its forward, with --forward); leave out annotations, --mode and the "
            "training flags"
        )
    if args.mesh is not None and str(Mesh.parse(args.mesh)) != whole:
        raise AutoshardError(
            f"plan {args.plan} is a pipeline on mesh {whole}, not {args.mesh}: leave out --mesh"
        )
    dims = dims_of(args.dim) or planned_dims(args.plan)
    if args.forward:
        staged, training = pipelined_partition(document, args.plan, args.model, dims), None
    else:
        staged, planned = training_partition(document, args.plan, args.model, dims)
        training = (planned, args.plan)
    manifest = write_pipelined(staged, args.model, dims, args.out, args.dialect, training)
    if args.json:
        print(json.dumps(manifest, indent=2))
        return 0
    positions = len(staged.stages) // staged.virtual
    chunks = f" ({len(staged.stages)} chunks)" if staged.virtual > 1 else ""
    print(
        f"partitioned {args.model} as a pipeline of {positions} stages{chunks} on mesh "
        f"{whole} (axis {staged.axis}, {staged.schedule}, {staged.micro_batches} "
        f"micro-batches): {'the forward' if args.forward else 'the training step'}"
    )
    what = "chunk" if staged.virtual > 1 else "stage"
    for stage in staged.stages:
        cut, program = stage.cut, stage.built.partitioned.program
        entry = manifest["pipeline"]["stages"][cut.index]
        gradients = (
            f", gradients: receives {len(entry['seeded'])}, sends back {len(entry['sent_back'])}"
            if "seeded" in entry else ""
        )  # fmt: skip
        print(
            f"  {what} {cut.index}: layers {cut.layers.start}..{cut.layers.stop - 1}, devices "
            f"{list(stage.devices)}, {len(list(program.communications))} collectives, receives "
            f"{len(cut.receives)}, sends {len(cut.sends)} boundary values{gradients} "
            f"({args.out}/stage-{cut.index}/)"
        )
    print(f"sends and receives: {args.out}/{manifest['spmd']['file']} ({args.dialect} dialect)")
    print(f"manifest: {args.out}/manifest.json")
    return 0


def run_pipelined_forward(
    args: argparse.Namespace, model: str | None, inputs: Any, how: str
) -> int:
    """`run` or `verify` of a pipelined partition: its forward as one process per device,
    checked against onnxruntime on the whole model (with `model`); a training step's
    partition trained (`run_pipelined_training_step`)."""
    from autoshard.execute.artifacts import read_manifest
    from autoshard.run.pipelined import run_pipelined

    if "training" in read_manifest(args.out)["pipeline"]:
        return run_pipelined_training_step(args, model, inputs, how)
    report = run_pipelined(args.out, args.backend, inputs, model, args.timeout,
                           rtol=getattr(args, "rtol", None))  # fmt: skip
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return 0 if report.ok else 1
    status = "" if not report.checks else (": ok" if report.ok else ": FAILED")
    stacked = next(iter(report.outputs.values())).shape[0] if report.outputs else 0
    print(f"{how} {args.out}: a pipelined forward of {stacked} micro-batches as "
          f"{report.devices} processes ({report.backend}){status}")  # fmt: skip
    if report.checks:
        print_checks(report.checks)
    return 0 if report.ok else 1


def run_pipelined_training_step(
    args: argparse.Namespace, model: str | None, inputs: Any, how: str
) -> int:
    """`run` or `verify` of a pipelined training partition: `--steps` training steps as one
    process per device, checked against PyTorch autograd on `model`."""
    from autoshard.cli.summaries import print_training
    from autoshard.run.pipetrain import run_pipelined_training

    if getattr(args, "rtol", None) is not None:
        raise AutoshardError(
            f"'{args.out}' is a pipelined training step, checked to 1e-5 against PyTorch "
            "autograd: --rtol is for forward passes"
        )
    if model is None:
        raise AutoshardError(
            f"'{args.out}' is a pipelined training step: give --check MODEL, the .onnx file it "
            "was partitioned from (the reference)"
        )
    if args.steps < 1:
        raise AutoshardError(f"--steps must be at least 1, got {args.steps}")
    floats = "float64" if args.float64 else "float32"
    report = run_pipelined_training(args.out, model, args.steps, args.backend, inputs,
                                    args.timeout, floats=floats, loss=args.loss)  # fmt: skip
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print_training(args.out, report, how)
    return 0 if report.ok else 1
