"""What a training step is asked to be: optimizer, precision, micro-batches, recompute,
attention."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

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


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer's hyperparameters a training step is executed with (`autoshard verify`):
    torch.optim's defaults, AdamW's weight decay included, and SGD's momentum."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    adamw_weight_decay: float = 1e-2
    momentum: float = 0.9


OPTIMIZER_SETTINGS = OptimizerSettings()


class Precision(enum.StrEnum):
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"
    FP8_MIXED = "fp8-mixed"  # bf16-mixed, its linear layers' matmuls on FP8 tensor cores
    FP32 = "fp32"

    @property
    def dtype(self) -> str:
        """The dtype of weights, activations and gradients."""
        return {"bf16-mixed": "bfloat16", "fp16-mixed": "float16", "fp8-mixed": "bfloat16",
                "fp32": "float32"}[self.value]  # fmt: skip

    @property
    def matmul_dtype(self) -> str | None:
        """The dtype the linear layers' matmuls (a weight times activations, forward and
        backward) compute in where it is not `dtype`: FP8 (e4m3) under fp8-mixed, as
        TorchTitan's Float8Linear and Transformer Engine run them, the operands cast to FP8
        with a scale and the result in bf16; attention's matmuls stay in bf16."""
        return "float8_e4m3fn" if self is Precision.FP8_MIXED else None

    @property
    def master_copy(self) -> bool:
        """Mixed precision keeps an fp32 master copy of each weight with the optimizer state."""
        return self is not Precision.FP32


class Recompute(enum.StrEnum):
    """What the backward recomputes instead of keeping it from the forward (`training.replay`);
    `layers` with `Training.every` k recomputes every k-th layer (`layers:K`)."""

    NONE = "none"
    SELECTIVE = "selective"  # each attention core (scores to probabilities), as Korthikanti's
    LAYERS = "layers"  # each repeated layer's activations recomputed in its backward
    AUTO = "auto"  # the search's choice: the cheapest recomputation that fits the budget


RECOMPUTE_CHOICES = "none, selective, layers, layers:K (every K-th layer), auto"


def parse_recompute(text: str) -> tuple[Recompute, int]:
    """`--recompute` as a user gives it: a `Recompute`, or `layers:K`, and the K (1 but there)."""
    kind, colon, every = str(text).partition(":")
    try:
        recompute = Recompute(kind)
        count = int(every) if colon else 1
        if colon and (recompute is not Recompute.LAYERS or count < 1):
            raise ValueError(text)
    except ValueError:
        raise TrainingError(
            f"unknown recompute {text!r}; choose one of: {RECOMPUTE_CHOICES}"
        ) from None
    return recompute, count


class Attention(enum.StrEnum):
    """How attention is planned and priced (`ir.fused`): as one fused (flash) kernel, or op by
    op as the exporter wrote it."""

    FUSED = "fused"
    AS_EXPORTED = "as-exported"


E = TypeVar("E", bound=enum.StrEnum)


def _integer(text: int | str) -> int:
    """A count as given: an int, or the text of one (a form field)."""
    if isinstance(text, int):
        return text
    try:
        return int(text)
    except ValueError:
        raise TrainingError(f"micro-batches must be an integer, got {text!r}") from None


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
    the weight, 2 for its gradient, 12 of state: ZeRO's K). `attention` None: as the device
    runs it (`for_device`: fused where it has flash-attention kernels), as exported where a
    step is not planned (a saved plan from before the choice existed)."""

    optimizer: Optimizer = Optimizer.ADAM
    precision: Precision = Precision.BF16_MIXED
    micro_batches: int = 1
    recompute: Recompute = Recompute.AUTO
    every: int = 1  # with `Recompute.LAYERS`: every k-th layer recomputed
    attention: Attention | None = None

    def __post_init__(self) -> None:
        if self.every < 1 or (self.every > 1 and self.recompute is not Recompute.LAYERS):
            raise TrainingError(
                f"recompute every {self.every} layers needs recompute layers and K >= 1"
            )
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int):
            raise TrainingError(f"micro-batches must be an integer, got {self.micro_batches!r}")
        if self.micro_batches < 1:
            raise TrainingError(f"micro-batches must be at least 1, got {self.micro_batches}")

    @property
    def state_planes(self) -> int:
        """fp32 tensors of optimizer state per weight, the master copy included."""
        if self.optimizer is Optimizer.NONE:
            return 0
        return self.optimizer.moments + int(self.precision.master_copy)

    def but(self, recompute: Recompute, every: int = 1) -> Training:
        return dataclasses.replace(self, recompute=recompute, every=every)

    @property
    def recompute_text(self) -> str:
        """The recomputation as `--recompute` spells it (`layers:4`)."""
        return f"{self.recompute}:{self.every}" if self.every > 1 else str(self.recompute)

    def for_device(self, flash: bool) -> Training:
        """The step with its attention decided: as asked, else fused where the device runs
        flash-attention kernels (`flash`), as exported where it does not."""
        if self.attention is not None:
            return self
        return dataclasses.replace(
            self, attention=Attention.FUSED if flash else Attention.AS_EXPORTED
        )

    @property
    def fused_attention(self) -> bool:
        return self.attention is Attention.FUSED

    def to_json(self) -> dict[str, object]:
        found: dict[str, object] = {
            "optimizer": str(self.optimizer),
            "precision": str(self.precision),
            "micro_batches": self.micro_batches,
            "recompute": self.recompute_text,
        }
        if self.attention is not None:
            found["attention"] = str(self.attention)
        return found

    @staticmethod
    def parse(
        optimizer: str = "adam",
        precision: str = "bf16-mixed",
        micro_batches: int | str = 1,
        recompute: str = "auto",
        attention: str | None = None,
    ) -> Training:
        """Options as a user gives them (flags, a form, a plan document's `training`)."""
        recompute_as, every = parse_recompute(recompute)
        return Training(
            optimizer=parse_choice(Optimizer, str(optimizer), "optimizer"),
            precision=parse_choice(Precision, str(precision), "precision"),
            micro_batches=_integer(micro_batches),
            recompute=recompute_as,
            every=every,
            attention=None if attention is None else parse_choice(
                Attention, str(attention), "attention"),
        )  # fmt: skip

    def __str__(self) -> str:
        return (
            f"training: {self.optimizer} optimizer, {self.precision}, "
            f"{self.micro_batches} micro-batch{'es' if self.micro_batches > 1 else ''}, "
            f"recompute {self.recompute_text}"
            + ("" if self.attention is None else f", attention {self.attention}")
        )


OPTIONS = ("optimizer", "precision", "micro_batches", "recompute", "attention")
"""The options of a training step, as `Training.parse` names them."""


def requested(
    mode: str, given: Mapping[str, Any], spelled: Callable[[str], str], training: str
) -> Training | None:
    """The training step asked for by `mode` and the options `given` (None where not given),
    as the faces take them; options given without mode training are an error naming the
    first, spelled as the face spells it (`--micro-batches`, `form field 'micro_batches'`),
    and how the face asks for training (`--mode training`, `mode=training`)."""
    options = {name: value for name, value in given.items() if value is not None}
    if parse_choice(Mode, mode, "mode") is Mode.INFERENCE:
        if options:
            first = spelled(next(iter(options)))
            raise TrainingError(f"{first} plans a training step: add {training}")
        return None
    return Training.parse(**options)
