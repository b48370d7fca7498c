"""The sends and receives between pipeline stages on torch.distributed, one device's side.

A boundary value moves as the bytes of the sender's shard (any element type), to the device
at the same place in the next stage, which knows its local shape and dtype from the
partition's manifest. Each message is tagged with its micro-batch and its place among the
stage's boundary values, so that nothing is taken for another. Sends do not block: the
tensors are kept until `wait`, at the end of the step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from autoshard.ir import dtypes
from autoshard.run.rank import StepFailure, first_line


class Boundary:
    """This device's sends and receives of the boundary values `boundary` (the manifest's
    block: dtype and every stage device's local shape, by name); `local`: its place in its
    stage."""

    def __init__(self, boundary: Mapping[str, Any], local: int, rank: int) -> None:
        self.boundary, self.local, self.rank = boundary, local, rank
        self.order = {name: k for k, name in enumerate(sorted(boundary))}
        self.pending: list[tuple[Any, torch.Tensor]] = []

    def _tag(self, name: str, micro_batch: int) -> int:
        return micro_batch * len(self.order) + self.order[name]

    def receive(
        self, names: Sequence[str], source: int | None, micro_batch: int, key: int | None = None
    ) -> dict[str, np.ndarray]:
        """The values `names` of `micro_batch` from rank `source` (none: the first stage);
        `key`: the number the messages are tagged by, where not the micro-batch's (a training
        run's: unique over its steps and chunks)."""
        found = {}
        for name in names if source is not None else ():
            entry = self.boundary[name]
            dtype = dtypes.numpy_dtype(entry["dtype"])
            shape = entry["local_shapes"][self.local]
            data = torch.empty(int(np.prod(shape)) * dtype.itemsize, dtype=torch.uint8)
            try:
                dist.recv(data, source, tag=self._tag(name, micro_batch if key is None else key))
            except Exception as error:  # torch's own errors: a peer gone, a timeout
                what = f"receiving {name!r} of micro-batch {micro_batch} from rank {source}"
                raise StepFailure(self.rank, -1, what, first_line(error)) from None
            found[name] = data.numpy().view(dtype).reshape(shape)
        return found

    def send(
        self, values: Mapping[str, np.ndarray], target: int | None, micro_batch: int,
        key: int | None = None,
    ) -> None:  # fmt: skip
        """`values` of `micro_batch` to rank `target` (none: the last stage sends nothing);
        `key` as `receive`'s."""
        for name, value in values.items() if target is not None else ():
            data = torch.from_numpy(np.ascontiguousarray(value).reshape(-1).view(np.uint8).copy())
            tag = self._tag(name, micro_batch if key is None else key)
            try:
                work = dist.isend(data, target, tag=tag)
            except Exception as error:  # torch's own errors: a peer gone
                what = f"sending {name!r} of micro-batch {micro_batch} to rank {target}"
                raise StepFailure(self.rank, -1, what, first_line(error)) from None
            self.pending.append((work, data))

    def wait(self) -> None:
        """Every send taken."""
        for work, _ in self.pending:
            try:
                work.wait()
            except Exception as error:  # torch's own errors: a peer gone, a timeout
                raise StepFailure(self.rank, -1, "sending", first_line(error)) from None
        self.pending.clear()
