"""`autoshard run`: a partition folder executed on torch.distributed, one process per device.

    run_partition(OUT, backend="gloo", inputs=None, check=MODEL) -> RunReport

The ranks follow the step manifest (steps.json) that `autoshard partition` wrote: ONNX
segments on onnxruntime, collectives on torch.distributed (`run/collectives.py`), each rank
with its own weight file. Rank 0 gathers the outputs; they are reassembled from the shards
(partial ones reduced) and, with `check`, compared with onnxruntime on the original model as
`autoshard verify` compares them. Wall times per rank, of compute and of each collective kind,
are in the report's `timing` block (the only figures that change from run to run).

torch is an optional dependency (`pip install 'autoshard[run]'`): importing this package does
not import it; running does.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from autoshard.errors import AutoshardError
from autoshard.execute.artifacts import check_model, read_manifest
from autoshard.execute.steps import read_steps
from autoshard.execute.verify import (
    InputSpec,
    OutputCheck,
    assemble_value,
    check_inputs,
    compare,
    random_inputs,
    reference_outputs,
    tolerance_for,
)
from autoshard.mesh import Mesh
from autoshard.sharding import Sharding

BACKENDS = ("gloo", "nccl")
EXIT_FAILED = 2
"""A torchrun worker's exit status when it fails (the CLI's for any error)."""
DEFAULT_TIMEOUT_S = 60.0


class RunSetupError(AutoshardError):
    """A run asked for something this machine or folder cannot give (torch, a backend)."""


@dataclass(frozen=True)
class RunReport:
    """The reassembled outputs, their checks (with `check`), and each rank's timings."""

    devices: int
    backend: str
    outputs: Mapping[str, np.ndarray]
    checks: Mapping[str, OutputCheck] = field(default_factory=dict)
    ranks: tuple[Mapping[str, object], ...] = ()
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks.values())

    def to_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "devices": self.devices,
            "backend": self.backend,
            "outputs": {
                name: {
                    "shape": list(value.shape),
                    "dtype": str(value.dtype),
                    **(self.checks[name].to_json() if name in self.checks else {}),
                }
                for name, value in self.outputs.items()
            },
            "timing": {"wall_s": self.wall_s, "ranks": list(self.ranks)},
        }


def _input_specs(steps: Mapping[str, Any]) -> list[InputSpec]:
    return [InputSpec(i["name"], i["dtype"], tuple(i["shape"]), i["high"]) for i in steps["inputs"]]


def torch_rank() -> tuple[int, int] | None:
    """(rank, world size) when started by torchrun or another launcher setting them."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def run_partition(
    out: str | os.PathLike[str],
    backend: str = "gloo",
    inputs: Mapping[str, np.ndarray] | None = None,
    check: str | os.PathLike[str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    seed: int = 0,
    rtol: float | None = None,
) -> RunReport | None:
    """Run partition folder `out` on one process per device (or, under torchrun, this
    process's rank); rank 0's report (None on the other ranks)."""
    if backend not in BACKENDS:
        raise RunSetupError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    folder = Path(out)
    partition = read_manifest(folder)
    if "training" in partition:
        raise RunSetupError(
            f"'{out}' is the partition of a training step; autoshard run executes forward "
            "passes only (autoshard verify trains it against PyTorch autograd in one process)"
        )
    steps = read_steps(folder)
    if check is not None:
        check_model(partition, check)
    try:
        import torch.distributed as dist
    except ImportError:
        raise RunSetupError("autoshard run needs torch: pip install 'autoshard[run]'") from None
    if backend == "gloo" and not dist.is_gloo_available():
        raise RunSetupError("this torch has no gloo backend; valid here: nccl")
    if backend == "nccl" and not dist.is_nccl_available():
        raise RunSetupError("this torch has no nccl backend (a CPU build?); use --backend gloo")
    specs = _input_specs(steps)
    feed = check_inputs(specs, inputs) if inputs is not None else random_inputs(specs, seed)
    world = len(steps["devices"])
    sha256 = [d.get("sha256") for d in partition["devices"]]
    started = time.perf_counter()
    torchrun = torch_rank()
    if torchrun is None:
        from autoshard.run.launch import launch

        gathered = launch(folder, steps, feed, backend, timeout_s, sha256)
    else:
        from autoshard.run.rank import Rendezvous, RunError, run_rank

        rank, size = torchrun
        if size != world:
            raise RunSetupError(
                f"WORLD_SIZE is {size}; the partition has {world} devices: start {world} ranks"
            )
        rendezvous = Rendezvous(
            os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")),
            timeout_s, host_store=rank == 0 and "TORCHELASTIC_USE_AGENT_STORE" not in os.environ,
            watch=True,
        )  # fmt: skip
        try:
            result = run_rank(folder, steps, rank, feed, backend, rendezvous, None, sha256[rank])
        except RunError as failure:
            # Said now, and the process ended at once: tearing torch down while peers are
            # gone may abort the interpreter (SIGABRT) after the message, or wait on them.
            print(f"autoshard: error: {failure}", file=sys.stderr, flush=True)
            os._exit(EXIT_FAILED)
        if result is None:
            return None
        gathered = result
    wall = time.perf_counter() - started
    return _report(steps, gathered, feed, check, backend, wall, rtol)


def _report(
    steps: Mapping[str, Any],
    gathered: list[tuple[dict[str, np.ndarray], dict[str, object]]],
    feed: Mapping[str, np.ndarray],
    check: str | os.PathLike[str] | None,
    backend: str,
    wall: float,
    rtol: float | None,
) -> RunReport:
    mesh = Mesh(tuple(steps["mesh"]["shape"]), tuple(steps["mesh"]["axis_names"]))
    values: dict[str, np.ndarray] = {}
    replicas: dict[str, float] = {}
    for output in steps["outputs"]:
        local = [outputs[output["tensor"]] for outputs, _ in gathered]
        sharding = Sharding.parse(output["sharding"])
        values[output["name"]], replicas[output["name"]] = assemble_value(
            mesh, sharding, tuple(output["shape"]), local
        )
    checks = {}
    if check is not None:
        reference = reference_outputs(check, feed)
        for output in steps["outputs"]:
            name = output["name"]
            tolerance = tolerance_for(output["dtype"], rtol)
            checks[name] = compare(
                values[name], np.asarray(reference[name]), tolerance, replicas[name]
            )
    ranks = tuple({"rank": r, **timing} for r, (_, timing) in enumerate(gathered))
    return RunReport(len(gathered), backend, values, checks, ranks, wall)
