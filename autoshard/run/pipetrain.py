"""`autoshard run` of a pipelined training partition: N training steps, one process per device
of the whole mesh, each stage's passes in its schedule's order, checked against PyTorch
autograd on the whole model.

    run_pipelined_training(OUT, MODEL, steps=3) -> TrainingReport

Each rank is a device of one stage (`execute.stage_training`: the stage's whole training
step, rebuilt from the plan the folder keeps, its step list and weights from the folder). A
step runs the passes of `cost.schedule.order` for the stage (GPipe: every forward, then every
backward; 1F1B: `p - s - 1` forwards, then one forward and one backward in turn; an
interleaved plan's stage runs its layers as one chunk, in 1F1B's order; ZB-H1: 1F1B's, each
backward its input gradient `B`, each micro-batch's weight gradients a later `W` pass,
`StageDevice.split_backward`). A forward pass of micro-batch `m` receives the boundary values
from the device at its place in the stage before, runs the stage's forward
(`run.stage_device`) and sends its own on; the backward receives the gradients of what it
sent from the next stage, runs the backward and sends the gradients of what it received back.
The micro-batches' gradients accumulate; the last micro-batch's backward (ZB-H1: its `W`
pass) syncs them over the stage's data-parallel devices and updates the weights. Every
backward (and `W`) runs in micro-batch order under every schedule, so the schedule does not
change a single rounding. A weight trained on two stages (tied, `execute.tied`) has its
gradient summed over the pair of devices holding it once every pass has run: the last
micro-batch's backward pauses before anything reads it, so both copies take the same update.

After each step rank 0 gathers what the checks read (`train_check.Checked`) from every rank,
and each stage's loss, gradients, weights and optimizer states are compared with the
single-process reference (`train_check.ReferenceRun`) of the whole model on the step's whole
batch, each step from the weights the ranks hold. A mismatch names the step, the (whole
mesh) rank and the parameter; a rank that fails names its stage, step and pass.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, MutableSequence, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from autoshard.cost.schedule import Pass, Pipeline, Schedule, ScheduleKind, order
from autoshard.execute.artifacts import check_model, read_manifest
from autoshard.execute.pipe_folder import PLAN_COPY
from autoshard.execute.stage_plans import PipelinedPartition
from autoshard.execute.stage_training import seed_name
from autoshard.execute.steps import read_steps
from autoshard.execute.tied import Tied
from autoshard.execute.train_check import (
    FLOATS,
    Check,
    Checked,
    TrainingReport,
    check_training,
    computing_in,
    floats_of,
    held_start,
    reference_of,
    step_checks,
    to_numpy,
    to_torch,
    tolerance_of,
)
from autoshard.execute.train_verify import feeds_of, local_inputs, segment_nodes, start_tensors
from autoshard.execute.verify import VerifyError, input_specs
from autoshard.ir.graph import Graph
from autoshard.run import RunSetupError, torch_rank
from autoshard.run.collectives import Executor
from autoshard.run.p2p import Boundary
from autoshard.run.pipelined import global_steps
from autoshard.run.rank import Rendezvous, StepFailure, Timing, describe, read_weights
from autoshard.run.stage_device import StageDevice
from autoshard.run.train import Records, TrainingFailure, run_collective, train_rank_join
from autoshard.training.loss import LABELS, label_classes
from autoshard.training.options import Training


@dataclass(frozen=True)
class StageWork:
    """What a rank needs of its stage: its partition, its step manifest and segment nodes,
    the values it receives and sends (and whose gradients), what its checks read."""

    folder: Path
    graph: Graph
    partitioned: Any
    manifest: Mapping[str, Any]  # the stage's steps.json
    nodes: Mapping[str, list[tuple[str, str]]]
    devices: tuple[int, ...]
    entry: Mapping[str, Any]  # the pipeline block's stage entry
    checked: Checked
    offset: int  # its first collective's index in the whole mesh's list
    weight_ops: frozenset[str] = frozenset()  # `W`'s ops where the schedule splits the backward


@dataclass(frozen=True)
class PipelineTrainingWork:
    """Every rank's share of a pipelined training run (sent to each rank once)."""

    stages: tuple[StageWork, ...]
    collectives: Mapping[str, Any]  # every stage's collectives over the whole mesh's ranks
    boundary: Mapping[str, Any]
    passes: tuple[tuple[Pass, ...], ...]  # per stage
    feeds: Sequence[Sequence[Mapping[str, np.ndarray]]]  # per step, per micro-batch
    backend: str
    sha256: tuple[str | None, ...]
    floats: str = "float32"
    tied: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # by gradient
    preload: str = "autoshard.run.pipetrain"

    def stage_of(self, rank: int) -> tuple[StageWork, int]:
        return next((s, s.devices.index(rank)) for s in self.stages if rank in s.devices)

    def where(self, rank: int, position: int, step: int) -> str:
        stage, local = self.stage_of(rank)
        steps = stage.manifest["devices"][local]["steps"]
        if step < 1 or not 0 <= position < len(steps):
            return "start"
        what = describe(steps[position], stage.manifest)
        return f"stage {stage.entry['index']}, training step {step}, step {position} ({what})"

    def __call__(
        self, rank: int, rendezvous: Rendezvous, progress: MutableSequence[int]
    ) -> list[tuple[Records, dict[str, object]]] | None:
        world = len(self.sha256)
        train_rank_join(rank, world, self.backend, rendezvous)
        try:
            try:
                collectives = Executor(self.collectives, rank, self.backend)
            except Exception as error:  # torch's own errors
                raise TrainingFailure(rank, 0, -1, "joining the process group",
                                      str(error)) from None  # fmt: skip
            with computing_in(self.floats):
                records = _Rank(self, rank, collectives, progress).train()
            gathered: list[Any] | None = [None] * world if rank == 0 else None
            try:
                dist.gather_object(records, gathered, dst=0)
            except Exception as error:  # torch's own errors: a peer gone (its own cause first)
                raise _PeerFailure(rank, len(self.feeds), -1, "gathering to rank 0",
                                   str(error).splitlines()[0]) from None  # fmt: skip
            return gathered
        finally:
            dist.destroy_process_group()


class _PeerFailure(TrainingFailure):
    """A send or receive that failed: a peer's echo (it stopped), not this rank's own cause."""

    @property
    def own(self) -> bool:
        return False


@dataclass
class _Chunk:
    """One stage (an interleaved plan's chunk) this rank is a device of, and its device."""

    stage: StageWork
    local: int
    device: StageDevice
    before: int | None  # the rank it receives from, sends gradients back to
    after: int | None  # the rank it sends to, receives gradients from

    @property
    def steps(self) -> list[Any]:
        return self.stage.manifest["devices"][self.local]["steps"]

    @property
    def tensors(self) -> dict[str, str]:
        return {o["name"]: o["tensor"] for o in self.stage.manifest["outputs"]}


class _Rank:
    """One rank's training steps: each of its stages' (chunks') passes in the schedule's
    order."""

    def __init__(self, work: PipelineTrainingWork, rank: int, collectives: Executor,
                 progress: MutableSequence[int]) -> None:  # fmt: skip
        self.work, self.rank, self.collectives, self.progress = work, rank, collectives, progress
        self.step, self.timing = 0, Timing()
        self.mine = [s for s in work.stages if rank in s.devices]  # in chunk order
        self.chunks: list[_Chunk] = []
        self.chunk = 0  # the one running
        self.split = any(one.weight for passes in work.passes for one in passes)  # ZB-H1
        self.tying: list[_Chunk] = []  # paused before reading a tied gradient not summed yet
        boundary = _in_floats(work.boundary, work.floats)
        self.forward_p2p = Boundary(boundary, self.mine[0].devices.index(rank), rank)
        self.backward_p2p = Boundary(boundary, self.mine[0].devices.index(rank), rank)

    def load(self) -> list[_Chunk]:
        """Each of its stages' device, its weights read (from its own file)."""
        rank, stages = self.rank, self.work.stages
        chunks = []
        for stage in self.mine:
            local, c = stage.devices.index(rank), int(stage.entry["index"])
            sha256 = stage.entry.get("sha256", [None] * len(stage.devices))[local]
            try:
                weights = read_weights(stage.folder, stage.manifest, local, sha256)
                steps = stage.manifest["devices"][local]["steps"]
                device = StageDevice(stage.partitioned, local, steps, stage.graph)
                device.held = start_tensors(stage.partitioned, stage.graph, local, weights)
                device.tied = frozenset(g for g, t in self.work.tied.items() if c in t["stages"])
                if stage.weight_ops:
                    device.split_backward(stage.weight_ops, stage.nodes)
            except Exception as error:  # a missing or bad file
                raise TrainingFailure(rank, 0, -1, "loading", str(error).splitlines()[0]) from None
            before = stages[c - 1].devices[local] if c else None
            after = stages[c + 1].devices[local] if c + 1 < len(stages) else None
            chunks.append(_Chunk(stage, local, device, before, after))
        return chunks

    def fail(self, position: int, cause: str) -> TrainingFailure:
        chunk = self.chunks[self.chunk]
        steps = chunk.steps
        what = describe(steps[position], chunk.stage.manifest) if position >= 0 else "loading"
        if len(self.chunks) > 1:
            what = f"chunk {chunk.stage.entry['index']}, {what}"
        return TrainingFailure(self.rank, self.step, position, what, cause)

    def train(self) -> tuple[Records, dict[str, object]]:
        work = self.work
        self.chunks = self.load()
        records: Records = []
        step_s = []
        passes = work.passes[int(self.mine[0].entry.get("position", self.mine[0].entry["index"]))]
        for self.step, feed in enumerate(work.feeds, start=1):
            self.progress[len(work.sha256) + self.rank] = self.step
            started, kept = time.perf_counter(), {}
            for one in passes:
                m, self.chunk = one.micro_batch, one.chunk
                if one.forward:
                    kept[m, one.chunk] = self.forward(feed[m], m, m == len(feed) - 1)
                elif one.weight:
                    self.weights(kept.pop((m, one.chunk)))
                else:
                    state = self.backward(kept.pop((m, one.chunk)), m, m == len(feed) - 1)
                    if state is not None:
                        kept[m, one.chunk] = state
            for chunk in self.tying:
                self.chunk = self.chunks.index(chunk)
                self.finish_tied(chunk)
            self.tying.clear()
            computed: dict[str, np.ndarray] = {}
            held: dict[str, np.ndarray] = {}
            for chunk in self.chunks:
                stage, device = chunk.stage, chunk.device
                device.total_losses(stage.checked.losses)
                outputs = dict(zip(stage.graph.outputs, stage.partitioned.program.outputs,
                                   strict=True))  # fmt: skip
                device.end(stage.graph.updates, outputs)
                computed |= {n: to_numpy(device.env[n]) for n in stage.checked.computed}
                held |= {n: to_numpy(device.held[n]) for n in stage.checked.held}
            for p2p in (self.forward_p2p, self.backward_p2p):
                self.p2p(p2p.wait)
            step_s.append(time.perf_counter() - started)
            records.append((computed, held))
        stages = [int(s.entry["index"]) for s in self.mine]
        return records, {**self.timing.to_json(), "step_s": step_s, "stages": stages}

    def tag(self, micro_batch: int, after: int) -> int:
        """The tag of micro-batch `m`'s messages across the boundary after stage (chunk)
        `after`, both ways: its number over the run, and the boundary's (a pair of ranks
        exchanges several chunks' values in an interleaved plan)."""
        count = (self.step - 1) * len(self.work.feeds[0]) + micro_batch
        return count * len(self.work.stages) + after

    def forward(self, feed: Mapping[str, np.ndarray], m: int, last: bool) -> Any:
        """Micro-batch `m`'s forward pass of the running chunk: receive, run, send on; its
        state kept."""
        chunk = self.chunks[self.chunk]
        stage, device, entry = chunk.stage, chunk.device, chunk.stage.entry
        c = int(entry["index"])
        received = self.p2p(lambda: self.forward_p2p.receive(entry["receives"], chunk.before, m,
                                                             self.tag(m, c - 1)))  # fmt: skip
        own = {n: a for n, a in feed.items() if n in stage.graph.inputs}
        inputs = local_inputs(stage.partitioned, chunk.local, own)
        device.begin(inputs | {n: to_torch(a) for n, a in received.items()}, last)
        self.run(chunk, forward_only=True)
        tensors = chunk.tensors
        sends = {n: to_numpy(self.made(device, tensors[n])) for n in entry["sends"]}
        self.p2p(lambda: self.forward_p2p.send(sends, chunk.after, m, self.tag(m, c)))
        return device.save()

    def backward(self, kept: Any, m: int, last: bool) -> Any:
        """Micro-batch `m`'s backward pass of the running chunk: receive its sends'
        gradients, run, send back; where the schedule splits it, its input gradient `B`
        only, its state kept for its `W` pass (`weights`)."""
        chunk = self.chunks[self.chunk]
        device, entry = chunk.device, chunk.stage.entry
        device.restore(kept)
        c = int(entry["index"])
        received = self.p2p(lambda: self.backward_p2p.receive(entry["seeded"], chunk.after, m,
                                                              self.tag(m, c)))  # fmt: skip
        device.env |= {seed_name(n): to_torch(a) for n, a in received.items()}
        self.run(chunk, forward_only=False)
        tensors = chunk.tensors
        back = {x: to_numpy(self.made(device, tensors[g])) for x, g in entry["sent_back"].items()}
        self.p2p(lambda: self.backward_p2p.send(back, chunk.before, m, self.tag(m, c - 1)))
        if not last:
            device.carry(chunk.stage.checked.losses)
        if self.split:
            return device.save()
        if device.paused or device.made_tied():  # summed once every pass has run
            self.tying.append(chunk)
        return None

    def weights(self, kept: Any) -> None:
        """A micro-batch's `W` pass of the running chunk: the weight gradients its backward
        passed over (`StageDevice.split_backward`), then, the last's, the sync and update."""
        chunk = self.chunks[self.chunk]
        device = chunk.device
        device.restore(kept)
        device.weight_pass = True
        self.run(chunk, forward_only=False)
        if device.paused or device.made_tied():  # summed once every pass has run
            self.tying.append(chunk)

    def finish_tied(self, chunk: _Chunk) -> None:
        """Sum the tied gradients the chunk's last backward made with the other stages' (the
        pass paused before their readers), then run the rest of the pass. Every rank does so
        after all its passes: a rank blocked in the sum mid-step could hold up the backward
        the other copy's stage waits for (an interleaved plan's other chunks)."""
        device = chunk.device
        while True:
            made = device.made_tied()
            for g in made:
                started = time.perf_counter()
                entry = self.work.tied[g]
                try:
                    result = self.collectives.run(entry, to_numpy(device.env[g]))
                except Exception as error:  # torch's own errors: a peer gone, a timeout
                    raise self.fail(device.position - 1, f"summing tied {entry['weight']!r}: "
                                    f"{str(error).strip().splitlines()[0]}") from None  # fmt: skip
                device.env[g] = to_torch(result).to(device.env[g].dtype)
                device.waiting.discard(g)
                stats = self.timing.collectives.setdefault("all_reduce", [0, 0.0, 0])
                stats[0] += 1
                stats[1] += time.perf_counter() - started
                stats[2] += result.nbytes
            if not device.paused:
                return
            if not made:
                raise self.fail(device.position, "it reads a tied gradient no step made")
            self.run(chunk, forward_only=False)

    def made(self, device: StageDevice, tensor: str) -> Any:
        if tensor not in device.env:
            raise self.fail(device.position - 1, f"its pass did not make {tensor!r}, which it "
                                                 "sends")  # fmt: skip
        return device.env[tensor]

    def p2p(self, send_or_receive: Any) -> Any:
        try:
            return send_or_receive()
        except StepFailure as error:
            raise _PeerFailure(self.rank, self.step, -1, error.what,
                               str(error).rpartition(": ")[2]) from None  # fmt: skip

    def run(self, chunk: _Chunk, forward_only: bool) -> None:
        """The chunk's pass: its ops and collectives up to the end of the pass."""
        device = chunk.device

        def at(position: int) -> None:
            self.progress[self.rank] = position

        device.forward_only = forward_only
        while True:
            computing = time.perf_counter()
            try:
                j = device.advance(self.step, chunk.stage.nodes, at)
            except VerifyError as error:  # a NaN, a tensor no step made
                cause = str(error).removeprefix(f"device {chunk.local}: ")
                raise self.fail(device.position - 1, cause) from None
            self.timing.compute_s += time.perf_counter() - computing
            if j is None:
                return
            self.collective(chunk, j)

    def collective(self, chunk: _Chunk, j: int) -> None:
        """Collective `j` of the chunk's list among its stage's devices, its result in place."""
        entry = self.work.collectives["collectives"][j + chunk.stage.offset]
        run_collective(chunk.device, j, entry, self.rank, self.collectives, self.timing, self.fail)


def _in_floats(boundary: Mapping[str, Any], floats: str) -> dict[str, Any]:
    """The boundary block with its float values sent as the run computes them: float64 in a
    float64 run, float32 otherwise (a bfloat16 tensor leaves as float32, `to_numpy`)."""
    wide = "float64" if floats == "float64" else "float32"
    return {n: dict(b) | ({"dtype": wide} if "float" in b["dtype"] else {})
            for n, b in boundary.items()}  # fmt: skip


def schedule_passes(pipeline: Mapping[str, Any]) -> tuple[tuple[Pass, ...], ...]:
    """Each pipeline position's passes in the schedule's order (an interleaved plan's, of its
    chunks, `cost.schedule.order`)."""
    schedule = Schedule.parse(str(pipeline["schedule"]))
    if int(pipeline.get("virtual", 1)) != schedule.virtual:  # a folder of one chunk a device
        schedule = Schedule(ScheduleKind.ONE_F_ONE_B)
    stages = len(pipeline["stages"]) // schedule.virtual
    shape = Pipeline(stages, int(pipeline["micro_batches"]), schedule)
    return tuple(order(shape, s) for s in range(stages))


def run_pipelined_training(
    out: str | os.PathLike[str],
    model: str | os.PathLike[str],
    steps: int = 3,
    backend: str = "gloo",
    inputs: Mapping[str, np.ndarray] | None = None,
    timeout_s: float = 60.0,
    seed: int = 0,
    floats: str = "float32",
    loss: str | None = None,
) -> TrainingReport:
    """Train pipelined training partition `out` `steps` steps as one process per device of
    its whole mesh and check every step against PyTorch autograd on `model` (module
    docstring); `loss`: the one asked for, which must be the plan's (None: the plan's)."""
    from autoshard.run.launch import launch_work

    if torch_rank() is not None:
        raise RunSetupError(
            f"'{out}' is a pipelined training partition: run it without torchrun (autoshard "
            "run starts one process per device itself)"
        )
    if floats not in FLOATS:
        raise RunSetupError(f"unknown float type {floats!r}; valid: {', '.join(FLOATS)}")
    if backend != "gloo":
        raise RunSetupError(
            f"a pipelined training step runs on gloo (its sends move CPU tensors); got {backend!r}"
        )
    folder = Path(out)
    manifest = read_manifest(folder)
    pipeline = manifest["pipeline"]
    if manifest["shape_only"]:
        raise RunSetupError(f"'{out}' is the partition of a shape-only model: nothing to run")
    check_model(manifest, model)
    staged, training = _rebuild(folder, manifest, model)
    check_training(training, loss)
    floats = floats_of(training, floats)
    stages = _stage_works(folder, manifest, staged)
    collectives = global_steps([s.manifest for s in stages], [s.devices for s in stages],
                               len(manifest["devices"]))  # fmt: skip
    feeds = pipeline_feeds(stages, pipeline, steps, seed, inputs)
    sha256 = tuple(d["sha256"] for d in manifest["devices"])
    passes = schedule_passes(pipeline)
    tied = tied_collectives(pipeline, len(sha256))
    collectives["collectives"] += list(tied.values())  # their groups made on every rank
    work = PipelineTrainingWork(stages, collectives, pipeline["boundary"], passes, feeds,
                                backend, sha256, floats, tied)  # fmt: skip
    started = time.perf_counter()
    gathered = launch_work(work, len(sha256), timeout_s)
    wall = time.perf_counter() - started
    checks = pipeline_checks(model, stages, training, floats, feeds, gathered)
    ranks = [{"rank": r, **timing} for r, (_, timing) in enumerate(gathered)]
    timing = {"wall_s": wall, "backend": backend, "ranks": ranks}
    return TrainingReport(tuple(checks), len(sha256), steps, timing, floats)


def tied_collectives(pipeline: Mapping[str, Any], world: int) -> dict[str, dict[str, Any]]:
    """Each tied weight's all-reduce (`execute.tied`), by its gradient."""
    found = {}
    for entry in pipeline.get("tied", ()):
        tied = Tied(entry["weight"], entry["gradient"], tuple(entry["stages"]),
                    tuple(tuple(g) for g in entry["groups"]))  # fmt: skip
        shapes = entry["local_shapes"]
        found[tied.gradient] = tied.collective(entry["dtype"], shapes, world) | {
            "weight": tied.weight,
            "stages": list(tied.stages),
        }
    return found


def _rebuild(
    folder: Path, manifest: Mapping[str, Any], model: str | os.PathLike[str]
) -> tuple[PipelinedPartition, Training]:
    """The stages' training steps rebuilt from the plan the folder keeps, checked against
    the folder's step manifests."""
    from autoshard.document.plan_document import read_document
    from autoshard.execute.artifacts import PartitionFolderError
    from autoshard.execute.stage_training import training_partition

    pipeline = manifest["pipeline"]
    path = folder / str(pipeline.get("plan", PLAN_COPY))
    if not path.is_file():
        raise PartitionFolderError(f"'{folder}' lacks the plan it was partitioned from ({path})")
    staged, training = training_partition(read_document(path), path, Path(model), manifest["dims"])
    for stage, entry in zip(staged.stages, pipeline["stages"], strict=True):
        steps = read_steps(folder / entry["folder"])
        if [o["name"] for o in steps["outputs"]] != list(stage.built.graph.outputs):
            raise PartitionFolderError(
                f"stage {entry['index']}'s steps in '{folder}' are not its plan's training step "
                "now; partition again"
            )
    return staged, training


def _stage_works(
    folder: Path, manifest: Mapping[str, Any], staged: PipelinedPartition
) -> tuple[StageWork, ...]:
    works, offset = [], 0
    for stage, entry in zip(staged.stages, manifest["pipeline"]["stages"], strict=True):
        here = folder / entry["folder"]
        steps = read_steps(here)
        graph = stage.built.graph
        works.append(StageWork(here, graph, stage.built.partitioned, steps,
                               segment_nodes(here, steps), tuple(entry["devices"]), entry,
                               Checked.of(graph), offset, stage.weight_ops))  # fmt: skip
        offset += len(steps["collectives"])
    return tuple(works)


def pipeline_feeds(
    stages: Sequence[StageWork], pipeline: Mapping[str, Any], steps: int, seed: int,
    inputs: Mapping[str, np.ndarray] | None,
) -> list[list[dict[str, np.ndarray]]]:  # fmt: skip
    """Each step's inputs of the whole model, one set per micro-batch (`train_verify.
    feeds_of`): the model's inputs, then the labels of a cross-entropy loss."""
    found = {s.name: s for stage in stages for s in input_specs(stage.graph)}
    names = [i["name"] for i in pipeline["inputs"]] + [LABELS]
    specs = [found[n] for n in names if n in found]
    classes = label_classes(stages[-1].graph)
    return feeds_of(specs, classes, int(pipeline["micro_batches"]), steps, seed, inputs)


def pipeline_checks(
    model: str | os.PathLike[str], stages: Sequence[StageWork], training: Training,
    floats: str, feeds: Sequence[Sequence[Mapping[str, np.ndarray]]], gathered: list[Any],
) -> list[Check]:  # fmt: skip
    """Every step's checks of every stage against the reference of the whole model, each
    step from the weights and states the ranks hold after the step before; a shard's check
    names its whole-mesh rank, the loss is checked where it is taken (the last stage)."""
    trained = tuple(w for s in stages for w in s.checked.trained)
    whole = dataclasses.replace(stages[-1].checked, trained=trained)
    reference = reference_of(model, whole, training, floats)
    checks: list[Check] = []
    start = None
    for k, feed in enumerate(feeds, start=1):
        want = reference.step(feed, start)
        weights: dict[str, np.ndarray] = {}
        states: dict[str, np.ndarray] = {}
        for stage in stages:
            computed = [gathered[r][0][k - 1][0] for r in stage.devices]
            held = [gathered[r][0][k - 1][1] for r in stage.devices]
            found = step_checks(stage.partitioned, stage.checked, k, want, computed, held,
                                tolerance_of(floats))  # fmt: skip
            checks += [
                dataclasses.replace(c, rank=None if c.rank is None else stage.devices[c.rank])
                for c in found
                if c.what != "loss" or stage.checked.losses
            ]
            w, s = held_start(stage.partitioned, stage.checked, held)
            weights |= w
            states |= s
        start = (weights, states)
    return checks
