"""`autoshard run` of a pipelined partition: its forward, one process per device of the whole
mesh, micro-batch by micro-batch through the stages.

Each rank is a device of one stage (`execute.pipe_folder`), or of several chunks of an
interleaved plan, run in the schedule's forward order (`cost.schedule.order`: Megatron's,
groups of `p` micro-batches through each chunk in turn). For every micro-batch, in order
(micro-batch `m` on stage `s` once stage `s - 1` has sent it), a rank receives the boundary
values from the device at its place in the stage before, runs its stage's steps (segments on
onnxruntime, the stage's collectives among its devices), and sends the boundary values on to
the device at its place in the next stage (`isend`: a stage does not wait for the next to
take them). The stage's collectives run on
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

from autoshard.cost.schedule import Pass, Pipeline, Schedule, ScheduleKind, order
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
    device entry with its stage's collective indices moved by the stages before (a rank
    running several stages, an interleaved plan's chunks: its last's; each stage's own in
    `stages`, by rank)."""
    collectives: list[dict[str, Any]] = []
    entries: list[dict[str, Any]] = [{} for _ in range(world)]
    by_stage: list[dict[int, dict[str, Any]]] = []
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
        by_stage.append({})
        for local, device in enumerate(steps["devices"]):
            entries[ranks[local]] = by_stage[-1][ranks[local]] = dict(device) | {"steps": [
                {"collective": s["collective"] + offset} if "collective" in s else s
                for s in device["steps"]
            ]}  # fmt: skip
    return {"collectives": collectives, "devices": entries, "stages": by_stage}


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
        """Every micro-batch's forward through each stage (chunk) the rank is a device of,
        in the schedule's forward order (an interleaved plan's: Megatron's, chunk by chunk)."""
        from autoshard.run.p2p import Boundary
        from autoshard.run.rank import load_device

        stages = self.pipeline["stages"]
        mine = [s for s in stages if rank in s["devices"]]
        local = mine[0]["devices"].index(rank)
        boundary = Boundary(self.pipeline["boundary"], local, rank)
        loaded = {}
        for stage in mine:  # once, for every micro-batch
            s = stage["index"]
            sha256 = stage["sha256"][local] if "sha256" in stage else self.sha256[rank]
            loaded[s] = load_device(self.folder / stage["folder"], self._manifest(s), rank,
                                    sha256)  # fmt: skip
        results: list[dict[str, Any]] = [{} for _ in self.feeds]
        compute = 0.0
        for one in forward_passes(self.pipeline, int(mine[0].get("position", mine[0]["index"]))):
            s = mine[one.chunk]["index"]
            progress[len(self.steps["devices"]) + rank] = one.micro_batch
            found, spent = self._stage(s, local, rank, one.micro_batch, boundary, collectives,
                                       progress, loaded[s])  # fmt: skip
            compute += spent
            results[one.micro_batch] |= found
        boundary.wait()
        return results, {"stage": mine[0]["index"], "compute_s": compute}

    def _manifest(self, s: int) -> dict[str, Any]:
        """Stage `s`'s steps as `run.rank.execute` reads them: its devices' entries over the
        whole mesh's collectives, its weights and outputs."""
        own = self.stage_steps[s]
        return {**self.steps, "devices": self.steps["stages"][s], "weights": own["weights"],
                "outputs": own["outputs"]}  # fmt: skip

    def _stage(
        self, s: int, local: int, rank: int, m: int, boundary: Any, collectives: Any,
        progress: MutableSequence[int], loaded: Any,
    ) -> tuple[dict[str, Any], float]:  # fmt: skip
        """Micro-batch `m`'s forward through stage `s` on this rank: receive, run, send on;
        the model outputs the stage returns, and its compute seconds."""
        from autoshard.run.rank import execute

        stages = self.pipeline["stages"]
        stage = stages[s]
        tensor = {o["name"]: o["tensor"] for o in self.stage_steps[s]["outputs"]}
        returned = [o["name"] for o in self.pipeline["outputs"] if o["stage"] == s]
        before = stages[s - 1]["devices"][local] if s else None
        after = stages[s + 1]["devices"][local] if s + 1 < len(stages) else None
        received = boundary.receive(stage["receives"], before, m)
        found, timing = execute(self.folder / stage["folder"], self._manifest(s), rank,
                                self.feeds[m], collectives, progress, None, received,
                                loaded)  # fmt: skip
        values = {n: found[tensor[n]] for n in tensor} | received
        boundary.send({n: values[n] for n in stage["sends"]}, after, m)
        return {n: values[n] for n in returned}, timing.compute_s


def forward_passes(pipeline: Mapping[str, Any], position: int) -> tuple[Pass, ...]:
    """The forward passes of pipeline position `position` (`cost.schedule.order`): each
    micro-batch in turn, or, with an interleaved plan's chunks, Megatron's order."""
    schedule = Schedule.parse(str(pipeline["schedule"]))
    if int(pipeline.get("virtual", 1)) != schedule.virtual:  # a chunk a device
        schedule = Schedule(ScheduleKind.ONE_F_ONE_B)
    positions = len(pipeline["stages"]) // schedule.virtual
    shape = Pipeline(positions, int(pipeline["micro_batches"]), schedule)
    return order(shape, position, training=False)


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
