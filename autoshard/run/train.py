"""`autoshard run` of a training step's partition: N steps, one process per device on
torch.distributed, checked against PyTorch autograd.

    run_training(OUT, MODEL, steps=3, backend="gloo") -> TrainingReport

Each rank runs what the in-process `verify` runs for its device (`TrainingDevice` of
`execute.train_verify`: the same step list, the same torch forms of the same local ops, its
weights from its own file), and only its collectives differ: here they run on
torch.distributed (`collectives.Executor`, as inference runs do), there they are simulated.
After every step a rank keeps the tensors the checks read (`train_check.Checked`: its loss
terms, its gradients, its weights and optimizer states after the update); rank 0 gathers them
and the launcher compares them, step by step, with the single-process reference
(`train_check.ReferenceRun`, each step from what the ranks hold after the step before), as
`verify` does.

Failures are one line naming the rank and the training step, then where in its step list and
the cause: a NaN made by an op (a gradient op names its parameter), a collective whose partner
is gone, a rank that dies (its place read from the progress the ranks share); the launcher
stops every other rank (`launch.launch_work`). A mismatch against the reference is a failed
check naming the step, the rank, the parameter and the difference.

Timings per rank: each training step's wall time and compute (torch ops), and each collective
kind's count, seconds and bytes, summed over the steps.
"""

from __future__ import annotations

import datetime
import os
import time
import types
from collections.abc import Mapping, MutableSequence, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

# torch.autograd.grad imports this module (and sympy under it) on its first call with a given
# gradient: imported here, the forkserver that preloads this module holds it, and no rank of
# any run imports it again in its first training step.
import torch.fx.experimental.symbolic_shapes  # noqa: F401

from autoshard.execute.artifacts import load_partition
from autoshard.execute.steps import read_steps
from autoshard.execute.train_check import (
    FLOATS,
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
from autoshard.execute.train_verify import (
    TrainingDevice,
    local_inputs,
    segment_nodes,
    start_tensors,
    training_feeds,
)
from autoshard.execute.verify import VerifyError
from autoshard.ir.graph import Graph
from autoshard.passes.partition import Partitioned
from autoshard.pipeline import Built
from autoshard.run.collectives import Executor
from autoshard.run.rank import Rendezvous, StepFailure, Timing, describe, read_weights


def _view(values: dict[Any, Any]) -> Mapping[Any, Any]:
    return types.MappingProxyType(values)


def _send_view(view: Mapping[Any, Any]) -> tuple[Any, tuple[dict[Any, Any]]]:
    return _view, (dict(view),)


# The partition and the graph hold read-only views of dicts: multiprocessing's pickler (only
# it) sends one to a rank as a view of a copy.
ForkingPickler.register(types.MappingProxyType, _send_view)

Records = list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]
"""Per training step: (the step's tensors the checks read, those held after it)."""


class TrainingFailure(StepFailure):
    """A rank that could not go on with training step `training_step`."""

    def __init__(self, rank: int, training_step: int, position: int, what: str, cause: str):
        super().__init__(rank, position, what, cause)
        where = f"step {position} of its list ({what})" if position >= 0 else what
        self.args = (f"rank {rank} failed in training step {training_step}, {where}: {cause}",)
        self.training_step = training_step

    @property
    def own(self) -> bool:
        """Its own cause (loading, an op), not a collective that lost its partner."""
        return self.what == "loading" or not self.what.startswith(("all_", "reduce_", "permute"))


@dataclass(frozen=True)
class TrainingWork:
    """Every rank's share of a distributed training run (sent to each rank once)."""

    folder: Path
    manifest: Mapping[str, Any]  # steps.json
    partitioned: Partitioned
    graph: Graph
    nodes: Mapping[str, list[tuple[str, str]]]
    feeds: Sequence[Sequence[Mapping[str, np.ndarray]]]  # per step, per micro-batch
    checked: Checked
    backend: str
    sha256: tuple[str | None, ...]
    floats: str = "float32"
    preload: str = "autoshard.run.train"

    def __call__(
        self, rank: int, rendezvous: Rendezvous, progress: MutableSequence[int]
    ) -> list[tuple[Records, dict[str, object]]] | None:
        return train_rank(self, rank, rendezvous, progress)

    def where(self, rank: int, position: int, step: int) -> str:
        steps = self.manifest["devices"][rank]["steps"]
        if step < 1 or not 0 <= position < len(steps):
            return "start"
        return f"training step {step}, step {position} ({describe(steps[position], self.manifest)})"


def train_rank_join(rank: int, world: int, backend: str, rendezvous: Rendezvous) -> None:
    """Join the process group as `rank` of `world` (one thread each: the ranks share the
    host's cores); a failure is a `TrainingFailure` of training step 0."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        _join(rank, world, backend, rendezvous)
    except Exception as error:  # torch's own errors
        raise TrainingFailure(rank, 0, -1, "joining the process group", _line(error)) from None


def _join(rank: int, world: int, backend: str, rendezvous: Rendezvous) -> None:
    timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
    store = rendezvous.store(world, rendezvous.host_store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def train_rank(
    work: TrainingWork, rank: int, rendezvous: Rendezvous, progress: MutableSequence[int]
) -> list[tuple[Records, dict[str, object]]] | None:
    """Join the process group, train this rank's device every step, gather each rank's
    records and timings to rank 0 (which returns them; the others None)."""
    world = len(work.manifest["devices"])
    # The ranks share the host's cores: one thread each, not each as many as the host has.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        _join(rank, world, work.backend, rendezvous)
        collectives = Executor(work.manifest, rank, work.backend)
    except Exception as error:  # torch's own errors
        raise TrainingFailure(rank, 0, -1, "joining the process group", _line(error)) from None
    try:
        with computing_in(work.floats):
            records, timing = _train(work, rank, collectives, progress)
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        try:
            dist.gather_object((records, timing), gathered, dst=0)
        except Exception as error:  # torch's own errors
            raise TrainingFailure(rank, len(work.feeds), -1, "gathering to rank 0",
                                  _line(error)) from None  # fmt: skip
        return gathered
    finally:
        dist.destroy_process_group()


def _train(
    work: TrainingWork, rank: int, collectives: Executor, progress: MutableSequence[int]
) -> tuple[Records, dict[str, object]]:
    world = len(work.manifest["devices"])
    steps = work.manifest["devices"][rank]["steps"]
    step = 0

    def fail(position: int, cause: str) -> TrainingFailure:
        what = describe(steps[position], work.manifest) if position >= 0 else "loading"
        return TrainingFailure(rank, step, position, what, cause)

    try:
        weights = read_weights(work.folder, work.manifest, rank, work.sha256[rank])
        device = TrainingDevice(work.partitioned, rank, steps, work.graph)
        device.held = start_tensors(work.partitioned, work.graph, rank, weights)
    except Exception as error:  # a missing or bad file
        raise fail(-1, _line(error)) from None
    outputs = dict(zip(work.graph.outputs, work.partitioned.program.outputs, strict=True))

    def at(position: int) -> None:
        progress[rank] = position

    timing, step_s, compute_s = Timing(), [], []
    records: Records = []
    for step, feed in enumerate(work.feeds, start=1):
        progress[world + rank] = step
        started, computed = time.perf_counter(), timing.compute_s
        for k, micro_batch in enumerate(feed, start=1):  # the last syncs and updates
            device.begin(local_inputs(work.partitioned, rank, micro_batch), k == len(feed))
            while True:
                computing = time.perf_counter()
                try:
                    j = device.advance(step, work.nodes, at)
                except VerifyError as error:  # a NaN, a tensor no step made
                    cause = str(error).removeprefix(f"device {rank}: ")
                    raise fail(device.position - 1, cause) from None
                timing.compute_s += time.perf_counter() - computing
                if j is None:
                    break
                entry = work.manifest["collectives"][j]
                run_collective(device, j, entry, device.program.index, collectives, timing, fail)
            if k < len(feed):
                device.carry(work.checked.losses)
        device.total_losses(work.checked.losses)
        device.end(work.graph.updates, outputs)
        step_s.append(time.perf_counter() - started)
        compute_s.append(timing.compute_s - computed)
        records.append(
            (
                {n: to_numpy(device.env[n]) for n in work.checked.computed},
                {n: to_numpy(device.held[n]) for n in work.checked.held},
            )
        )
    return records, {**timing.to_json(), "step_s": step_s, "step_compute_s": compute_s}


def run_collective(
    device: TrainingDevice, j: int, entry: Mapping[str, Any], rank: int,
    collectives: Executor, timing: Timing, fail: Any,
) -> None:  # fmt: skip
    """Collective `j` of the device's list on torch.distributed (`entry`, the manifest's; its
    target shape `rank`'s), its result in place, its time and bytes in `timing`."""
    started = time.perf_counter()
    local = device.collectives[j]
    source = to_numpy(device.env[local.source])  # bfloat16 as float32: numpy has none
    try:
        result = collectives.run(entry, source)
    except Exception as error:  # torch's own errors: a peer gone, a timeout
        raise fail(device.position - 1, _line(error)) from None
    want = tuple(entry["target_shapes"][rank])
    if result.shape != want:
        raise fail(device.position - 1, f"result has local shape {list(result.shape)}; "
                                        f"expected {list(want)}")  # fmt: skip
    device.env[local.target] = to_torch(result).to(device.env[local.source].dtype)
    stats = timing.collectives.setdefault(entry["kind"], [0, 0.0, 0])
    stats[0] += 1
    stats[1] += time.perf_counter() - started
    stats[2] += source.nbytes


def _line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def run_training(
    out: str | os.PathLike[str],
    model: str | os.PathLike[str],
    dims: Mapping[str, int] | None = None,
    steps: int = 3,
    backend: str = "gloo",
    inputs: Mapping[str, np.ndarray] | None = None,
    timeout_s: float = 60.0,
    seed: int = 0,
    floats: str = "float32",
    loss: str | None = None,
    built: Built | None = None,
) -> TrainingReport:
    """Train the partition of folder `out` `steps` steps as one process per device and check
    every step against PyTorch autograd on `model` (module docstring); `loss`: the one asked
    for, which must be the plan's (None: the plan's); `built`: the partition the folder holds
    when the caller has it (`execute.artifacts.write_built`'s; None: rebuilt from `model`)."""
    from autoshard.document.blocks import training_of
    from autoshard.run import RunSetupError, torch_rank
    from autoshard.run.launch import launch_work

    if torch_rank() is not None:
        raise RunSetupError(
            "a training step's partition is run by autoshard run itself, one process per "
            "device on this host: start it once, not under torchrun"
        )
    if floats not in FLOATS:
        raise RunSetupError(f"unknown float type {floats!r}; valid: {', '.join(FLOATS)}")
    if backend not in ("gloo", "nccl"):
        raise RunSetupError(f"unknown backend {backend!r}; valid: gloo, nccl")
    built, _, partition = load_partition(out, model, dims or {}, built)
    training = training_of(partition, "the manifest")
    if training is None:
        raise VerifyError(f"'{out}' is the partition of a forward pass: run it without --model")
    check_training(training, loss)
    folder, graph = Path(out), built.graph
    manifest = read_steps(folder)
    checked = Checked.of(graph)
    feeds = training_feeds(graph, steps, seed, inputs)
    floats = floats_of(training, floats)
    sha256 = tuple(d.get("sha256") for d in partition["devices"])
    work = TrainingWork(folder, manifest, built.partitioned, graph, segment_nodes(folder, manifest),
                        feeds, checked, backend, sha256, floats)  # fmt: skip
    started = time.perf_counter()
    gathered = launch_work(work, len(manifest["devices"]), timeout_s)
    wall = time.perf_counter() - started
    reference = reference_of(model, checked, training, floats)
    checks, start = [], None
    for k, feed in enumerate(feeds, start=1):
        computed = [records[k - 1][0] for records, _ in gathered]
        held = [records[k - 1][1] for records, _ in gathered]
        want = reference.step(feed, start)
        checks += step_checks(built.partitioned, checked, k, want, computed, held,
                              tolerance_of(floats))  # fmt: skip
        start = held_start(built.partitioned, checked, held)
    ranks = [{"rank": r, **timing} for r, (_, timing) in enumerate(gathered)]
    timing = {"wall_s": wall, "backend": backend, "ranks": ranks}
    return TrainingReport(tuple(checks), len(gathered), steps, timing, floats)
