"""What the tests that run a DTensor export on torch share: one start of local ranks joined in a
gloo process group, each running a test's worker, and loading the `apply_plan` module an export
wrote. torch is imported inside (the tests that use it `importorskip` it first)."""

from __future__ import annotations

import importlib.util
import socket
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_ranks(worker: Callable[..., None], world: int, *args: object) -> None:
    """Run `worker(rank, *args)` on `world` processes in one gloo group; a rank's exception is
    raised here. The ranks fork from a server that imported torch once: they start fast (spawn
    imports torch per rank) and never inherit this process's thread pools (a fork of a process
    that has run torch ops can hang in OpenMP)."""
    import torch

    from autoshard.run.launch import without_main_script

    torch.multiprocessing.set_forkserver_preload(["torch", "torch.distributed.tensor"])
    with without_main_script():  # the workers live in test modules, never in pytest's script
        torch.multiprocessing.start_processes(
            _rank, args=(world, free_port(), worker, args), nprocs=world, start_method="forkserver"
        )


def _rank(rank: int, world: int, port: int, worker: Callable[..., None], args: tuple) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        worker(rank, *args)
    finally:
        dist.destroy_process_group()


def load_module(path: str | Path, name: str) -> ModuleType:
    """The Python module at `path` (what `autoshard export --to dtensor -o` wrote)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
