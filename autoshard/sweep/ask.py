"""A sweep as a user asks it, checked into a `Sweep`: the command's flags and the service's form
say the same things in their own syntax and go through these checks, so both refuse alike.

Lists are comma-separated text, as typed: each value is a point of the grid.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoshard.sweep.grid import Point, SweepError, device_counts, expand, meshes, with_pipelines
from autoshard.sweep.run import Sweep

PIPELINE_CHOICES = ("auto", "none")


@dataclass(frozen=True, kw_only=True)
class SweepAsk:
    """What a sweep is asked, before any check. `training` maps a training option's name
    (`optimizer`, `micro_batches`, ...) to its list; `pipeline` is `auto` (every mesh of two
    axes or more also planned pipelined over its first) or `none`."""

    model: Path
    out: Path
    devices: str | None = None
    mesh: str | None = None
    max_axes: int | None = None
    cluster: str | None = None
    device: str | None = None
    memory: str | None = None
    dims: Mapping[str, Sequence[int]] = field(default_factory=dict)
    mode: str = "inference"
    training: Mapping[str, str] = field(default_factory=dict)
    objective: str = "time"
    time_limit: float = 60.0
    executor: str = "local"
    workers: int = 1
    ray_address: str | None = None
    price: float | None = None
    limit: int | None = None
    pipeline_axis: str | None = None
    pipeline: str = "none"
    schedule: str | None = None
    global_batch: str | None = None


def values(text: str | None) -> list[Any]:
    """A list as typed (`a, b`), or [None] where none was given: one point of the default."""
    return [None] if text is None else [v.strip() for v in text.split(",") if v.strip()]


def sweep_of(ask: SweepAsk) -> Sweep:
    """The sweep asked, every value checked once up front (a bad one is the request's error,
    not every point's); SweepError (or the option's own error) names the culprit."""
    from autoshard.cost.schedule import Schedule
    from autoshard.limits import MAX_SEARCH_AXES

    if ask.schedule is not None:
        Schedule.parse(ask.schedule)
        if ask.pipeline_axis is None and ask.pipeline != "auto":
            raise SweepError(f"--schedule {ask.schedule} orders a pipeline: give "
                             "--pipeline-axis or --pipeline auto")  # fmt: skip
    if ask.pipeline not in PIPELINE_CHOICES:
        raise SweepError(f"--pipeline {ask.pipeline!r}: choose {' or '.join(PIPELINE_CHOICES)}")
    max_axes = ask.max_axes or MAX_SEARCH_AXES
    if not 1 <= max_axes <= MAX_SEARCH_AXES:
        raise SweepError(f"--max-axes {max_axes}: choose 1..{MAX_SEARCH_AXES} (MAX_SEARCH_AXES)")
    if ask.devices and ask.mesh:
        raise SweepError("give --devices or --mesh, not both")
    counts = device_counts(ask.devices) if ask.devices else []
    grid_meshes = meshes(counts, values(ask.mesh) if ask.mesh else [], max_axes)
    dims = {name: list(sizes) for name, sizes in ask.dims.items()}
    if ask.global_batch is not None and ask.global_batch not in dims:
        raise SweepError(f"--global-batch {ask.global_batch} names no --dim of the grid: give "
                         f"--dim {ask.global_batch}=SIZES")  # fmt: skip
    if ask.pipeline == "auto":
        grid_meshes = _with_pipelines(ask, grid_meshes, dims)
    training = {name: values(text) for name, text in ask.training.items() if text is not None}
    points = expand(grid_meshes, values(ask.cluster), values(ask.device), values(ask.memory),
                    dims, ask.mode, training)  # fmt: skip
    _check(points, grid_meshes[0])
    if ask.workers < 1 or (ask.limit is not None and ask.limit < 0):
        raise SweepError("--workers must be at least 1 and --limit at least 0")
    return Sweep(
        model=ask.model, points=tuple(points), out=ask.out, objective=ask.objective,
        time_limit=ask.time_limit, executor=ask.executor, workers=ask.workers,
        ray_address=ask.ray_address, price=ask.price, limit=ask.limit,
        pipeline_axis=ask.pipeline_axis, schedule=ask.schedule, global_batch=ask.global_batch,
    )  # fmt: skip


def _with_pipelines(ask: SweepAsk, grid_meshes: list[str], dims: dict[str, list[int]]) -> list[str]:
    """`--pipeline auto`'s meshes (`grid.with_pipelines`), for the model's repeated layers
    (imported at the grid's first dims)."""
    from autoshard.analysis.shorten import layer_run
    from autoshard.pipeline import load_graph

    if ask.mode != "training":
        raise SweepError("--pipeline auto pipelines a training step: add --mode training")
    if ask.pipeline_axis is not None:
        raise SweepError("give --pipeline auto or --pipeline-axis, not both")
    run = layer_run(load_graph(ask.model, {n: sizes[0] for n, sizes in dims.items()}, None))
    return with_pipelines(grid_meshes, run.count if run is not None else 0)


def _check(points: list[Point], mesh: str) -> None:
    """Every cluster, budget and training step of the grid made once."""
    from autoshard.cost.cluster import make_cluster
    from autoshard.cost.devices import CLUSTERS
    from autoshard.training.options import requested

    seen = set()
    for point in points:
        key = (point.cluster, point.device, point.memory, point.mode, point.training)
        if key in seen:
            continue
        seen.add(key)
        if point.cluster and point.cluster not in CLUSTERS and not Path(point.cluster).exists():
            raise SweepError(
                f"unknown cluster {point.cluster!r}: a preset ({', '.join(CLUSTERS)}) or a file"
            )
        make_cluster(mesh, point.device, None, None, point.memory, point.cluster)
        requested(point.mode, dict(point.training), lambda n: "--" + n.replace("_", "-"),
                  "--mode training")  # fmt: skip
