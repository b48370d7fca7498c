"""The flags the commands share and how they parse: dims, shapes, the model, HTML, training,
progress, run and cluster flags; the parser that exits with `EXIT_USAGE` on a bad one."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

from autoshard.cost.devices import CLUSTERS, DEVICES
from autoshard.errors import AutoshardError, LimitError
from autoshard.limits import check_elements
from autoshard.passes import Stage

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line, like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class IntermixedParser(Parser):
    """Positionals may follow options (argparse otherwise leaves an optional positional given
    after an option unread)."""

    _mixing = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._mixing:  # parse_known_intermixed_args calls back here
            return super().parse_known_args(args, namespace)
        self._mixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._mixing = False


def dim_flag(text: str) -> tuple[str, int]:
    """`--dim batch=8` -> ("batch", 8)."""
    name, sep, size = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"--dim {text!r} is not NAME=SIZE (e.g. --dim batch=8)")
    try:
        value = int(size)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--dim {text!r}: size {size!r} is not an integer"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--dim {text!r}: size must be >= 1")
    return name.strip(), value


def shape_flag(text: str) -> tuple[int, ...]:
    """`--shape 4x6` -> (4, 6), within the element limit."""
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not like 4x6") from None
    if any(d < 0 for d in dims):
        raise argparse.ArgumentTypeError(f"shape {text!r} has a negative dim")
    try:
        check_elements(dims, f"--shape {text}")
    except LimitError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return dims


def dims_of(pairs: Sequence[tuple[str, int]] | None) -> dict[str, int]:
    """The `--dim` pairs as a dict; a name bound twice to different sizes is an error."""
    dims: dict[str, int] = {}
    for name, size in pairs or ():
        if name in dims and dims[name] != size:
            raise AutoshardError(f"--dim {name} given twice ({dims[name]} and {size})")
        dims[name] = size
    return dims


def model_flags(parser: argparse.ArgumentParser, mesh_from: str | None = None) -> None:
    """The model, its mesh, bound dims and annotations: what propagate, plan and partition
    share. `mesh_from` names where the mesh comes from without --mesh (None: it is required)."""
    parser.add_argument("model", help="path to an .onnx file")
    mesh_help = (
        "device mesh, e.g. 4x8 or dp=4,tp=8" + (f" (or {mesh_from})" if mesh_from else "")
        + f"; {MESH_NAMES}"
    )  # fmt: skip
    parser.add_argument("--mesh", required=mesh_from is None, help=mesh_help)
    parser.add_argument(
        "--dim", action="append", type=dim_flag, metavar="NAME=SIZE", help="bind a symbolic dim"
    )
    parser.add_argument(
        "--annotate",
        action="append",
        metavar="VALUE=SHARDING",
        help="required result annotation, e.g. x='[[0]]' (repeatable)",
    )
    parser.add_argument("--annotations", metavar="FILE", help="annotations JSON file")
    parser.add_argument(
        "--dump-after", action="append", choices=[str(s) for s in Stage], metavar="STAGE",
        help=f"print the program as MLIR to stderr after STAGE ({', '.join(Stage)}; repeatable)",
    )  # fmt: skip


def html_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--html", metavar="REPORT.html",
        help="also write the plan's HTML report (one self-contained file: strategy, mesh, time "
        "and memory charts, weights, tensor layouts)",
    )  # fmt: skip
    parser.add_argument(
        "--html-tensor", action="append", metavar="VALUE",
        help="draw this tensor's layout in the HTML report too (repeatable; the largest weight "
        "is always drawn)",
    )  # fmt: skip


def training_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training step (with --mode training)")
    group.add_argument(
        "--mode", default="inference", metavar="MODE",
        help="inference (the forward pass, default) or training (forward, backward, gradient "
        "sync, optimizer step)",
    )  # fmt: skip
    group.add_argument("--optimizer", help="adam (default), adamw, sgd (momentum) or none")
    group.add_argument(
        "--precision", help="bf16-mixed (default), fp16-mixed, fp8-mixed or fp32: the dtype "
        "of weights, activations and gradients; mixed keeps fp32 master weights and moments; "
        "fp8-mixed is bf16-mixed with the linear layers' matmuls on FP8 tensor cores",
    )  # fmt: skip
    group.add_argument(
        "--loss", help="sum (default: every element of the model's outputs summed) or "
        "cross-entropy (the mean cross-entropy of the first output, the logits, against an "
        "int64 input 'labels', planned with the step: a vocab split is reduced across)",
    )  # fmt: skip
    group.add_argument(
        "--kernels", help="eager (default: each elementwise op its own kernel, a pass over "
        "memory) or compiled (torch.compile: chains of elementwise ops and reductions fused, "
        "their intermediate values kept on chip)",
    )  # fmt: skip
    group.add_argument(
        "--micro-batches", type=int, metavar="N",
        help="gradient accumulation: forward and backward N times per gradient sync (a "
        "pipeline's micro-batches: the batch the model is given is one micro-batch)",
    )  # fmt: skip
    group.add_argument(
        "--recompute", metavar="WHAT", help="what the backward recomputes instead of keeping: "
        "auto (default: the one of the fastest step that fits the memory budget), none, "
        "selective (each attention core's scores and probabilities), selective-op (each "
        "repeated layer but every other linear matmul and its attention kernel, as "
        "TorchTitan's op-level AC), layers (each repeated layer) or layers:K (every K-th "
        "layer)",
    )  # fmt: skip
    group.add_argument(
        "--attention", help="fused (default on GPU presets): plan and price each attention "
        "core as one flash-attention kernel, which keeps no SxS scores; as-exported: op by op",
    )  # fmt: skip
    overlap_flags(group)


def overlap_flags(group: argparse._ArgumentGroup) -> None:
    """How the step's time overlaps communication with compute (`cost.overlap`)."""
    group.add_argument(
        "--prefetch", type=int, metavar="N", help="FSDP all_gathers of weights issued N "
        "gathering ops ahead (FSDP2's prefetch depth; default 1; 0: each where it is needed)",
    )  # fmt: skip
    group.add_argument(
        "--bucket-mb", type=float, metavar="MB", help="gradient syncs launched during the "
        "backward in buckets of MB megabytes of gradients (DDP's bucket_cap_mb; default 25; "
        "0: each gradient as soon as it is computed)",
    )  # fmt: skip
    group.add_argument(
        "--async-tp", action="store_const", const=True, help="run tensor-parallel all_gathers "
        "and reduce_scatters inside their matmuls (async TP) instead of on the critical path",
    )  # fmt: skip
    group.add_argument(
        "--no-overlap", dest="overlap", action="store_const", const=False,
        help="price the step as its compute plus its communication, nothing overlapped",
    )  # fmt: skip


def pipeline_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("pipeline (with --mode training)")
    group.add_argument(
        "--pipeline-axis", metavar="AXIS",
        help="pipeline the repeated layers over this mesh axis (number or name; an axis named "
        "pp is one without this flag): one stage per device on it, --micro-batches per step",
    )  # fmt: skip
    group.add_argument(
        "--schedule", metavar="NAME",
        help="a pipeline's schedule: 1f1b, gpipe, interleaved[:V] (V virtual stages per "
        "device, default 2) or zb-h1 (zero bubble); without it the search picks the fastest "
        "that fits",
    )  # fmt: skip
    group.add_argument(
        "--global-batch", metavar="DIM=SIZE",
        help="the step's global batch along the model's dim DIM (e.g. batch=256), in place of "
        "--dim DIM: a micro-batch is SIZE / --micro-batches of it; with a pipeline and no "
        "--micro-batches the search picks the micro-batches among SIZE's divisors",
    )  # fmt: skip
    group.add_argument(
        "--pipeline", choices=("auto", "none"), default="none",
        help="auto: the search decides whether to pipeline, over how many stages of the "
        "pipeline axis (--pipeline-axis or pp, else the outermost) and how; none (default): only "
        "where asked (an axis named pp, --pipeline-axis)",
    )  # fmt: skip


def progress_flags(parser: argparse.ArgumentParser) -> None:
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument(
        "-q", "--quiet", action="store_true", help="no progress on stderr (errors still are)"
    )
    shown.add_argument(
        "-v", "--verbose", action="store_true",
        help=f"progress from the start (otherwise only once a run passes {PROGRESS_DELAY_S:g} s)",
    )  # fmt: skip


def run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", choices=("gloo", "nccl"), default="gloo",
        help="torch.distributed backend (default gloo; nccl on GPUs)",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=60.0, metavar="S",
        help="seconds a collective may wait for its peers (default 60)",
    )  # fmt: skip


def cluster_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", help=f"device preset: {', '.join(DEVICES)}")
    parser.add_argument(
        "--bandwidth", help="link bandwidth per mesh axis, e.g. 25GB/s,450GB/s (or one for all)"
    )
    parser.add_argument("--latency", help="link latency per mesh axis, e.g. 5us,1us")
    parser.add_argument(
        "--memory", help="the tensors' memory budget per device, e.g. 16GiB (default: the "
        "device's memory less its reserve for the CUDA context, NCCL and fragmentation)",
    )  # fmt: skip
    parser.add_argument(
        "--cluster",
        metavar="FILE|PRESET",
        help=f"cluster file (JSON or YAML) or preset: {', '.join(CLUSTERS)}",
    )


MESH_NAMES = (
    "axis names are labels only: the plan gives each axis its role (data, tensor or other "
    "parallelism) by cost alone, so it may split weights over the axis named dp; one "
    "exception: plan pipelines the layers over an axis named pp"
)
"""What `--mesh`'s help says of axis names: they name axes in outputs and hint nothing, but
for `pp` (`search.pipelined.PIPELINE_AXIS`), which asks `plan` for a pipeline."""
PROGRESS_DELAY_S = 1.0  # a run quicker than this shows no progress (unless --verbose)
