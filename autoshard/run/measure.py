"""The collectives of `autoshard calibrate`, timed over N local processes on torch.distributed.

    measure_links(ranks=4, backend="gloo", sizes=(4096, 65536), repeats=5) -> Links

Each rank is a child process started as `autoshard run` starts them (`run.launch`:
forkserver children meeting at a TCP store on a port the kernel picks free, stopped by
`launch.stop_ranks`). For every kind (all_gather, all_reduce, reduce_scatter, all_to_all) and
every size (the bytes each rank holds, `local`), the ranks meet at a barrier, run the
collective once, and each times it; a run takes as long as its slowest rank, and of the
`repeats` runs the fastest is kept (on a shared machine, the least disturbed). Rank 0 sends
each figure to the launcher as it is measured (progress) and the samples at the end;
`cost.calibrate.fit_links` fits them to the α–β model.

float32 tensors, summed; on nccl each rank uses the GPU of its rank and the time is taken
after `torch.cuda.synchronize()`.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from autoshard.collectives import CollectiveKind
from autoshard.cost.measure.calibrate import Links, LinkSample, fit_links
from autoshard.run import BACKENDS, RunSetupError

if TYPE_CHECKING:
    from autoshard.run.rank import Rendezvous

KINDS = (
    CollectiveKind.ALL_GATHER, CollectiveKind.ALL_REDUCE,
    CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_TO_ALL,
)  # fmt: skip
SIZES = tuple(4096 << (2 * i) for i in range(7))  # 4 KiB .. 16 MiB per rank
QUICK_SIZES = (4096, 65536, 1 << 20)


def _collective(
    kind: CollectiveKind, local: int, world: int, device: Any
) -> tuple[Callable[[], None], int]:
    """A closure running one collective of `kind` with about `local` bytes per rank (float32
    in n equal pieces), and the bytes it holds exactly."""
    import torch
    import torch.distributed as dist

    count = max(world, local // 4 // world * world)
    x = torch.ones(count, dtype=torch.float32, device=device)
    held = 4 * count
    if kind is CollectiveKind.ALL_GATHER:
        gathered = [torch.empty_like(x) for _ in range(world)]
        return (lambda: dist.all_gather(gathered, x)), held
    if kind is CollectiveKind.ALL_REDUCE:
        return (lambda: dist.all_reduce(x)), held
    pieces = list(x.chunk(world))
    out = torch.empty_like(pieces[0])
    if kind is CollectiveKind.REDUCE_SCATTER:
        return (lambda: dist.reduce_scatter(out, pieces)), held
    received = torch.empty_like(x)
    return (lambda: dist.all_to_all_single(received, x)), held


def _time(run: Callable[[], None], repeats: int, device: Any) -> float:
    """The fastest of `repeats` runs, each as long as its slowest rank."""
    import torch
    import torch.distributed as dist

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    run()  # warm up: connections, buffers
    times = torch.zeros(repeats, dtype=torch.float64)
    for i in range(repeats):
        dist.barrier()
        sync()
        started = time.perf_counter()
        run()
        sync()
        times[i] = time.perf_counter() - started
    slowest = times.to(device)
    dist.all_reduce(slowest, dist.ReduceOp.MAX)
    return float(slowest.min())


def _rank(
    rank: int,
    world: int,
    backend: str,
    rendezvous: Rendezvous,
    sizes: Sequence[int],
    repeats: int,
    conn: Connection,
) -> None:
    code = 0
    try:
        import torch
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
        store = rendezvous.store(world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        samples = []
        for kind in KINDS:
            for local in sizes:
                run, held = _collective(kind, local, world, device)
                samples.append(LinkSample(kind, world, held, _time(run, repeats, device)))
                if rank == 0:
                    conn.send(("progress", samples[-1]))
        conn.send(("ok", samples))
        dist.destroy_process_group()
    except BaseException as error:  # any failure ends as a message, not a hang
        conn.send(("error", f"rank {rank}: {type(error).__name__}: {error}"))
        code = 1
    finally:
        conn.close()
    os._exit(code)  # skip interpreter teardown: torch's atexit hooks may wait on peers


def cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_ranks(given: int | None) -> int:
    """The processes to time collectives over: as given (0: links not measured), else one per
    GPU (at least 2), else 4 on CPU, and 0 without torch."""
    if given is not None:
        if given < 0 or given == 1:
            raise RunSetupError(f"--ranks {given}: give 0 (links not measured) or 2 and more")
        return given
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        return 0
    return max(2, cuda_devices()) if cuda_devices() else 4


def default_backend() -> str:
    return "nccl" if cuda_devices() else "gloo"


def check_backend(ranks: int, backend: str) -> None:
    """Refuse, before any work, what this machine cannot measure."""
    if backend not in BACKENDS:
        raise RunSetupError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    check_ranks(ranks)
    try:
        import torch.distributed as dist
    except ImportError:
        raise RunSetupError("measuring links needs torch: pip install 'autoshard[run]'") from None
    if backend == "nccl" and not (dist.is_nccl_available() and cuda_devices() >= ranks):
        raise RunSetupError(
            f"--backend nccl needs {ranks} CUDA GPUs; this machine has {cuda_devices()}: use "
            "--backend gloo or fewer --ranks"
        )


def measure_links(
    ranks: int,
    backend: str = "gloo",
    sizes: Sequence[int] = SIZES,
    repeats: int = 5,
    timeout_s: float = 120.0,
    progress: Callable[[str], None] = lambda _: None,
) -> Links:
    """Time the collectives over `ranks` local processes and fit the link (module docstring)."""
    check_backend(ranks, backend)
    import torch.distributed as dist

    from autoshard.run.launch import forkserver, start_ranks, stop_ranks
    from autoshard.run.rank import Rendezvous, RunError

    context = forkserver(["autoshard.run.rank", "autoshard.run.measure"])
    store = dist.TCPStore(
        "127.0.0.1", 0, ranks, True, timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )  # fmt: skip
    rendezvous = Rendezvous("127.0.0.1", store.port, timeout_s)
    pipes: list[Connection] = []
    processes: list[Any] = []
    try:
        given = [(rank, ranks, backend, rendezvous, tuple(sizes), repeats) for rank in range(ranks)]
        start_ranks(context, _rank, given, "autoshard-calibrate", processes, pipes)
        samples: list[LinkSample] | None = None
        done: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(done) < ranks:
            if time.monotonic() > deadline:
                raise RunError(f"measuring links took over {timeout_s:.0f} s: stopped")
            live = [r for r in range(ranks) if r not in done]
            wait([pipes[r] for r in live] + [processes[r].sentinel for r in live], 0.5)
            for rank in live:
                message = _receive(pipes[rank])
                if message is None:
                    if not processes[rank].is_alive() and not pipes[rank].poll():
                        raise RunError(f"rank {rank} ended without a word while measuring links")
                    continue
                if message[0] == "error":
                    raise RunError(f"measuring links failed: {message[1]}")
                if message[0] == "progress":
                    s = message[1]
                    progress(
                        f"{s.kind} of {s.local} B per rank over {ranks} ranks ({backend}): "
                        f"{s.seconds * 1e6:.1f} us, {s.sent / s.seconds / 1e9:.3g} GB/s sent"
                    )
                    continue
                done.add(rank)
                if rank == 0:
                    samples = message[1]
    finally:
        stop_ranks(processes)
        del store
    assert samples is not None
    links = fit_links(backend, samples)
    progress(
        f"links fit: {links.fit.bandwidth / 1e9:.3g} GB/s, {links.fit.latency * 1e6:.3g} us "
        f"per ring step ({backend}, {ranks} ranks)"
    )
    return links


def _receive(pipe: Connection) -> Any:
    try:
        return pipe.recv() if pipe.poll() else None
    except EOFError:
        return None
