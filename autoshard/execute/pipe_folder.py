"""The partition folder of a pipelined plan: each stage's programs, and the sends between them.

    OUT/manifest.json               format autoshard-partition/1 with a `pipeline` block: the
                                    whole mesh, its pipeline axis, the schedule and
                                    micro-batches, the model's inputs and outputs (which stage
                                    returns each, held how), every stage's layers, folder,
                                    devices (whole-mesh indices, in the stage mesh's order),
                                    what it receives and sends, and each boundary value's
                                    dtype, shape, holding and every stage device's local shape;
                                    a training step's: each tied weight's gradient and the
                                    pairs of ranks that sum it (`execute.tied`); an
                                    interleaved plan's: a stage entry per chunk, its position
    OUT/pipeline.mlir               the sends and receives on the pipeline axis, as MLIR
                                    (`mesh.send`/`mesh.recv`, or `shard.` in that dialect): one
                                    function per stage, its program in OUT/stage-<s>/
    OUT/stage-<s>/spmd.mlir         the stage's SPMD program on the stage's mesh (its boundary
                                    inputs are its arguments, what it sends among its results)
    OUT/stage-<s>/steps.json,       as a partition's (`execute.steps`), for the stage's devices
      segments/, weights/           in the stage mesh's order: what `autoshard run` executes

The devices of a stage at the same place in their stage mesh hold the same region of every
boundary value (`execute.stage_plans`), so a send is a device's shard, moved as it is to the
device at its place in the next stage. Running the same command twice gives the same bytes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autoshard.execute.artifacts import (
    FORMAT,
    MANIFEST,
    SPMD,
    PartitionFolderError,
    remove_stale,
    write_weights,
)
from autoshard.execute.stage_plans import PipelinedPartition, StagePartition
from autoshard.execute.stage_training import seed_name, seeded
from autoshard.execute.steps import STEPS, write_steps
from autoshard.execute.tied import TiedText, tied_json, tied_mlir
from autoshard.execute.verify import id_bound
from autoshard.files import json_text, sha256_file, write_atomic
from autoshard.mlir import Dialect
from autoshard.mlir.syntax import TensorType, attr_text, quote
from autoshard.pipeline import print_spmd
from autoshard.training.options import Training

PIPELINE_MLIR = "pipeline.mlir"
PLAN_COPY = "plan.json"


def stage_folder(index: int) -> str:
    return f"stage-{index}"


def write_pipelined(
    staged: PipelinedPartition, model: str | Path, dims: Mapping[str, int],
    out: str | os.PathLike[str], dialect: str = Dialect.MESH,
    training: tuple[Training, str | Path] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Write the folder `out` of a pipelined partition; return its manifest. `training`: its
    stages are training steps (`execute.stage_training`), of this training and plan file
    (copied to OUT/plan.json: a run rebuilds the stages from it)."""
    folder = Path(out)
    forward = staged.forward
    shape_only = any(not w.has_data for w in forward.weights.values())
    devices: list[dict[str, Any]] = [{} for _ in range(staged.mesh.size)]
    sha256: dict[int, list[str]] = {}
    for stage in staged.stages:
        here = folder / stage_folder(stage.cut.index)
        try:
            here.mkdir(parents=True, exist_ok=True)
            if not shape_only:
                (here / "weights").mkdir(exist_ok=True)
        except OSError as error:
            raise PartitionFolderError(f"cannot create '{here}': {error.strerror}") from None
        built = stage.built
        names = sorted(built.graph.weights)
        files = write_weights(here, built.plan.mesh, built, names, shape_only)
        remove_stale(here / "weights", {d["file"] for d in files})
        if not shape_only:
            write_steps(
                here, built.partitioned, built.graph, {d["index"]: d["file"] for d in files}
            )
        write_atomic(here / SPMD, print_spmd(built.partitioned, dialect).encode())
        sha256[stage.cut.index] = [entry["sha256"] for entry in files]
        for local, (index, entry) in enumerate(zip(stage.devices, files, strict=True)):
            if devices[index]:  # an interleaved plan's later chunk: its file is its stage's
                continue
            devices[index] = {
                "index": index, "coordinates": list(staged.mesh.multi_index(index)),
                "stage": stage.cut.index, "local": local, "sha256": entry["sha256"],
                "bytes": entry["bytes"],
            }  # fmt: skip
    write_atomic(folder / PIPELINE_MLIR, p2p_text(staged, dialect).encode())
    pipeline = _pipeline_json(staged, shape_only)
    if training is not None:
        write_atomic(folder / PLAN_COPY, Path(training[1]).read_bytes())
        pipeline |= {"training": training[0].to_json(), "plan": PLAN_COPY}
        pipeline["tied"] = tied_json(staged)
    if training is not None or staged.virtual > 1:  # where a device runs several chunks
        pipeline["virtual"] = staged.virtual
        for entry, stage in zip(pipeline["stages"], staged.stages, strict=True):
            entry |= {"position": staged.position(stage.cut.index),
                      "sha256": sha256[stage.cut.index]}  # fmt: skip
            entry |= _gradients(stage) if training is not None else {}
    manifest = {
        "format": FORMAT,
        "model": {"path": str(model), "sha256": sha256_file(model)},
        "dims": dict(sorted(dims.items())),
        "shape_only": shape_only,
        "pipeline": pipeline,
        "devices": devices,
        "spmd": {"file": PIPELINE_MLIR, "dialect": dialect},
    }
    write_atomic(folder / MANIFEST, json_text(manifest).encode())
    return manifest


def _pipeline_json(staged: PipelinedPartition, shape_only: bool) -> dict[str, Any]:
    forward, first = staged.forward, staged.stages[0].built.plan.mesh
    values = forward.values
    returned_by = {n: s for s in staged.stages for n in s.cut.graph.outputs}
    return {
        "mesh": {"shape": list(staged.mesh.shape), "axis_names": list(staged.mesh.axis_names)},
        "axis": staged.axis,
        "stage_mesh": {"shape": list(first.shape), "axis_names": list(first.axis_names)},
        "schedule": staged.schedule,
        "micro_batches": staged.micro_batches,
        "inputs": [
            {
                "name": n,
                "dtype": values[n].dtype,
                "shape": list(values[n].shape),
                "high": id_bound(forward, n),
            }
            for n in forward.inputs
        ],  # fmt: skip
        "outputs": [
            {"name": n, "stage": returned_by[n].cut.index, **_held(returned_by[n], n)}
            for n in forward.outputs  # a training step returns its updates, not these
        ],
        "stages": [
            {
                "index": s.cut.index,
                "layers": [s.cut.layers.start, s.cut.layers.stop],
                "folder": stage_folder(s.cut.index),
                "devices": list(s.devices),
                "receives": list(s.cut.receives),
                "sends": list(s.cut.sends),
                "steps": None if shape_only else f"{stage_folder(s.cut.index)}/{STEPS}",
            }
            for s in staged.stages
        ],
        "boundary": {
            n: {
                "dtype": values[n].dtype,
                "shape": list(values[n].shape),
                "sharding": sharding.text(len(values[n].shape)),
                "local_shapes": [
                    list(sharding.local_shape(first, values[n].shape, d)) for d in first.devices()
                ],
            }
            for n, sharding in staged.boundary.items()
        },
    }


def _gradients(stage: StagePartition) -> dict[str, Any]:
    """A training stage's gradients on the boundary: those of its sends it takes from the next
    stage (`seeded`, each its step's input `stage_training.seed_name`), and those of what it
    receives that it sends back (`sent_back`: each by the step's output holding it)."""
    graph, cut = stage.built.graph, stage.cut
    outputs = graph.outputs[: len(graph.outputs) - len(cut.sends)]
    back = [n for n in cut.receives if seed_name(n) in graph.values]
    return {
        "seeded": list(seeded(graph, cut)),
        "sent_back": dict(zip(back, outputs[len(outputs) - len(back) :], strict=True)),
    }


def _held(stage: StagePartition, name: str) -> dict[str, Any]:
    """How a model output is returned by its stage's program (to reassemble it)."""
    program, outputs = stage.built.partitioned.program, stage.built.graph.outputs
    if name not in outputs:
        return {}
    tensor = program.outputs[outputs.index(name)]
    t = program.tensors[tensor]
    return {"tensor": tensor, "dtype": t.dtype, "shape": list(t.shape),
            "sharding": t.sharding.text(len(t.shape))}  # fmt: skip


def p2p_text(staged: PipelinedPartition, dialect: str = Dialect.MESH) -> str:
    """The sends and receives of every stage as MLIR: stage `s`'s function takes what it
    sends (its device's shard), sends it to the next stage's position on the pipeline axis
    (`s + 1`; an interleaved plan's chunk `s + 1`'s), and receives what the stage before
    sends it; a training step's stage also receives the gradients of its sends from the
    next stage and sends the gradients of what it receives back to the stage before."""
    mesh = staged.mesh
    grid = "mesh.mesh" if dialect == Dialect.MESH else "shard.grid"
    shape = "x".join(map(str, mesh.shape))
    names = f" {{axis_names = {attr_text(mesh.axis_names)}}}" if mesh.axis_names else ""
    lines = ["module {", f"  {grid} @{mesh.name}(shape = {shape}){names}"]
    stage_mesh = staged.stages[0].built.plan.mesh
    for stage in staged.stages:
        s, cut = stage.cut.index, stage.cut
        before, after = staged.position(s - 1), staged.position(s + 1)
        gradients = _gradients(stage) if stage.built.graph is not cut.graph else None
        back = gradients["sent_back"] if gradients else {}
        # (the value whose local type it has, its name, the peer's position)
        sends = [(n, n, after) for n in cut.sends] + [(x, g, before) for x, g in back.items()]
        receives = [(n, n, before) for n in cut.receives]
        receives += [(n, seed_name(n), after) for n in (gradients or {}).get("seeded", [])]
        types = {v: _local_type(staged, stage_mesh, v) for v, _, _ in (*sends, *receives)}
        tied = tied_mlir(staged, stage, dialect)
        args = [f"%arg{k}: {types[v]}" for k, (v, _, _) in enumerate(sends)] + list(tied.args)
        lines.append(
            f"  // {'chunk' if staged.virtual > 1 else 'stage'} {s}: layers "
            f"{cut.layers.start}..{cut.layers.stop - 1} on devices "
            f"{list(stage.devices)}; its program: {stage_folder(s)}/{SPMD}"
        )
        results = ", ".join([str(types[v]) for v, _, _ in receives] + [t for _, t in tied.results])
        lines.append(f"  func.func @stage{s}({', '.join(args)}) -> ({results}) {{")
        body = _p2p_body(staged, dialect, sends, receives, types, tied)
        lines += [f"    {line}" for line in body] + ["  }"]
    return "\n".join([*lines, "}", ""])


def _p2p_body(
    staged: PipelinedPartition, dialect: str, sends: list[tuple[str, str, int]],
    receives: list[tuple[str, str, int]], types: dict[str, TensorType], tied: TiedText,
) -> list[str]:  # fmt: skip
    """A stage function's receives, sends, tied weights' sums and return (`p2p_text`)."""
    mesh, axis = staged.mesh, staged.axis
    axes = "mesh_axes" if dialect == Dialect.MESH else "grid_axes"
    body, returned = [], []
    for k, (value, name, source) in enumerate(receives):
        t = types[value]
        body.append(f"%r{k} = tensor.empty() : {t}")
        body.append(
            f"%recv{k} = {dialect}.recv %r{k} on @{mesh.name} {axes} = [{axis}] "
            f"source = [{source}] : ({t}) -> {t} loc({quote(name)})"
        )
        returned.append(f"%recv{k}")
    for k, (value, name, destination) in enumerate(sends):
        t = types[value]
        body.append(
            f"%send{k} = {dialect}.send %arg{k} on @{mesh.name} {axes} = [{axis}] "
            f"destination = [{destination}] : ({t}) -> {t} loc({quote(name)})"
        )
    body += tied.body
    returned += [name for name, _ in tied.results]
    results = ", ".join([str(types[v]) for v, _, _ in receives] + [t for _, t in tied.results])
    body.append(f"return {', '.join(returned)} : {results}" if returned else "return")
    return body


def _local_type(staged: PipelinedPartition, mesh: Any, name: str) -> TensorType:
    """A boundary value's local type on a stage's device (`?` where devices differ)."""
    value, sharding = staged.forward.values[name], staged.boundary[name]
    shapes = {sharding.local_shape(mesh, value.shape, d) for d in mesh.devices()}
    dims = tuple(
        dims[0] if len(set(dims)) == 1 else None for dims in zip(*shapes, strict=True)
    ) if shapes else tuple(value.shape)  # fmt: skip
    return TensorType(dims, value.dtype)
