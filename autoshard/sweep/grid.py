"""The grid of a sweep: every combination of the values asked for, as `Point`s, each planned
as one `autoshard plan` would plan it.

Meshes: a device count is factorised into every ordered product of axes of at least 2
devices, up to the search's axis limit (`MAX_SEARCH_AXES`): 8 devices give 8, 2x4, 4x2 and
2x2x2. Order matters: a cluster preset gives the last axes the links inside a node.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autoshard.errors import AutoshardError
from autoshard.limits import MAX_DEVICES, MAX_SEARCH_AXES
from autoshard.mesh import Mesh
from autoshard.search.pipelined import PIPELINE_AXIS


class SweepError(AutoshardError, ValueError):
    """A sweep asked for no point, or for one that cannot be planned."""


@dataclass(frozen=True, kw_only=True)
class Point:
    """One plan of the sweep: what `autoshard plan` is given for it, as flag text. `training`
    holds the training options given (name, value), in `training.options.OPTIONS` order."""

    mesh: str
    cluster: str | None = None
    device: str | None = None
    memory: str | None = None
    dims: tuple[tuple[str, int], ...] = ()
    mode: str = "inference"
    training: tuple[tuple[str, str], ...] = ()

    @property
    def devices(self) -> int:
        return Mesh.parse(self.mesh).size

    def to_json(self) -> dict[str, Any]:
        return {
            "mesh": self.mesh, "cluster": self.cluster, "device": self.device,
            "memory": self.memory, "dims": dict(self.dims), "mode": self.mode,
            "training": dict(self.training),
        }  # fmt: skip

    def __str__(self) -> str:
        """`4x8 dgx-h100 memory=40GiB batch=256 micro_batches=4`: the point in a line."""
        parts = [self.mesh, self.cluster, self.device, self.memory and f"memory={self.memory}"]
        parts += [f"{k}={v}" for k, v in (*self.dims, *self.training)]
        return " ".join(p for p in parts if p)


def point_key(model_sha256: str, point: Point, asked: Mapping[str, Any]) -> str:
    """A stable name of a point's plan request: the hash of the model's bytes, the point and
    what else the plan is asked (`asked`: the objective, the time limit, autoshard's version),
    so a sweep resumed with other options plans again."""
    text = json.dumps({"model": model_sha256, "point": point.to_json(), "asked": dict(asked)},
                      sort_keys=True, separators=(",", ":"))  # fmt: skip
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def factorisations(devices: int, max_axes: int = MAX_SEARCH_AXES) -> list[tuple[int, ...]]:
    """Every ordered product of at most `max_axes` factors of at least 2 that makes `devices`
    (1 device: the one mesh `(1,)`), largest first axis first.

    >>> factorisations(8)
    [(8,), (4, 2), (2, 4), (2, 2, 2)]
    """
    if devices == 1:
        return [(1,)]
    found: list[tuple[int, ...]] = []

    def extend(prefix: tuple[int, ...], rest: int) -> None:
        if rest == 1:
            found.append(prefix)
            return
        if len(prefix) == max_axes:
            return
        for factor in range(rest, 1, -1):
            if rest % factor == 0:
                extend((*prefix, factor), rest // factor)

    extend((), devices)
    return sorted(found, key=lambda shape: (len(shape), [-f for f in shape]))


def device_counts(text: str) -> list[int]:
    """`--devices 64,128,256` or `32-256` (every power of two from 32 to 256), or both mixed
    (`8,32-128`); in the order given, each once."""
    counts: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        low, dash, high = part.partition("-")
        try:
            ends = (int(low), int(high)) if dash else (int(part), int(part))
        except ValueError:
            raise SweepError(
                f"--devices {text!r}: {part!r} is not a count or a range like 32-256"
            ) from None
        if not 1 <= ends[0] <= ends[1] <= MAX_DEVICES:
            raise SweepError(
                f"--devices {text!r}: {part!r} is outside 1..{MAX_DEVICES} (MAX_DEVICES) or "
                "runs backwards"
            )
        count = ends[0]
        while count <= ends[1]:
            counts.append(count)
            count = count * 2 if dash else ends[1] + 1
        if dash and ends[0] & (ends[0] - 1):
            raise SweepError(f"--devices {text!r}: a range starts at a power of two, not {ends[0]}")
    return list(dict.fromkeys(counts))


def meshes(devices: Sequence[int], given: Sequence[str], max_axes: int) -> list[str]:
    """The meshes swept: those given (`--mesh`), else every factorisation of each count."""
    if given:
        for text in given:
            shape = Mesh.parse(text).shape
            if len(shape) > max_axes:
                raise SweepError(
                    f"--mesh {text} has {len(shape)} axes; the search takes at most {max_axes}"
                )
        return list(dict.fromkeys(given))
    found = []
    for count in devices:
        shapes = factorisations(count, max_axes)
        if not shapes:
            raise SweepError(f"no mesh of at most {max_axes} axes has {count} devices")
        found += ["x".join(map(str, shape)) for shape in shapes]
    return found


def with_pipelines(meshes: Sequence[str], layers: int) -> list[str]:
    """`--pipeline auto`'s meshes: each of `meshes`, followed where it has two axes or more and
    its first axis at least 2 and at most `layers` devices (a stage has a layer at least) by
    the same mesh pipelined over that axis (named `pp`, the others `x1`, `x2`, ... where they
    have no name: labels only).

    >>> with_pipelines(["8", "2x4", "4x2x2", "dp=2,tp=4"], 3)
    ['8', '2x4', 'pp=2,x1=4', '4x2x2', 'dp=2,tp=4', 'pp=2,tp=4']
    """
    found = []
    for text in meshes:
        found.append(text)
        mesh = Mesh.parse(text)
        if mesh.ndim < 2 or not 2 <= mesh.shape[0] <= layers or PIPELINE_AXIS in mesh.axis_names:
            continue
        names = mesh.axis_names or tuple(f"x{i}" for i in range(mesh.ndim))
        found.append(",".join(f"{n}={s}" for n, s in zip((PIPELINE_AXIS, *names[1:]),
                                                         mesh.shape, strict=True)))  # fmt: skip
    return found


def expand(
    meshes: Sequence[str],
    clusters: Sequence[str | None],
    devices: Sequence[str | None],
    memories: Sequence[str | None],
    dims: Mapping[str, Sequence[int]],
    mode: str,
    training: Mapping[str, Sequence[str]],
) -> list[Point]:
    """Every combination, the mesh varying fastest (points that share an import, the model
    and its dims and training step, run side by side); each distinct point once."""
    dim_names, train_names = list(dims), list(training)
    points = []
    for dim_values, train_values, cluster, device, memory, mesh in itertools.product(
        itertools.product(*dims.values()), itertools.product(*training.values()),
        clusters, devices, memories, meshes,
    ):  # fmt: skip
        points.append(Point(
            mesh=mesh, cluster=cluster, device=device, memory=memory,
            dims=tuple(zip(dim_names, dim_values, strict=True)), mode=mode,
            training=tuple(zip(train_names, train_values, strict=True)),
        ))  # fmt: skip
    if not points:
        raise SweepError("the grid is empty: give --devices or --mesh")
    return list(dict.fromkeys(points))
