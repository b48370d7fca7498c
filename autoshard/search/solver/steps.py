"""Elimination steps remembered across the exact solves of one problem's restrictions.

The standard recipes are each priced by exact elimination of the plan's problem restricted to
the choices the recipe pins (`recipe_prices`). A recipe pins a few groups; the rest keep all
their choices, and a step that eliminates a group far from the pinned ones sums the same
tables in every recipe: a training step's largest steps can be the same in all of them. A step
is a pure function of its group, its neighbours, their sizes and the tables of its bucket, so
its minimum, remembered by those (the tables by a digest of their bytes), is the minimum the
step would compute again: the solves answer the same choices, byte for byte.

Only large steps are remembered (more entries than `tuning.SMALL`, those summed a choice at a
time): a small one costs less to compute than to digest. The tables remembered are read-only,
so no solve can change another's.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from autoshard.search.solver import tuning

Bucket = Sequence[tuple[tuple[int, ...], np.ndarray]]
Eliminated = tuple[np.ndarray, np.ndarray | None]  # the minimum over the neighbours, its argmin
Step = Callable[[int, tuple[int, ...], Bucket, Sequence[int]], Eliminated]


@dataclass(eq=False)
class Steps:
    """The large steps' minima seen so far, by a digest of each step's inputs."""

    seen: dict[bytes, Eliminated] = field(default_factory=dict)

    def eliminated(
        self,
        g: int,
        neighbours: tuple[int, ...],
        bucket: Bucket,
        sizes: Sequence[int],
        step: Step,
    ) -> Eliminated:
        """`step(g, neighbours, bucket, sizes)`, remembered where the step is large."""
        if sizes[g] * math.prod(sizes[h] for h in neighbours) <= tuning.SMALL:
            return step(g, neighbours, bucket, sizes)
        key = _digest(g, neighbours, bucket, sizes)
        found = self.seen.get(key)
        if found is None:
            found = step(g, neighbours, bucket, sizes)
            for table in found:
                if table is not None:
                    table.flags.writeable = False
            self.seen[key] = found
        return found


def _digest(g: int, neighbours: tuple[int, ...], bucket: Bucket, sizes: Sequence[int]) -> bytes:
    """What the step's answer depends on: its groups and their sizes, and each table of its
    bucket (scope, type, shape and bytes)."""
    out = hashlib.blake2b(digest_size=32)
    groups = (g, *neighbours)
    head = (groups, tuple(sizes[h] for h in groups))
    out.update(repr(head).encode())
    for scope, table in bucket:
        out.update(repr((scope, table.dtype.str, table.shape)).encode())
        out.update(np.ascontiguousarray(table).data)
    return out.digest()
