"""`autoshard run`: start one process per device, watch them, reassemble and check the outputs.

On one host the ranks are child processes (multiprocessing's forkserver: torch and
onnxruntime are imported once, in the server, and each rank is a fork of it). They meet at a
TCP store the launcher serves on a port the kernel picks free (port 0), so concurrent runs
never collide. Under `torchrun` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) the same
command runs the one rank of this process and meets the others at MASTER_ADDR:MASTER_PORT.

Failure: every rank sends the launcher one message, its result or its failure (rank, step,
cause). On the first failure, or a rank that dies without a word (killed: its step is read
from a shared array the ranks update), the launcher stops every other rank (SIGTERM, then
SIGKILL after a grace period) and raises one error naming the rank, the step and the cause.
Of several failures the rank's own (loading, a segment) is told before those of its peers
(a collective that lost its partner). Collectives time out after `timeout_s` (gloo and NCCL
honour the process group's timeout), so a lost rank never hangs the others for long. No
child outlives the launcher: they are daemons, and the launcher's `finally` kills them.

Python starts one forkserver per process and fixes its preload then, so it preloads every
kind of run's rank module (`RANK_MODULES`) besides the one asked for: a process that runs
several kinds (a test session, a bench) would otherwise have every rank of the kinds but the
first import its module anew.
The forkserver is started on this process's autoshard (`forkserver`): Python starts it as
`python -c`, which puts the working directory first on its path, so run from a folder holding
an `autoshard/` (the parent of a clone) its ranks would import that one instead. Ranks start
without running this process's main script again (`without_main_script`): they run autoshard's
functions, and multiprocessing would otherwise run a console script anew in every rank.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import signal
import site
import sys
import time
from collections.abc import Iterator, Mapping, MutableSequence, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Protocol

import numpy as np

import autoshard
from autoshard.run.rank import Rendezvous, RunError, StepFailure, describe, run_rank

Gathered = list[tuple[dict[str, np.ndarray], dict[str, object]]]
GRACE_S = 3.0
"""How long a stopped rank has to end after SIGTERM before SIGKILL."""
RANK_MODULES = (
    "autoshard.run.rank", "autoshard.run.train", "autoshard.run.measure", "autoshard.run.pipetrain",
)  # fmt: skip
"""What the forkserver imports before forking any rank: the modules of autoshard's ranks."""


class Work(Protocol):
    """What each rank runs (picklable: the forkserver sends it to every child): `__call__`
    runs rank `rank` (its result goes to the launcher), `where` names a dead rank's place from
    its progress (the position in its steps, and the training step; -1: not started)."""

    @property
    def preload(self) -> str:
        """The module the forkserver imports before forking the ranks."""

    def __call__(
        self, rank: int, rendezvous: Rendezvous, progress: MutableSequence[int]
    ) -> Any: ...

    def where(self, rank: int, position: int, step: int) -> str: ...


@dataclass(frozen=True)
class _Forward:
    """A forward pass's rank: `run_rank` on its steps."""

    folder: Path
    manifest: Mapping[str, Any]
    feed: Mapping[str, np.ndarray]
    backend: str
    sha256: tuple[str | None, ...]
    preload: str = "autoshard.run.rank"

    def __call__(self, rank: int, rendezvous: Rendezvous, progress: MutableSequence[int]) -> Any:
        return run_rank(self.folder, self.manifest, rank, self.feed, self.backend, rendezvous,
                        progress, self.sha256[rank])  # fmt: skip

    def where(self, rank: int, position: int, step: int) -> str:
        steps = self.manifest["devices"][rank]["steps"]
        if 0 <= position < len(steps):
            return f"step {position} ({describe(steps[position], self.manifest)})"
        return "start"


def _child(
    work: Work,
    rank: int,
    rendezvous: Rendezvous,
    progress: MutableSequence[int],
    conn: Connection,
) -> None:
    code = 0
    try:
        conn.send(("ok", work(rank, rendezvous, progress)))
    except StepFailure as failure:
        conn.send(("error", str(failure), failure.own))
        code = 1
    except BaseException as error:  # anything else still ends as a message, not a hang
        conn.send(("error", f"rank {rank} failed: {type(error).__name__}: {error}", True))
        code = 1
    finally:
        conn.close()
    os._exit(code)  # skip interpreter teardown: torch's atexit hooks may wait on peers


def forkserver(preload: Sequence[str] = ()) -> multiprocessing.context.ForkServerContext:
    """multiprocessing's forkserver context, its server running (started here if it is not)
    with `RANK_MODULES` and `preload` imported from the autoshard of this process, whatever the
    working directory holds: the server's path leaves the working directory out
    (PYTHONSAFEPATH) and starts with the folder of this autoshard (unless that is
    site-packages, found anyway)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(dict.fromkeys([*RANK_MODULES, *preload])))
    root = str(Path(autoshard.__file__).resolve().parent.parent)
    given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    installed = [*site.getsitepackages(), site.getusersitepackages()]
    paths = given if root in installed else [root, *given]
    with _environment(PYTHONPATH=os.pathsep.join(paths), PYTHONSAFEPATH="1"):
        multiprocessing.forkserver.ensure_running()
    return context


@contextlib.contextmanager
def without_main_script() -> Iterator[None]:
    """Processes started inside skip running this process's main script again.
    multiprocessing runs a main script (not a `-m` module) anew in every child, in case what
    the child runs lives there, and the parent's `start` waits until the child has read its
    work, after that run: under a console script (`pytest`, `autoshard`) every rank imported
    it afresh, one rank after another. A rank runs autoshard's functions, never the script's."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or getattr(main, "__spec__", None) is not None:
        yield
        return
    del main.__file__  # what multiprocessing reads the script's path from
    try:
        yield
    finally:
        main.__file__ = path


def start_ranks(
    context: Any,
    target: Any,
    args: Sequence[tuple[Any, ...]],
    name: str,
    processes: list[Any],
    pipes: list[Connection],
) -> None:
    """Start a daemon process per rank, `target(*args[rank], sender)`, the main script hidden
    (`without_main_script`); each process and the receiving end of its pipe are appended as it
    starts, so the caller's cleanup stops those started before a failure."""
    with without_main_script():
        for rank, given in enumerate(args):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(
                target=target, args=(*given, sender), name=f"{name}-{rank}", daemon=True
            )
            process.start()
            sender.close()
            pipes.append(receiver)
            processes.append(process)


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """These environment variables set for the processes started inside, then restored."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def launch(
    folder: Path,
    manifest: Mapping[str, Any],
    feed: Mapping[str, np.ndarray],
    backend: str,
    timeout_s: float,
    sha256: Sequence[str | None],
) -> Gathered:
    """Run every rank of a forward pass as a child process on this host; rank 0's gathered
    result."""
    work = _Forward(folder, manifest, feed, backend, tuple(sha256))
    return launch_work(work, len(manifest["devices"]), timeout_s)  # type: ignore[no-any-return]


def launch_work(work: Work, world: int, timeout_s: float) -> Any:
    """Run `work` as `world` ranks, each a child process on this host; rank 0's result."""
    import datetime

    import torch.distributed as dist

    context = forkserver([work.preload])
    store = dist.TCPStore(
        "127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )  # fmt: skip
    rendezvous = Rendezvous("127.0.0.1", store.port, timeout_s)
    # Per rank: its position in its steps (first `world`), then its training step.
    progress = context.Array("i", [-1] * (2 * world), lock=False)
    pipes: list[Connection] = []
    processes: list[Any] = []
    try:
        ranks = [(work, rank, rendezvous, progress) for rank in range(world)]
        start_ranks(context, _child, ranks, "autoshard-rank", processes, pipes)
        return _watch(work, processes, pipes, progress)
    finally:
        stop_ranks(processes)
        del store


def _watch(
    work: Work,
    processes: Sequence[Any],
    pipes: Sequence[Connection],
    progress: Sequence[int],
) -> Gathered:
    world = len(processes)
    messages: dict[int, Any] = {}
    failures: list[tuple[int, float, str]] = []  # (priority, when, message)
    finished: set[int] = set()
    first_failure: float | None = None
    while len(finished) < world:
        live = [r for r in range(world) if r not in finished]
        wait(
            [pipes[r] for r in live if r not in messages] + [processes[r].sentinel for r in live],
            0.5,
        )
        for rank in live:
            if rank not in messages and pipes[rank].poll():
                try:
                    messages[rank] = pipes[rank].recv()
                except EOFError:
                    messages[rank] = None
            if processes[rank].is_alive():
                continue
            processes[rank].join()
            finished.add(rank)
            message = messages.get(rank)
            if message is None and pipes[rank].poll():
                try:
                    message = messages[rank] = pipes[rank].recv()
                except EOFError:
                    message = None
            if message is not None and message[0] == "ok":
                continue
            now = time.monotonic()
            if message is not None:
                failures.append((0 if message[2] else 2, now, message[1]))
            else:
                failures.append((1, now, _died(work, rank, processes[rank].exitcode, progress)))
        if failures:
            first_failure = first_failure or time.monotonic()
            # A moment for the peers' messages, so the cause is told before its echoes.
            if time.monotonic() - first_failure > 0.5:
                break
    if failures:
        stop_ranks(processes)
        failures.sort()
        raise RunError(f"{failures[0][2]} (all {world} ranks stopped)")
    ok = messages[0]
    assert ok is not None and ok[0] == "ok"
    return ok[1]


def _died(work: Work, rank: int, code: int | None, progress: Sequence[int]) -> str:
    how = (
        f"killed by {signal.Signals(-code).name}"
        if code is not None and code < 0
        else f"exited with code {code} without a word"
    )
    world = len(progress) // 2
    return f"rank {rank} died at {work.where(rank, progress[rank], progress[world + rank])}: {how}"


def stop_ranks(processes: Sequence[Any]) -> None:
    """SIGTERM every rank still running, SIGKILL those still there after the grace period."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
