"""The HTML report of a plan: one self-contained page with the strategy, the mesh, where the
time and memory go, the weights and tensor layouts as pictures (`page.html_report`), written
by `autoshard plan --html`, `autoshard propagate --html` and `autoshard html PLAN.json`, and
served at `GET /v1/plans/ID/report.html`.

`markup` holds the escaping and SVG primitives, `mesh` draws a mesh, `tensor` a tensor's
layout over it, `charts` the time bars and the memory curve, `weights` the weights table
(one row per role of a repeated layer), `page` the sections.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from autoshard.document.plan_document import PlanDocument
from autoshard.files import write_atomic
from autoshard.html.page import ReportError, ReportInputs, html_report
from autoshard.ir.onnx_import import file_weights, load_model
from autoshard.names import recover_names
from autoshard.pipeline import Lowered, lower_document

__all__ = ["ReportError", "ReportInputs", "html_report", "plan_html", "write_html"]


def parameter_names(model: str | Path) -> dict[str, tuple[str, ...]]:
    """Each ONNX weight's source-model parameter names, where the model tells them
    (`export.names.recover_names`, without a checkpoint)."""
    proto = load_model(model)
    names = recover_names(proto, file_weights(proto, model))
    return {weight: tuple(p.name for p in entry.params) for weight, entry in names.items()}


def plan_html(
    document: PlanDocument,
    model: str | Path,
    tensors: Sequence[str] = (),
    lowered: Lowered | None = None,
) -> str:
    """The report of a plan document made from the ONNX model at `model`; `lowered` is its
    graph, plan and program when the caller has them (else the saved plan is lowered again:
    the same program)."""
    lowered = lowered or lower_document(document, model)
    inputs = ReportInputs(document, lowered.graph, lowered.plan, lowered.program,
                          parameter_names(model), tuple(tensors))  # fmt: skip
    return html_report(inputs)


def write_html(path: str | Path, text: str) -> None:
    write_atomic(Path(path), text.encode())
