"""The options of a plan request: the form fields of POST /v1/plans, named like the flags of
`autoshard plan`, checked and put in a canonical form.

The canonical form is what makes two requests identical: the model's sha256 plus
`PlanOptions.to_json()` (defaults filled in, dims sorted, annotations re-serialized with sorted
keys) hash to the job id, so `{"batch": 8}` and `{ "batch":8 }` are the same request.

    >>> o = parse_options({"mesh": "2x2", "dims": '{"batch": 8}'}, max_time_limit=600)
    >>> o.to_json()["dims"], str(o.objective), o.time_limit
    ({'batch': 8}, 'time', 60.0)
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import re
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoshard.annotations import Annotation, parse_annotations
from autoshard.cost.cluster import load_cluster_file, make_cluster
from autoshard.cost.devices import CLUSTERS, DEFAULT_DEVICE, DEVICES
from autoshard.cost.schedule import Schedule
from autoshard.errors import AutoshardError, ClusterError, PipelineError
from autoshard.pipeline import PlanRequest
from autoshard.search.microbatch import GlobalBatch
from autoshard.search.options import Objective
from autoshard.search.pipelined import pipeline_ask
from autoshard.training import Mode, Training
from autoshard.training.options import (
    OPTIONS,
    RECOMPUTE_CHOICES,
    Attention,
    Kernels,
    Loss,
    Optimizer,
    Precision,
    Recompute,
    requested,
)

DEFAULT_TIME_LIMIT = 60.0  # `autoshard plan --time-limit`'s default
MODEL_FIELD = "model"


def _choices(kind: type[enum.StrEnum]) -> list[str]:
    return [str(member) for member in kind]


_TRAINING = Training()  # its defaults
PIPELINE_CHOICES = ["auto", "none"]  # `autoshard plan --pipeline`'s


FORM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [MODEL_FIELD, "mesh"],
    "properties": {
        MODEL_FIELD: {"type": "string", "format": "binary", "description": "the ONNX model"},
        "mesh": {"type": "string", "example": "4x8",
                 "description": "device mesh: sizes (4x8) or named axes (dp=4,tp=8)"},
        "dims": {"type": "string", "example": '{"batch": 8}',
                 "description": "the model's symbolic dims, a JSON object of NAME: SIZE"},
        "cluster": {"type": "string", "example": "dgx-h100",
                    "description": f"cluster preset ({', '.join(CLUSTERS)}) or a cluster "
                                   "file's JSON/YAML content (autoshard calibrate's)",
                    "x-multiline": True},
        "device": {"type": "string", "enum": sorted(DEVICES), "default": DEFAULT_DEVICE,
                   "description": "device preset"},
        "bandwidth": {"type": "string", "example": "25GB/s,450GB/s",
                      "description": "link bandwidth per mesh axis (or one for all)"},
        "latency": {"type": "string", "example": "5us,1us",
                    "description": "link latency per mesh axis (or one for all)"},
        "memory": {"type": "string", "example": "16GiB",
                   "description": "budget per device (default: the device's memory)"},
        "annotations": {"type": "string",
                        "description": 'JSON: {"annotations": [{"value": ..., "sharding": ...}]}'},
        "objective": {"type": "string", "enum": _choices(Objective), "default": Objective.TIME,
                      "description": "minimize the step's time or the bytes sent"},
        "time_limit": {"type": "number", "default": DEFAULT_TIME_LIMIT,
                       "description": "the solver's limit, deterministic seconds"},
        "mode": {"type": "string", "enum": _choices(Mode), "default": Mode.INFERENCE,
                 "description": "plan the forward pass or the training step"},
        "optimizer": {"type": "string", "enum": _choices(Optimizer),
                      "default": _TRAINING.optimizer, "description": "training"},
        "precision": {"type": "string", "enum": _choices(Precision),
                      "default": _TRAINING.precision, "description": "training"},
        "micro_batches": {"type": "integer", "default": _TRAINING.micro_batches,
                          "description": "training: forward and backward N times per sync"},
        "recompute": {"type": "string",
                      "pattern": f"^({'|'.join(_choices(Recompute))})$|^layers:[1-9][0-9]*$",
                      "default": _TRAINING.recompute,
                      "description": "training: what the backward recomputes: "
                                     + RECOMPUTE_CHOICES + " (default: the search decides)"},
        "attention": {"type": "string", "enum": _choices(Attention),
                      "description": "training: fused (default on GPU presets: flash-attention "
                                     "kernels, no SxS scores kept) or as-exported (op by op)"},
        "loss": {"type": "string", "enum": _choices(Loss), "default": _TRAINING.loss,
                 "description": "training: the outputs summed, or the first output's "
                                "cross-entropy against an int64 input labels"},
        "kernels": {"type": "string", "enum": _choices(Kernels), "default": _TRAINING.kernels,
                    "description": "training: eager (an op a kernel) or compiled (elementwise "
                                   "chains fused)"},
        "prefetch": {"type": "integer", "default": _TRAINING.overlap.prefetch,
                     "description": "training: FSDP all_gathers issued N gathering ops ahead"},
        "bucket_mb": {"type": "number", "default": _TRAINING.overlap.bucket_mb,
                      "description": "training: gradient syncs in buckets of MB megabytes"},
        "async_tp": {"type": "boolean", "default": _TRAINING.overlap.async_tp,
                     "description": "training: tensor-parallel collectives inside matmuls"},
        "overlap": {"type": "boolean", "default": _TRAINING.overlap.enabled,
                    "description": "training: false prices compute plus communication"},
        "global_batch": {"type": "string", "example": "batch=64",
                         "description": "training: the step's global batch along the model's "
                                        "dim DIM, DIM=SIZE, in place of that dim in dims: a "
                                        "micro-batch is SIZE / micro_batches of it; with a "
                                        "pipeline and no micro_batches the search picks them"},
        "pipeline_axis": {"type": "string", "example": "0",
                          "description": "training: pipeline the repeated layers over this "
                                         "mesh axis (a number or name; an axis named pp is "
                                         "one without this field)"},
        "pipeline": {"type": "string", "enum": PIPELINE_CHOICES, "default": "none",
                     "description": "training: auto: the search decides whether to pipeline, "
                                    "over how many stages of the pipeline axis (pipeline_axis "
                                    "or pp, else the outermost); none: only where asked"},
        "schedule": {"type": "string", "example": "1f1b",
                     "description": "training with a pipeline (an axis named pp, "
                                    "pipeline_axis or pipeline=auto): the schedule, 1f1b "
                                    "(default), gpipe, interleaved[:V] or zb-h1"},
    },
}  # fmt: skip
"""The form of POST /v1/plans, field by field (its OpenAPI schema and the web page's form)."""
FIELDS = tuple(name for name in FORM_SCHEMA["properties"] if name != MODEL_FIELD)

_FLAG = re.compile(r"--([a-z][a-z-]*)(?: ([^\s;,)]+))?")


def in_form_words(message: str, web: bool = False) -> str:
    """A library message in the words of the service's form. The library names an option as
    `autoshard plan`'s flag (`--memory 118000`, `raise --time-limit`); the REST API's form
    field is `memory=118000` (as curl -F sends it), the web page's `the memory field, 118000`.
    Flags that are no field of the form are left as they are.

    >>> in_form_words("the lowest feasible budget is 118000 bytes; --memory 118000)")
    'the lowest feasible budget is 118000 bytes; memory=118000)'
    >>> in_form_words("raise --time-limit; --memory 7", web=True)
    'raise the time_limit field; the memory field, 7'
    """

    def field(flag: re.Match[str]) -> str:
        name, value = flag[1].replace("-", "_"), flag[2]
        if name not in FIELDS:
            return flag[0]
        if value is None:
            return f"the {name} field" if web else name
        return f"the {name} field, {value}" if web else f"{name}={value}"

    return _FLAG.sub(field, message)


class RequestError(AutoshardError):
    """A plan request the service refuses; `status` is its HTTP status code."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    mesh: str
    dims: tuple[tuple[str, int], ...]
    device: str | None = None
    bandwidth: str | None = None
    latency: str | None = None
    memory: str | None = None
    cluster: str | None = None  # a preset's name, or canonical JSON text of a file's keys
    annotations: str | None = None  # canonical JSON text of the annotations document
    objective: Objective = Objective.TIME
    time_limit: float = DEFAULT_TIME_LIMIT
    training: Training | None = None  # mode "training"
    schedule: str | None = None  # a pipeline's, on a mesh with an axis named pp
    global_batch: GlobalBatch | None = None
    pipeline_axis: str | None = None  # as given: a number or an axis name
    pipeline_auto: bool = False  # pipeline=auto: the search decides

    def to_json(self) -> dict[str, Any]:
        trained = (
            {} if self.training is None
            else {"mode": str(Mode.TRAINING), "training": self.training.to_json()}
        )  # fmt: skip
        # Only when given: a request without one keeps the job id it had before the field.
        cluster = {} if self.cluster is None else {"cluster": _cluster_json(self.cluster)}
        cluster |= {} if self.schedule is None else {"schedule": self.schedule}
        cluster |= {} if self.pipeline_axis is None else {"pipeline_axis": self.pipeline_axis}
        cluster |= {"pipeline": "auto"} if self.pipeline_auto else {}
        batch = self.global_batch
        batched: dict[str, Any] = {} if batch is None else {
            "global_batch": [batch.dim, batch.size, batch.micro_batches]}  # fmt: skip
        return {
            "mesh": self.mesh, "dims": dict(self.dims), "device": self.device,
            "bandwidth": self.bandwidth, "latency": self.latency, "memory": self.memory,
            "annotations": json.loads(self.annotations) if self.annotations else None,
            "objective": self.objective, "time_limit": self.time_limit, **cluster, **trained,
            **batched,
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PlanOptions:
        annotations = data.get("annotations")
        canonical = json.dumps(annotations, sort_keys=True) if annotations is not None else None
        cluster = data.get("cluster")
        return cls(
            mesh=data["mesh"], dims=tuple(sorted(data["dims"].items())),
            device=data.get("device"), bandwidth=data.get("bandwidth"),
            latency=data.get("latency"), memory=data.get("memory"),
            cluster=cluster if cluster is None or isinstance(cluster, str)
            else json.dumps(cluster, sort_keys=True),
            annotations=canonical,
            objective=Objective(data.get("objective", Objective.TIME)),
            time_limit=float(data.get("time_limit", DEFAULT_TIME_LIMIT)),
            training=Training.parse(**data["training"]) if data.get("training") else None,
            schedule=data.get("schedule"),
            global_batch=GlobalBatch(*data["global_batch"]) if data.get("global_batch") else None,
            pipeline_axis=data.get("pipeline_axis"),
            pipeline_auto=data.get("pipeline") == "auto",
        )  # fmt: skip

    def parsed_annotations(self) -> tuple[Annotation, ...]:
        if not self.annotations:
            return ()
        return parse_annotations(json.loads(self.annotations), "annotations")

    def request(self, model_path: str | Path) -> PlanRequest:
        """The request of `autoshard plan MODEL` with these options as its flags; a bad mesh
        or cluster field raises its one-line error here, as the flag does in the CLI."""
        annotations = self.parsed_annotations()
        with _cluster_file(self.cluster) as file:
            cluster = make_cluster(
                self.mesh, self.device, self.bandwidth, self.latency, self.memory, file
            )
        return PlanRequest(
            model_path=model_path, cluster=cluster, dims=dict(self.dims),
            annotations=annotations, objective=self.objective, time_limit=self.time_limit,
            training=self.training,
            pipeline=pipeline_ask(
                cluster.mesh, self.pipeline_axis, self.schedule, self.pipeline_auto
            ),
            global_batch=self.global_batch,
        )  # fmt: skip

    def job_id(self, model_sha256: str) -> str:
        """The id of the job for this model and these options (the same for an identical
        request, so a resubmission finds the stored job)."""
        text = json.dumps({"model": model_sha256, "options": self.to_json()}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]


def _cluster_json(cluster: str) -> str | dict[str, Any]:
    """The cluster as the options' JSON holds it: a preset's name, or the file's keys."""
    if cluster in CLUSTERS:
        return cluster
    keys: dict[str, Any] = json.loads(cluster)
    return keys


@contextmanager
def _cluster_file(cluster: str | None) -> Iterator[str | Path | None]:
    """What `make_cluster` takes as `--cluster`: the preset's name, or a file of the keys (a
    temporary one: the request holds the content, not a path on the server)."""
    if cluster is None or cluster in CLUSTERS:
        yield cluster
        return
    with tempfile.TemporaryDirectory(prefix="autoshard-cluster-") as folder:
        path = Path(folder) / "cluster.json"
        path.write_text(cluster)
        try:
            yield path
        except AutoshardError as error:
            raise ClusterError(str(error).replace(str(path), "cluster")) from None


def _cluster(text: str) -> str:
    """A checked cluster field: a preset's name, or a cluster file's content (JSON or YAML)
    checked as `--cluster FILE` checks the file, in canonical JSON. A single word that is no
    preset is a misspelt one: the error names the presets."""
    if text in CLUSTERS:
        return text
    presets = ", ".join(CLUSTERS)
    if re.fullmatch(r"[\w.-]+", text):
        raise RequestError(
            f"unknown cluster preset {text!r}; presets: {presets} (or give a cluster file's "
            "JSON or YAML content)"
        )
    with tempfile.TemporaryDirectory(prefix="autoshard-cluster-") as folder:
        path = Path(folder) / "cluster.yaml"  # YAML reads JSON too
        path.write_text(text)
        try:
            keys = load_cluster_file(path)
        except AutoshardError as error:
            said = str(error).replace(f"cluster file {path}", "cluster")
            raise RequestError(said.replace(str(path), "cluster")) from None
    return json.dumps(keys, sort_keys=True, default=str)


def _json(fields: Mapping[str, str], name: str) -> Any:
    try:
        return json.loads(fields[name])
    except json.JSONDecodeError as error:
        raise RequestError(f"form field '{name}' is not JSON: {error}", 400) from None


def _dims(data: Any) -> tuple[tuple[str, int], ...]:
    if not isinstance(data, dict):
        raise RequestError('dims must be a JSON object of NAME: SIZE, e.g. {"batch": 8}')
    for name, size in data.items():
        if not name.strip():
            raise RequestError('dims: a dim name is empty; write e.g. {"batch": 8}')
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise RequestError(f"dims: size of {name!r} must be an integer >= 1, not {size!r}")
    return tuple(sorted((name.strip(), size) for name, size in data.items()))


def parse_options(fields: Mapping[str, str], max_time_limit: float) -> PlanOptions:
    """Checked options from the form fields (empty fields count as absent)."""
    given = {k: v.strip() for k, v in fields.items() if v.strip()}
    if unknown := sorted(set(given) - set(FIELDS)):
        raise RequestError(
            f"unknown form field {unknown[0]!r}; valid: model, {', '.join(FIELDS)}", 400
        )
    if "mesh" not in given:
        raise RequestError("form field 'mesh' is required (a device mesh, e.g. 4x8)")
    dims = _dims(_json(given, "dims")) if "dims" in given else ()
    annotations = None
    if "annotations" in given:
        data = _json(given, "annotations")
        parse_annotations(data, "annotations")  # AnnotationError: one line, as the CLI says it
        annotations = json.dumps(data, sort_keys=True)
    objective = given.get("objective", Objective.TIME)
    if objective not in set(Objective):
        raise RequestError(f"objective {objective!r} is not one of: {', '.join(Objective)}")
    time_limit = DEFAULT_TIME_LIMIT
    if "time_limit" in given:
        try:
            time_limit = float(given["time_limit"])
        except ValueError:
            raise RequestError(
                f"time_limit {given['time_limit']!r} is not a number of seconds"
            ) from None
        if not math.isfinite(time_limit) or not 0 < time_limit <= max_time_limit:
            raise RequestError(
                f"time_limit {given['time_limit']} must be > 0 and <= {max_time_limit:g} "
                "seconds (the server's --max-time-limit)"
            )
    return PlanOptions(
        mesh=given["mesh"], dims=dims, device=given.get("device"),
        bandwidth=given.get("bandwidth"), latency=given.get("latency"),
        memory=given.get("memory"),
        cluster=_cluster(given["cluster"]) if "cluster" in given else None,
        annotations=annotations, objective=Objective(objective),
        time_limit=time_limit, training=_training(given), schedule=_schedule(given),
        global_batch=_global_batch(given, dims), pipeline_axis=given.get("pipeline_axis"),
        pipeline_auto=_pipeline(given),
    )  # fmt: skip


def _pipeline(given: Mapping[str, str]) -> bool:
    """The `pipeline` field: whether the search decides (auto), checked."""
    value = given.get("pipeline", "none")
    if value not in PIPELINE_CHOICES:
        raise RequestError(f"pipeline {value!r} is not one of: {', '.join(PIPELINE_CHOICES)}")
    return value == "auto"


def _global_batch(
    given: Mapping[str, str], dims: tuple[tuple[str, int], ...]
) -> GlobalBatch | None:
    """The `global_batch` field with the `micro_batches` field where given (else the search
    picks them, with a pipeline)."""
    if "global_batch" not in given:
        return None
    micro = given.get("micro_batches")
    batch = given["global_batch"]
    if batch.partition("=")[0].strip() in dict(dims):
        raise RequestError(f"global_batch {batch} sets dim {batch.partition('=')[0].strip()}: "
                           "drop it from dims")  # fmt: skip
    if micro and not micro.isdigit():
        raise RequestError(f"micro_batches {micro!r} is not an integer")
    try:
        return GlobalBatch.parse(batch, int(micro) if micro else None)
    except PipelineError as error:
        raise RequestError(in_form_words(str(error))) from None


def _schedule(given: Mapping[str, str]) -> str | None:
    """The `schedule` field, checked (its name; whether the mesh has a pipeline is the
    request's check, as the CLI's)."""
    if "schedule" not in given:
        return None
    try:
        return Schedule.parse(given["schedule"]).flag
    except PipelineError as error:
        raise RequestError(str(error)) from None


def _training(given: Mapping[str, str]) -> Training | None:
    """The training step of fields `mode` (default inference) and its options."""
    options = {name: given.get(name) for name in OPTIONS}
    return requested(
        given.get("mode", str(Mode.INFERENCE)),
        options,
        lambda name: f"form field {name!r}",
        "mode=training",
    )
