"""What a training step is asked to be: optimizer, precision, micro-batches, recompute,
attention, the loss, and how it overlaps communication with compute."""

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


class Loss(enum.StrEnum):
    """What the step differentiates (`training.loss`): the model's outputs summed, or the mean
    cross-entropy of its first output (logits) against labels, planned with the step."""

    SUM = "sum"
    CROSS_ENTROPY = "cross-entropy"


class Kernels(enum.StrEnum):
    """How the step's elementwise ops run (`training.kernels`): each its own kernel and pass
    over memory (eager PyTorch), or chains of them fused into one kernel by a compiler
    (torch.compile), their intermediate values kept on chip (`training.compiled`)."""

    EAGER = "eager"
    COMPILED = "compiled"


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
    SELECTIVE_OP = "selective-op"  # all of a layer but every other linear matmul, as TorchTitan's
    LAYERS = "layers"  # each repeated layer's activations recomputed in its backward
    AUTO = "auto"  # the search's choice: the recomputation of the fastest step that fits


RECOMPUTE_CHOICES = "none, selective, selective-op, layers, layers:K (every K-th layer), auto"


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

DDP_BUCKET_MB = 25.0
"""PyTorch DDP's default gradient bucket (`bucket_cap_mb`), in MB of gradients."""


@dataclass(frozen=True)
class Overlap:
    """How the step runs its communication beside its compute (`cost.overlap`): `prefetch`
    weight all_gathers issued that many gathering ops ahead (FSDP2's prefetch depth; 0: each
    where its op needs it), gradient syncs launched in buckets of `bucket_mb` MB of
    gradients as the backward computes them (DDP's `bucket_cap_mb`; 0: each gradient on its
    own), tensor-parallel all_gathers and reduce_scatters run inside their matmul when
    `async_tp` (PyTorch's async TP), else on the critical path. `enabled` false: nothing
    overlaps, the step is its compute plus its communication."""

    prefetch: int = 1
    bucket_mb: float = DDP_BUCKET_MB
    async_tp: bool = False
    enabled: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int):
            raise TrainingError(f"prefetch must be an integer, got {self.prefetch!r}")
        if self.prefetch < 0:
            raise TrainingError(f"prefetch must be at least 0, got {self.prefetch}")
        if not self.bucket_mb >= 0 or self.bucket_mb == float("inf"):
            raise TrainingError(f"bucket MB must be a finite number >= 0, got {self.bucket_mb}")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)

    def to_json(self) -> dict[str, object]:
        return {"prefetch": self.prefetch, "bucket_mb": self.bucket_mb,
                "async_tp": self.async_tp, "overlap": self.enabled}  # fmt: skip

    def __str__(self) -> str:
        if not self.enabled:
            return "no overlap"
        tp = "async TP" if self.async_tp else "TP on the critical path"
        return f"prefetch {self.prefetch}, buckets of {self.bucket_mb:g} MB, {tp}"


def _flag(text: bool | str, what: str) -> bool:
    """A switch as given: a bool, or its text (a form field, a plan document)."""
    if isinstance(text, bool):
        return text
    if str(text).lower() in ("true", "1", "yes", "on"):
        return True
    if str(text).lower() in ("false", "0", "no", "off"):
        return False
    raise TrainingError(f"{what} must be true or false, got {text!r}")


def parse_overlap(
    prefetch: int | str = 1, bucket_mb: float | str = DDP_BUCKET_MB,
    async_tp: bool | str = False, overlap: bool | str = True,
) -> Overlap:  # fmt: skip
    """`Overlap` from options as a user gives them (flags, a form, a plan document)."""
    try:
        bucket = float(bucket_mb)
    except ValueError:
        raise TrainingError(f"bucket MB must be a number, got {bucket_mb!r}") from None
    return Overlap(
        _integer(prefetch, "prefetch"),
        bucket,
        _flag(async_tp, "async TP"),
        _flag(overlap, "overlap"),
    )


def _integer(text: int | str, what: str = "micro-batches") -> int:
    """A count as given: an int, or the text of one (a form field)."""
    if isinstance(text, int):
        return text
    try:
        return int(text)
    except ValueError:
        raise TrainingError(f"{what} must be an integer, got {text!r}") from None


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
    overlap: Overlap = Overlap()
    loss: Loss = Loss.SUM
    kernels: Kernels = Kernels.EAGER

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
        if self.loss is not Loss.SUM:  # written when chosen: a sum's documents stay as they were
            found["loss"] = str(self.loss)
        if self.kernels is not Kernels.EAGER:  # likewise
            found["kernels"] = str(self.kernels)
        return found | self.overlap.to_json()

    @staticmethod
    def parse(
        optimizer: str = "adam",
        precision: str = "bf16-mixed",
        micro_batches: int | str = 1,
        recompute: str = "auto",
        attention: str | None = None,
        loss: str = "sum",
        kernels: str = "eager",
        **overlap: Any,
    ) -> Training:
        """Options as a user gives them (flags, a form, a plan document's `training`);
        `overlap`: `parse_overlap`'s."""
        recompute_as, every = parse_recompute(recompute)
        return Training(
            optimizer=parse_choice(Optimizer, str(optimizer), "optimizer"),
            precision=parse_choice(Precision, str(precision), "precision"),
            micro_batches=_integer(micro_batches),
            recompute=recompute_as,
            every=every,
            attention=None if attention is None else parse_choice(
                Attention, str(attention), "attention"),
            overlap=parse_overlap(**overlap),
            loss=parse_choice(Loss, str(loss), "loss"),
            kernels=parse_choice(Kernels, str(kernels), "kernels"),
        )  # fmt: skip

    def __str__(self) -> str:
        return (
            f"training: {self.optimizer} optimizer, {self.precision}, "
            f"{self.micro_batches} micro-batch{'es' if self.micro_batches > 1 else ''}, "
            f"recompute {self.recompute_text}"
            + ("" if self.attention is None else f", attention {self.attention}")
            + ("" if self.loss is Loss.SUM else f", loss {self.loss}")
            + ("" if self.kernels is Kernels.EAGER else f", {self.kernels} kernels")
            + ("" if self.overlap == Overlap() else f", {self.overlap}")
        )


OPTIONS = (
    "optimizer",
    "precision",
    "micro_batches",
    "recompute",
    "attention",
    "prefetch",
    "bucket_mb",
    "async_tp",
    "overlap",
    "loss",
    "kernels",
)
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
