"""One rank of `autoshard run`: its device's steps, with onnxruntime and torch.distributed.

A rank reads the step manifest (steps.json), its own weight file (checked against the
partition manifest's sha256), slices its part of the graph inputs, and follows its steps: a
segment runs as an onnxruntime session, a collective as `collectives.Executor` says. Every
result is checked against the local shape the partition gave it. The outputs and the rank's
timings go to rank 0 (`gather_object`), which returns them.

A failure names the rank, the step (its index and what it is) and the cause; `progress[rank]`
holds the step a rank is at, so a rank killed from outside can be named with its step too.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from collections.abc import Mapping, MutableSequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch.distributed as dist

from autoshard.errors import AutoshardError
from autoshard.execute.verify import session_options
from autoshard.files import sha256_file
from autoshard.run.collectives import Executor
from autoshard.weights import read_safetensors


class RunError(AutoshardError):
    """A run that could not start or did not finish (the message names the rank and step)."""


class StepFailure(RunError):
    """A rank that could not go on: `step` is the index in its steps (-1: before the first)."""

    def __init__(self, rank: int, step: int, what: str, cause: str) -> None:
        where = f"step {step} ({what})" if step >= 0 else what
        super().__init__(f"rank {rank} failed at {where}: {cause}")
        self.rank, self.step, self.what = rank, step, what

    @property
    def own(self) -> bool:
        """Its own cause (loading, a segment), not a peer's echo (a collective that failed)."""
        return self.what == "loading" or self.what.startswith("segment ")


@dataclass
class Timing:
    """A rank's wall time: compute (its segments) and each collective kind (count, seconds,
    bytes it held before the collective)."""

    compute_s: float = 0.0
    segments: int = 0
    collectives: dict[str, list[float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {
            "compute_s": self.compute_s,
            "segments": self.segments,
            "collectives": {
                kind: {"count": int(c), "seconds": s, "bytes": int(b)}
                for kind, (c, s, b) in sorted(self.collectives.items())
            },
        }


def describe(step: Mapping[str, Any], manifest: Mapping[str, Any]) -> str:
    """What a step is, for messages: `segments/3f2a….onnx` or `all_gather of 'x' over mesh
    axes [0]`."""
    if "run" in step:
        return f"segment {step['run']}"
    entry = manifest["collectives"][step["collective"]]
    return f"{entry['kind']} of {entry['source']!r} over mesh axes {entry['mesh_axes']}"


def _providers() -> list[Any]:
    if "CUDAExecutionProvider" in ort.get_available_providers():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return [("CUDAExecutionProvider", {"device_id": local}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def read_weights(folder: Path, manifest: Mapping[str, Any], rank: int, sha256: str | None) -> dict:
    device = manifest["devices"][rank]
    if not manifest["weights"]:
        return {}
    path = folder / str(device["weights"])
    if not path.is_file():
        raise FileNotFoundError(f"weight file '{path}' is missing")
    if sha256 is not None and sha256_file(path) != sha256:
        raise ValueError(f"weight file '{path}' does not match the manifest's sha256")
    arrays = read_safetensors(path)
    missing = [n for n in manifest["weights"] if n not in arrays]
    if missing:
        raise ValueError(f"weight file '{path}' lacks {', '.join(missing[:3])}")
    return arrays


@dataclass(frozen=True)
class Loaded:
    """A device's weights (from its own file) and a session per segment it runs."""

    weights: Mapping[str, np.ndarray]
    sessions: Mapping[str, Any]


def load_device(
    folder: Path, manifest: Mapping[str, Any], rank: int, sha256: str | None = None
) -> Loaded:
    """Device `rank`'s weights and sessions (a failure names the rank, at loading)."""
    steps = manifest["devices"][rank]["steps"]
    try:
        weights = read_weights(folder, manifest, rank, sha256)
        sessions = {
            s["run"]: ort.InferenceSession(
                os.fspath(folder / s["run"]), session_options(), providers=_providers()
            )
            for s in steps
            if "run" in s
        }
    except Exception as error:  # a missing or bad file, onnxruntime's own errors
        raise StepFailure(rank, -1, "loading", first_line(error)) from None
    return Loaded(weights, sessions)


def execute(
    folder: Path,
    manifest: Mapping[str, Any],
    rank: int,
    feed: Mapping[str, np.ndarray],
    collectives: Executor,
    progress: MutableSequence[int] | None = None,
    sha256: str | None = None,
    local: Mapping[str, np.ndarray] | None = None,
    loaded: Loaded | None = None,
) -> tuple[dict[str, np.ndarray], Timing]:
    """Run device `rank`'s steps; its outputs (local arrays, by program tensor name).
    `local`: inputs given as this device's shard already (a pipeline stage's received
    values), not sliced from `feed`; `loaded`: its weights and sessions, loaded once for
    several runs (a pipeline's micro-batches)."""
    device = manifest["devices"][rank]
    steps = device["steps"]
    at = -1

    def fail(cause: str) -> StepFailure:
        what = describe(steps[at], manifest) if at >= 0 else "loading"
        return StepFailure(rank, at, what, cause)

    loaded = loaded or load_device(folder, manifest, rank, sha256)
    sessions = loaded.sessions
    env: dict[str, np.ndarray] = dict(loaded.weights)
    try:
        for name, region in device["inputs"].items():
            if local is not None and name in local:
                env[name] = local[name]
                continue
            env[name] = np.ascontiguousarray(feed[name][tuple(slice(a, b) for a, b in region)])
    except Exception as error:  # an input of another shape than the partition's
        raise fail(first_line(error)) from None
    timing = Timing()
    for at, step in enumerate(steps):
        if progress is not None:
            progress[rank] = at
        started = time.perf_counter()
        try:
            if "run" in step:
                feeds = {n: env[n] for n in step["inputs"]}
                results = sessions[step["run"]].run(step["outputs"], feeds)
                env.update(zip(step["outputs"], results, strict=True))
                timing.compute_s += time.perf_counter() - started
                timing.segments += 1
                continue
            entry = manifest["collectives"][step["collective"]]
            source = env[entry["source"]]
            result = collectives.run(entry, source)
            want = tuple(entry["target_shapes"][rank])
            if result.shape != want:
                raise ValueError(
                    f"result has local shape {list(result.shape)}; expected {list(want)}"
                )
            env[entry["target"]] = result
        except StepFailure:
            raise
        except Exception as error:  # onnxruntime's and torch's errors are untyped
            raise fail(first_line(error)) from None
        stats = timing.collectives.setdefault(entry["kind"], [0, 0.0, 0])
        stats[0] += 1
        stats[1] += time.perf_counter() - started
        stats[2] += source.nbytes
    outputs = {o["tensor"]: np.asarray(env[o["tensor"]]) for o in manifest["outputs"]}
    return outputs, timing


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


@dataclass(frozen=True)
class Rendezvous:
    """Where ranks meet: a TCP store (host, port) and the collective timeout."""

    host: str
    port: int
    timeout_s: float
    host_store: bool = False  # this rank serves the store (rank 0 outside a launcher)
    watch: bool = False  # no launcher watches the ranks (torchrun): they watch each other

    def store(self, world: int, master: bool = False) -> Any:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        client = dist.TCPStore(self.host, self.port, world, master, timeout=timeout)
        # Keys apart from those of whoever else uses the store (torchrun's agent).
        return dist.PrefixStore("autoshard", client)


ABORT = "abort"
WATCH_S = 0.25
"""How often a rank looks whether another one failed (under torchrun)."""


def _watch(rendezvous: Rendezvous, rank: int, world: int, failed: threading.Event) -> None:
    """Under torchrun no launcher stops the ranks: a failing rank leaves its message in the
    store, and every rank's watcher thread ends its process when it sees one (or loses the
    store, served by rank 0), within a fraction of a second, instead of waiting out a
    collective's timeout."""
    try:
        store = rendezvous.store(world)
        while not store.check([ABORT]):
            time.sleep(WATCH_S)
        message = store.get(ABORT).decode()
    except Exception:  # the store is gone: its host (rank 0) ended
        message = f"the rendezvous store at {rendezvous.host}:{rendezvous.port} is gone"
    if failed.is_set():  # this rank's own failure: its main thread tells it
        return
    print(f"autoshard: error: rank {rank} stopped: {message}", file=sys.stderr, flush=True)
    os._exit(1)


def run_rank(
    folder: Path,
    manifest: Mapping[str, Any],
    rank: int,
    feed: Mapping[str, np.ndarray],
    backend: str,
    rendezvous: Rendezvous,
    progress: MutableSequence[int] | None = None,
    sha256: str | None = None,
) -> list[tuple[dict[str, np.ndarray], dict[str, object]]] | None:
    """Join the process group, run this rank's steps, gather outputs and timings to rank 0:
    rank 0 returns every rank's (outputs, timing), the others None."""
    world = len(manifest["devices"])
    timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
    try:
        store = rendezvous.store(world, rendezvous.host_store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        collectives = Executor(manifest, rank, backend)
    except Exception as error:  # torch's own errors
        raise StepFailure(rank, -1, "joining the process group", first_line(error)) from None
    failed = threading.Event()
    if rendezvous.watch:
        watcher = threading.Thread(target=_watch, args=(rendezvous, rank, world, failed))
        watcher.daemon = True
        watcher.start()
    try:
        outputs, timing = execute(folder, manifest, rank, feed, collectives, progress, sha256)
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        try:
            dist.gather_object((outputs, timing.to_json()), gathered, dst=0)
        except Exception as error:  # torch's own errors
            raise StepFailure(rank, -1, "gathering outputs to rank 0", first_line(error)) from None
        return gathered
    except StepFailure as failure:
        if rendezvous.watch:
            failed.set()
            store.set(ABORT, str(failure))
        raise
    finally:
        dist.destroy_process_group()
