"""User sharding annotations: `mesh.shard` and `mesh.annotate` (docs/design/propagation.md).

An annotation pins (`required`) or suggests (a hint) the sharding of one value, either as the
value is produced (`for: "result"`, `mesh.shard %v to %s`) or as its users see it
(`for: "users"`, `mesh.shard ... annotate_for_users`). The file format, shared by the CLI's
`--annotations FILE` and the REST API:

    {"annotations": [{"value": "x", "sharding": "[[], [], [0]]", "required": true,
                      "for": "result"}]}

`--annotate 'x=[[0]]'` on the command line is a required result annotation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autoshard.errors import AutoshardError, ShardingError
from autoshard.ir.graph import Graph, Op
from autoshard.mesh import Mesh
from autoshard.rules.gradient import TrainOp
from autoshard.sharding import Sharding

FOR_CHOICES = ("result", "users")


class AnnotationError(AutoshardError):
    """A malformed annotation, or one naming a value the model does not have."""


@dataclass(frozen=True)
class Annotation:
    value: str
    sharding: Sharding
    required: bool = True
    for_users: bool = False

    def __str__(self) -> str:
        kind = "required" if self.required else "hint"
        side = "users" if self.for_users else "result"
        return f"{self.value}={self.sharding} ({kind}, for {side})"

    def to_json(self) -> dict[str, object]:
        """Its entry in the annotations file format (`parse_annotations` reads it back)."""
        return {"value": self.value, "sharding": str(self.sharding), "required": self.required,
                "for": FOR_CHOICES[self.for_users]}  # fmt: skip


def binds(op: Op) -> bool:
    """Whether an annotation for users binds `op` where it reads the value: every reader but
    a training step's optimizer update, which reads a weight as it is held (its gradient and
    state follow it), not as the weight's users (the forward and its backward) read it."""
    return op.type != TrainOp.UPDATE


def bound_readers(graph: Graph, value: str) -> tuple[Op, ...]:
    """The ops that an annotation for users on `value` binds (`binds`)."""
    return tuple(op for op in graph.consumers(value) if binds(op))


def unread(op: str, op_type: str, value: str, sharding: Sharding, why: str) -> str:
    """The message for an op that cannot read `value` as its required annotation for users
    asks (propagation and the search say it alike)."""
    return (
        f"op '{op}' ({op_type}) cannot read {value!r} as its required annotation for users "
        f"asks, {sharding}: {why}"
    )


def parse_annotate_flag(text: str) -> Annotation:
    """`VALUE=SPEC` from `--annotate`: a required result annotation."""
    value, sep, spec = text.partition("=")
    if not sep or not value.strip():
        raise AnnotationError(f"--annotate {text!r} is not VALUE=SHARDING (e.g. x='[[0]]')")
    try:
        return Annotation(value.strip(), Sharding.parse(spec))
    except ShardingError as error:
        raise AnnotationError(f"--annotate {value.strip()}: {error}") from None


def parse_annotations(data: Any, source: str = "annotations") -> tuple[Annotation, ...]:
    """The annotations of a parsed JSON document (see the module docstring for the format)."""
    if not isinstance(data, dict) or not isinstance(data.get("annotations"), list):
        raise AnnotationError(f'{source}: expected {{"annotations": [...]}}')
    out = []
    for i, entry in enumerate(data["annotations"]):
        where = f"{source}: annotation {i}"
        if not isinstance(entry, dict):
            raise AnnotationError(f"{where} is not an object")
        unknown = sorted(set(entry) - {"value", "sharding", "required", "for"})
        if unknown:
            raise AnnotationError(
                f"{where}: unknown key {unknown[0]!r} (valid: value, sharding, required, for)"
            )
        value, spec = entry.get("value"), entry.get("sharding")
        if not isinstance(value, str) or not value:
            raise AnnotationError(f"{where}: 'value' must name a value of the model")
        if not isinstance(spec, str):
            raise AnnotationError(f"{where} ({value}): 'sharding' must be a string like '[[0]]'")
        required = entry.get("required", True)
        if not isinstance(required, bool):
            raise AnnotationError(f"{where} ({value}): 'required' must be true or false")
        side = entry.get("for", "result")
        if side not in FOR_CHOICES:
            raise AnnotationError(
                f"{where} ({value}): 'for' is {side!r}; valid: {', '.join(FOR_CHOICES)}"
            )
        try:
            sharding = Sharding.parse(spec)
        except ShardingError as error:
            raise AnnotationError(f"{where} ({value}): {error}") from None
        out.append(Annotation(value, sharding, required, side == "users"))
    return tuple(out)


def load_annotations(path: str | os.PathLike[str]) -> tuple[Annotation, ...]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise AnnotationError(f"annotations file '{path}': no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise AnnotationError(f"annotations file '{path}': {error}") from None
    except json.JSONDecodeError as error:
        raise AnnotationError(f"annotations file '{path}': invalid JSON: {error}") from None
    return parse_annotations(data, f"annotations file '{path}'")


def check_annotations(
    annotations: Iterable[Annotation], shapes: Mapping[str, Sequence[int]], mesh: Mesh
) -> None:
    """Every annotated value exists, its sharding fits the value and the mesh, and no two
    required annotations pin one side of a value (its result, or what its users read) apart."""
    pinned: dict[tuple[str, bool], Sharding] = {}
    for annotation in annotations:
        if annotation.value not in shapes:
            raise AnnotationError(
                f"annotation {annotation}: the model has no value {annotation.value!r}"
            )
        try:
            annotation.sharding.check(mesh, shapes[annotation.value])
        except ShardingError as error:
            raise AnnotationError(f"annotation of {annotation.value!r}: {error}") from None
        if annotation.required:
            first = pinned.setdefault((annotation.value, annotation.for_users), annotation.sharding)
            if first != annotation.sharding:
                raise AnnotationError(
                    f"conflicting required annotations of {annotation.value!r}: "
                    f"{first} and {annotation.sharding}"
                )
