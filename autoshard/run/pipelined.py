"""`autoshard run` of a pipelined partition: its forward, one process per device of the whole
mesh, micro-batch by micro-batch through the stages.

Each rank is a device of one stage (`execute.pipe_folder`). For every micro-batch, in order
(a forward's order under every schedule: micro-batch `m` on stage `s` once stage `s - 1` has
sent it), a rank receives the boundary values from the device at its place in the stage
before, runs its stage's steps (segments on onnxruntime, the stage's collectives among its
devices), and sends the boundary values on to the device at its place in the next stage
(`isend`: a stage does not wait for the next to take them). The stage's collectives run on
process groups of whole-mesh ranks: every stage's steps are translated to them, and every
rank makes every stage's groups in the same order, as torch requires.

Rank 0 gathers each model output's shards from the stage that returns it, per micro-batch;
they are reassembled (`execute.verify.assemble_value`) and, with `check`, compared with
onnxruntime on the whole model micro-batch by micro-batch. A run's outputs stack the
micro-batches on a new leading axis.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping, MutableSequence, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from autoshard.execute.artifacts import check_model, read_manifest
from autoshard.execute.steps import read_steps
from autoshard.execute.verify import (
    InputSpec,
    assemble_value,
    check_inputs,
    compare,
    random_inputs,
    reference_outputs,
    tolerance_for,
)
from autoshard.mesh import Mesh
from autoshard.run import RunReport, RunSetupError, torch_rank
from autoshard.run.rank import Rendezvous, StepFailure, describe, first_line
from autoshard.sharding import Sharding


def global_steps(
    stages: Sequence[Mapping[str, Any]], devices: Sequence[Sequence[int]], world: int
) -> dict[str, Any]:
    """Every stage's step manifest as one over the whole mesh's ranks: collectives of all
    stages (device groups, pairs and per-device shapes by whole-mesh rank) and each rank's
    device entry with its stage's collective indices moved by the stages before."""
    collectives: list[dict[str, Any]] = []
    entries: list[dict[str, Any]] = [{} for _ in range(world)]
    for steps, ranks in zip(stages, devices, strict=True):
        offset = len(collectives)
        for entry in steps["collectives"]:
            moved = dict(entry)
            moved["groups"] = [[ranks[m] for m in group] for group in entry.get("groups", ())]
            if "pairs" in entry:
                moved["pairs"] = [[ranks[a], ranks[b]] for a, b in entry["pairs"]]
            for key in ("source_shapes", "target_shapes"):
                full: list[list[int]] = [[] for _ in range(world)]
                for m, shape in enumerate(entry[key]):
                    full[ranks[m]] = shape
                moved[key] = full
            collectives.append(moved)
        for local, device in enumerate(steps["devices"]):
            entries[ranks[local]] = dict(device) | {"steps": [
                {"collective": s["collective"] + offset} if "collective" in s else s
                for s in device["steps"]
            ]}  # fmt: skip
    return {"collectives": collectives, "devices": entries}


def _feeds(
    specs: Sequence[InputSpec], count: int, inputs: Mapping[str, np.ndarray] | None, seed: int
) -> list[dict[str, np.ndarray]]:
    """Each micro-batch's inputs: seeded (seed + m), or given (an array of the model's shape
    for every micro-batch, or one per micro-batch on a leading axis of `count`)."""
    if inputs is None:
        return [random_inputs(specs, seed + m) for m in range(count)]
    return [
        check_inputs(
            specs,
            {
                n: a[m] if a.ndim and a.shape[0] == count and a.shape[1:] == s.shape else a
                for n, a in inputs.items()
                for s in specs
                if s.name == n
            },
        )  # fmt: skip
        for m in range(count)
    ]


@dataclass(frozen=True)
class _Stages:
    """A pipelined forward's rank (`run.launch.Work`)."""

    folder: Path
    pipeline: Mapping[str, Any]
    steps: Mapping[str, Any]
    stage_steps: tuple[Mapping[str, Any], ...]
    feeds: tuple[Mapping[str, np.ndarray], ...]
    backend: str
    sha256: tuple[str | None, ...]
    preload: str = "autoshard.run.rank"

    def stage_of(self, rank: int) -> tuple[int, int]:
        for stage in self.pipeline["stages"]:
            if rank in stage["devices"]:
                return stage["index"], stage["devices"].index(rank)
        raise AssertionError(rank)

    def where(self, rank: int, position: int, step: int) -> str:
        stage, _ = self.stage_of(rank)
        steps = self.steps["devices"][rank]["steps"]
        if 0 <= position < len(steps):
            what = describe(steps[position], self.steps)
            return f"stage {stage}, micro-batch {step}, step {position} ({what})"
        return f"stage {stage}, micro-batch {step}" if step >= 0 else "start"

    def __call__(self, rank: int, rendezvous: Rendezvous, progress: MutableSequence[int]) -> Any:
        import torch.distributed as dist

        from autoshard.run.collectives import Executor

        world = len(self.steps["devices"])
        try:
            store = rendezvous.store(world, rendezvous.host_store)
            dist.init_process_group(
                self.backend,
                store=store,
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=rendezvous.timeout_s),
            )
            collectives = Executor(self.steps, rank, self.backend)  # every stage's groups
        except Exception as error:  # torch's own errors
            raise StepFailure(rank, -1, "joining the process group", str(error)) from None
        try:
            outputs, timing = self._run(rank, collectives, progress)
            gathered: list[Any] | None = [None] * world if rank == 0 else None
            try:
                dist.gather_object((outputs, timing), gathered, dst=0)
            except Exception as error:  # torch's own errors: a peer gone (its own cause first)
                raise StepFailure(rank, -1, "gathering to rank 0", first_line(error)) from None
            return gathered
        finally:
            dist.destroy_process_group()

    def _run(self, rank: int, collectives: Any, progress: MutableSequence[int]) -> Any:
        from autoshard.run.p2p import Boundary
        from autoshard.run.rank import execute, load_device

        s, local = self.stage_of(rank)
        stages = self.pipeline["stages"]
        own = self.stage_steps[s]
        manifest = {**self.steps, "weights": own["weights"], "outputs": own["outputs"]}
        tensor = {o["name"]: o["tensor"] for o in own["outputs"]}
        returned = [o["name"] for o in self.pipeline["outputs"] if o["stage"] == s]
        boundary = Boundary(self.pipeline["boundary"], local, rank)
        before = stages[s - 1]["devices"][local] if s else None
        after = stages[s + 1]["devices"][local] if s + 1 < len(stages) else None
        folder = self.folder / stages[s]["folder"]
        loaded = load_device(folder, manifest, rank, self.sha256[rank])  # once, for every batch
        results, compute = [], 0.0
        world = len(self.steps["devices"])
        for m, feed in enumerate(self.feeds):
            progress[world + rank] = m
            received = boundary.receive(stages[s]["receives"], before, m)
            found, timing = execute(folder, manifest, rank, feed, collectives, progress,
                                    self.sha256[rank], received, loaded)  # fmt: skip
            compute += timing.compute_s
            values = {n: found[tensor[n]] for n in tensor} | received
            boundary.send({n: values[n] for n in stages[s]["sends"]}, after, m)
            results.append({n: values[n] for n in returned})
        boundary.wait()
        return results, {"stage": s, "compute_s": compute}


def run_pipelined(
    out: str | Path,
    backend: str = "gloo",
    inputs: Mapping[str, np.ndarray] | None = None,
    check: str | Path | None = None,
    timeout_s: float = 60.0,
    seed: int = 0,
    rtol: float | None = None,
) -> RunReport:
    """Run pipelined partition folder `out`'s forward as one process per device of its whole
    mesh on this host; the reassembled outputs (micro-batches stacked) and their checks."""
    folder = Path(out)
    manifest = read_manifest(folder)
    pipeline = manifest["pipeline"]
    if manifest["shape_only"]:
        raise RunSetupError(f"'{out}' is the partition of a shape-only model: nothing to run")
    if backend != "gloo":
        raise RunSetupError(
            f"a pipelined forward runs on gloo (its sends move CPU tensors); got {backend!r}"
        )
    if torch_rank() is not None:
        raise RunSetupError(
            f"'{out}' is a pipelined partition: run it without torchrun (autoshard run starts "
            "one process per device itself)"
        )
    if check is not None:
        check_model(manifest, check)
    stage_steps = tuple(read_steps(folder / s["folder"]) for s in pipeline["stages"])
    world = len(manifest["devices"])
    steps = global_steps(stage_steps, [s["devices"] for s in pipeline["stages"]], world)
    specs = [InputSpec(i["name"], i["dtype"], tuple(i["shape"]), i["high"])
             for i in pipeline["inputs"]]  # fmt: skip
    feeds = _feeds(specs, int(pipeline["micro_batches"]), inputs, seed)
    work = _Stages(folder, pipeline, steps, stage_steps, tuple(feeds), backend,
                   tuple(d["sha256"] for d in manifest["devices"]))  # fmt: skip
    from autoshard.run.launch import launch_work

    started = time.perf_counter()
    gathered = launch_work(work, world, timeout_s)
    wall = time.perf_counter() - started
    return _report(pipeline, gathered, feeds, check, backend, wall, rtol)


def _report(
    pipeline: Mapping[str, Any], gathered: list[Any], feeds: Sequence[Mapping[str, np.ndarray]],
    check: str | Path | None, backend: str, wall: float, rtol: float | None,
) -> RunReport:  # fmt: skip
    mesh = pipeline["stage_mesh"]
    stage_mesh = Mesh(tuple(mesh["shape"]), tuple(mesh["axis_names"]))
    values, replicas = {}, {}
    for output in pipeline["outputs"]:
        ranks = pipeline["stages"][output["stage"]]["devices"]
        sharding = Sharding.parse(output["sharding"])
        per_batch = [
            assemble_value(stage_mesh, sharding, tuple(output["shape"]),
                           [gathered[r][0][m][output["name"]] for r in ranks])
            for m in range(len(feeds))
        ]  # fmt: skip
        values[output["name"]] = np.stack([v for v, _ in per_batch])
        replicas[output["name"]] = max(r for _, r in per_batch)
    checks = {}
    if check is not None:
        references = [reference_outputs(check, feed) for feed in feeds]
        for output in pipeline["outputs"]:
            name = output["name"]
            expected = np.stack([np.asarray(r[name]) for r in references])
            checks[name] = compare(
                values[name], expected, tolerance_for(output["dtype"], rtol), replicas[name]
            )
    ranks = tuple({"rank": r, **timing} for r, (_, timing) in enumerate(gathered))
    return RunReport(len(gathered), backend, values, checks, ranks, wall)  # fmt: skip
