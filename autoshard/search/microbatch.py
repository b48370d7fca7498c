"""A step's global batch and the micro-batches it is run in (docs/concepts/pipeline.md).

The batch a model is given (`--dim batch=B`) is one micro-batch, and a step runs `m` of them:
its global batch is `B x m`. Given the global batch instead (`--global-batch batch=G`), the
micro-batch is `G / m`, so `m` must divide `G`; where a pipeline is planned and `m` is not
given, the search plans the step with each divisor of `G` (each a plan of its own: the
micro-batch's size changes every op's shape) and keeps the fastest that fits
(`pipeline.plan_request`), the story saying what the others cost.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.errors import PipelineError
from autoshard.units import format_seconds


def divisors(n: int) -> tuple[int, ...]:
    """The divisors of `n`, ascending."""
    return tuple(d for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True)
class GlobalBatch:
    """A step's global batch: `size` along the model's symbolic dim `dim`, run in
    `micro_batches` micro-batches (None: the search picks, where a pipeline is planned)."""

    dim: str
    size: int
    micro_batches: int | None = None

    def __post_init__(self) -> None:
        if self.size < 1:
            raise PipelineError(f"--global-batch {self.dim}={self.size}: the size must be >= 1")
        m = self.micro_batches
        if m is not None and self.size % m:
            raise PipelineError(
                f"--micro-batches {m} does not divide the global batch {self.dim}={self.size} "
                f"(a micro-batch is the global batch / micro-batches); choose one of: "
                f"{', '.join(map(str, divisors(self.size)))}"
            )

    @staticmethod
    def parse(text: str, micro_batches: int | None = None) -> GlobalBatch:
        """`batch=64` (the model's dim `batch`, 64 a step)."""
        name, sep, size = text.partition("=")
        if not sep or not name.strip() or not size.strip().isdigit():
            raise PipelineError(
                f"--global-batch {text!r} is not DIM=SIZE: name the model's batch dim, e.g. "
                "batch=64"
            )
        return GlobalBatch(name.strip(), int(size), micro_batches)

    def choices(self, searched: bool) -> tuple[int, ...]:
        """The micro-batch counts to plan: the one given, every divisor where `searched`,
        else one."""
        if self.micro_batches is not None:
            return (self.micro_batches,)
        return divisors(self.size) if searched else (1,)

    def __str__(self) -> str:
        return f"{self.dim}={self.size}"


@dataclass(frozen=True)
class MicroBatchCandidate:
    """One micro-batch count the search planned: its step, or why it has no plan."""

    micro_batches: int
    step_s: float | None
    why: str = ""

    def words(self) -> str:
        if self.step_s is None:
            return f"{self.micro_batches}: {self.why}"
        return f"{self.micro_batches}: {format_seconds(self.step_s)} a step"

    def to_json(self) -> dict[str, object]:
        return {"micro_batches": self.micro_batches, "step_time_s": self.step_s,
                "why": self.why}  # fmt: skip


def chosen_words(batch: GlobalBatch, chosen: int, others: list[MicroBatchCandidate]) -> str:
    """The story's sentence: `micro-batches: 4 of global batch batch=8 (micro-batch 2),
    chosen over 1: 2.1 ms a step; 2: ...`."""
    head = f"micro-batches: {chosen} of global batch {batch} (micro-batch {batch.size // chosen})"
    if not others:
        return head
    return f"{head}, chosen over {'; '.join(c.words() for c in others)}"
