"""What a training step is asked to be: optimizer, precision, micro-batches, recompute."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import TypeVar

from autoshard.errors import AutoshardError


class TrainingError(AutoshardError, ValueError):
    """A training option that is not one of the valid choices."""


class Mode(enum.StrEnum):
    INFERENCE = "inference"
    TRAINING = "training"


class Optimizer(enum.StrEnum):
    ADAM = "adam"
    ADAMW = "adamw"
    SGD = "sgd"  # with momentum
    NONE = "none"  # gradients only: synchronized, no update

    @property
    def moments(self) -> int:
        """fp32 tensors of optimizer state per weight: Adam's m and v, SGD's momentum."""
        return {"adam": 2, "adamw": 2, "sgd": 1, "none": 0}[self.value]


class Precision(enum.StrEnum):
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"
    FP32 = "fp32"

    @property
    def dtype(self) -> str:
        """The dtype of weights, activations and gradients."""
        return {"bf16-mixed": "bfloat16", "fp16-mixed": "float16", "fp32": "float32"}[self.value]

    @property
    def master_copy(self) -> bool:
        """Mixed precision keeps an fp32 master copy of each weight with the optimizer state."""
        return self is not Precision.FP32


class Recompute(enum.StrEnum):
    NONE = "none"
    LAYERS = "layers"  # each repeated layer's activations recomputed in its backward
    AUTO = "auto"  # layers only when the step does not fit without


E = TypeVar("E", bound=enum.StrEnum)


def parse_choice(kind: type[E], text: str, what: str) -> E:
    """`text` as a member of `kind`, or an error naming the valid choices."""
    try:
        return kind(text)
    except ValueError:
        choices = ", ".join(m.value for m in kind)
        raise TrainingError(f"unknown {what} {text!r}; choose one of: {choices}") from None


@dataclass(frozen=True, kw_only=True)
class Training:
    """A training step: forward, backward, gradient sync once per `micro_batches` passes,
    then the optimizer's update. Its byte factors per parameter (mixed-precision Adam: 2 for
    the weight, 2 for its gradient, 12 of state: ZeRO's K)."""

    optimizer: Optimizer = Optimizer.ADAM
    precision: Precision = Precision.BF16_MIXED
    micro_batches: int = 1
    recompute: Recompute = Recompute.NONE

    def __post_init__(self) -> None:
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int):
            raise TrainingError(f"--micro-batches must be an integer, got {self.micro_batches!r}")
        if self.micro_batches < 1:
            raise TrainingError(f"--micro-batches must be at least 1, got {self.micro_batches}")

    @property
    def state_planes(self) -> int:
        """fp32 tensors of optimizer state per weight, the master copy included."""
        if self.optimizer is Optimizer.NONE:
            return 0
        return self.optimizer.moments + int(self.precision.master_copy)

    def but(self, recompute: Recompute) -> Training:
        return dataclasses.replace(self, recompute=recompute)

    def to_json(self) -> dict[str, object]:
        return {
            "optimizer": str(self.optimizer),
            "precision": str(self.precision),
            "micro_batches": self.micro_batches,
            "recompute": str(self.recompute),
        }

    @staticmethod
    def parse(
        optimizer: str = "adam",
        precision: str = "bf16-mixed",
        micro_batches: object = 1,
        recompute: str = "none",
    ) -> Training:
        """Options as a user gives them (flags, a form, a plan document's `training`)."""
        return Training(
            optimizer=parse_choice(Optimizer, str(optimizer), "optimizer"),
            precision=parse_choice(Precision, str(precision), "precision"),
            micro_batches=micro_batches,  # type: ignore[arg-type]  # checked in __post_init__
            recompute=parse_choice(Recompute, str(recompute), "recompute"),
        )

    def __str__(self) -> str:
        return (
            f"training: {self.optimizer} optimizer, {self.precision}, "
            f"{self.micro_batches} micro-batch{'es' if self.micro_batches > 1 else ''}, "
            f"recompute {self.recompute}"
        )
