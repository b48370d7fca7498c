"""The HTTP routes: parse, check, queue in the store (a replica's dispatcher runs the job),
format. No planning logic lives here; `autoshard.pipeline.plan_request` does the work in a
worker process.

Status codes:
- 202: a solve was queued.
- 200: an identical request's job was found (with its plan when done); one that failed on
  its input (an infeasible budget) answers 422 with its error instead.
- 400: a malformed form; 404: no such plan; 413: too large; 415: not multipart.
- 409: the plan is not done yet, or failed for a reason unrelated to the request.
- 422: bad input, with the message `autoshard plan` prints (`autoshard: error: <message>`).
- 503: the job store (PostgreSQL) was unreachable for longer than its retries; retry later.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import anyio
from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from autoshard.document.plan_document import document_text
from autoshard.errors import AutoshardError
from autoshard.export import Target, export_document
from autoshard.pipeline import plan_inputs
from service.options import (
    FORM_SCHEMA,
    PlanOptions,
    RequestError,
    in_form_words,
    parse_options,
)
from service.store import Job, Store
from service.upload import Form, discard, keep, receive_form

router = APIRouter()

_ID = re.compile(r"[0-9a-f]{20}")


class Submitted(BaseModel):
    id: str
    status: Literal["queued", "running", "done", "failed"]


class ProgressView(BaseModel):
    """Where a running job is (its last, when it ended): `autoshard.progress.Progress`."""

    stage: str | None  # a stage of autoshard.pipeline.PipelineStage
    detail: str = ""
    elapsed_s: float | None = None  # since the job started (until it finished)
    objective: float | None = None  # the best plan's, in unit, during a solve
    bound: float | None = None  # the proven lower bound, in unit
    unit: str = "s"  # s (a time objective) or B (bytes)


class JobView(Submitted):
    progress: ProgressView | None
    error: str | None
    plan: dict[str, Any] | None  # exactly what `autoshard plan --json` prints


class JobItem(Submitted):
    """A job as GET /v1/plans lists it: what it was asked and where its results are."""

    model: str  # the uploaded file's name
    mesh: str  # the mesh field as given
    created: str  # when it was submitted, ISO 8601 UTC
    links: dict[str, str]  # job (the job), page (its web page); when done, its results


class JobList(BaseModel):
    plans: list[JobItem]  # newest first
    next: str | None  # the next page's URL, or None on the last page


ARTIFACTS = ("plan.json", "report.html", "report.md", "spmd.mlir")
"""What a done job serves under /v1/plans/ID/, as GET /v1/plans links them."""


def job_links(job: Job) -> dict[str, str]:
    """The job's URLs: its JSON and web page, and its results once it is done."""
    if job.options.get("kind") == "sweep":
        return {"job": f"/v1/sweeps/{job.id}", "page": f"/sweeps/{job.id}"}
    base = f"/v1/plans/{job.id}"
    results = {name: f"{base}/{name}" for name in ARTIFACTS} if job.status == "done" else {}
    return {"job": base, "page": f"/plans/{job.id}", **results}


def job_item(job: Job) -> dict[str, Any]:
    created = datetime.fromtimestamp(job.created, UTC).isoformat(timespec="seconds")
    return {"id": job.id, "status": job.status, "model": job.model_name,
            "mesh": str(job.options.get("mesh")), "created": created.replace("+00:00", "Z"),
            "links": job_links(job)}  # fmt: skip


class ErrorBody(BaseModel):
    detail: str


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in (
        (400, "malformed form"),
        (413, "model or form field too large"),
        (415, "not multipart/form-data"),
        (422, "bad input: the message autoshard plan prints"),
    )
}


def _store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": in_form_words(message)}, status_code=status)


@router.post(
    "/v1/plans",
    status_code=202,
    response_model=Submitted,
    responses={200: {"model": JobView, "description": "an identical request's job"}, **_ERRORS},
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"multipart/form-data": {"schema": FORM_SCHEMA}},
        }
    },
    summary="Plan a model: upload it with the options of autoshard plan",
)
async def submit_plan(request: Request) -> JSONResponse:
    try:
        form = await receive(request)
    except RequestError as error:
        return _error(error.status, str(error))
    try:
        status, body = await submit(request, form)
    except RequestError as error:
        return _error(error.status, str(error))
    finally:
        discard(form)
    return JSONResponse(body, status_code=status)


MAX_LISTED = 100  # jobs per page of GET /v1/plans at most


@router.get(
    "/v1/plans",
    response_model=JobList,
    summary="The plans, newest first, a page at a time (limit, offset)",
)
def list_plans(
    request: Request,
    limit: int = Query(default=20, ge=1, le=MAX_LISTED),
    offset: int = Query(default=0, ge=0),
) -> dict[str, Any]:
    jobs = _store(request).recent(limit + 1, offset)  # one more: is there a next page?
    more = len(jobs) > limit
    return {
        "plans": [job_item(job) for job in jobs[:limit]],
        "next": f"/v1/plans?limit={limit}&offset={offset + limit}" if more else None,
    }


async def receive(request: Request) -> Form:
    """The multipart form of a plan request, its model streamed to the uploads folder (the
    caller discards it); RequestError with the HTTP status when it is not one."""
    settings = request.app.state.settings
    return await receive_form(
        request.headers.get("content-type", ""), request.stream(), settings.uploads,
        settings.max_upload,
    )  # fmt: skip


async def submit(request: Request, form: Form) -> tuple[int, dict[str, Any]]:
    """Check a received plan request and queue its job (202), or find an identical request's
    job (200): the status code and the body. Bad input raises RequestError with its status
    (an AutoshardError is a 422). POST /v1/plans and the web page's form both submit here."""
    try:
        return await _submit(request, form)
    except RequestError:
        raise
    except AutoshardError as error:
        raise RequestError(str(error)) from None


async def _submit(request: Request, form: Form) -> tuple[int, dict[str, Any]]:
    settings = request.app.state.settings
    options = parse_options(form.fields, settings.max_time_limit)
    status, body = await anyio.to_thread.run_sync(
        _queue, _store(request), settings.models, form, options
    )
    if status == 202:
        request.app.state.dispatcher.poke()  # a replica with a free worker claims it
    return status, body


def _queue(
    store: Store, models: Path, form: Form, options: PlanOptions
) -> tuple[int, dict[str, Any]]:
    """Queue a checked request's job (202) or find an identical request's (200), off the
    event loop: a store that stalls (PostgreSQL restarting) stalls this request alone."""
    job_id = options.job_id(form.sha256)
    found = store.get(job_id)
    if found is not None and found.status == "failed" and found.cause == "input":
        raise RequestError(found.error or "failed")  # found solving: an infeasible budget
    if found is not None and not found.retryable:
        return 200, found.view()
    if found is None:
        assert form.path is not None
        _check(form.path, options)
    model = keep(form, models)
    if found is None:
        if not store.create(job_id, form.sha256, str(model), options.to_json()):
            job = store.get(job_id)  # an identical request was faster
            assert job is not None
            return 200, job.view()
    elif store.requeue(job_id) is None:  # requeued by an identical request meanwhile
        job = store.get(job_id)
        assert job is not None
        return 200, job.view()
    return 202, {"id": job_id, "status": "queued"}


def _check(model: Path, options: PlanOptions) -> None:
    """What `autoshard plan` checks before it searches (model, mesh, cluster, annotations),
    with the message it prints for `autoshard plan NAME.onnx`: the model by its own name."""
    try:
        plan_inputs(options.request(model))
    except AutoshardError as error:
        raise RequestError(str(error).replace(str(model), model.name)) from None


def _job(request: Request, job_id: str) -> Job:
    job = _store(request).get(job_id) if _ID.fullmatch(job_id) else None
    if job is None or job.options.get("kind") == "sweep":  # a sweep: /v1/sweeps/{id}
        raise HTTPException(404, f"no plan {job_id!r}")
    return job


@router.get(
    "/v1/plans/{job_id}",
    response_model=JobView,
    responses={404: {"model": ErrorBody}},
    summary="A plan job: status, progress, error, and the plan when done",
)
def get_plan(request: Request, job_id: str) -> dict[str, Any]:
    view = _job(request, job_id).view()
    return view | {"error": view["error"] and in_form_words(view["error"])}


@router.get(
    "/v1/plans/{job_id}/plan.json",
    responses={404: {"model": ErrorBody}, 409: {"model": ErrorBody}, 422: {"model": ErrorBody}},
    summary="The plan document alone, as autoshard plan -o writes it (for partition --plan)",
)
def get_plan_document(request: Request, job_id: str) -> Response:
    job = _done(request, job_id)
    assert job.plan is not None
    return Response(document_text(job.plan), media_type="application/json")


def _done(request: Request, job_id: str) -> Job:
    """A job that is done; else 404, 409 (not yet, or failed not for its input) or 422."""
    job = _job(request, job_id)
    if job.status == "failed":
        raise HTTPException(422 if job.cause == "input" else 409, in_form_words(job.error or ""))
    if job.status != "done":
        raise HTTPException(
            409, f"plan {job_id} is {job.status}; poll GET /v1/plans/{job_id} until it is done"
        )
    return job


def _artifact(request: Request, job_id: str, column: str) -> str:
    _done(request, job_id)
    text, error = _store(request).artifact(job_id, column)
    if text is None:
        raise HTTPException(422, error or f"plan {job_id} has no {column}")
    return text


_TEXT_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody}, 409: {"model": ErrorBody}, 422: {"model": ErrorBody},
}  # fmt: skip


@router.get(
    "/v1/plans/{job_id}/spmd.mlir",
    response_class=PlainTextResponse,
    responses=_TEXT_ERRORS,
    summary="The plan's SPMD program (MLIR, mesh dialect), as autoshard partition writes it",
)
def get_spmd(request: Request, job_id: str) -> PlainTextResponse:
    return PlainTextResponse(_artifact(request, job_id, "spmd"))


@router.get(
    "/v1/plans/{job_id}/report.md",
    response_class=PlainTextResponse,
    responses=_TEXT_ERRORS,
    summary="The plan as a Markdown report",
)
def get_report(request: Request, job_id: str) -> PlainTextResponse:
    return PlainTextResponse(
        _artifact(request, job_id, "report"), media_type="text/markdown; charset=utf-8"
    )


@router.get(
    "/v1/plans/{job_id}/report.html",
    response_class=HTMLResponse,
    responses=_TEXT_ERRORS,
    summary="The plan as one self-contained HTML page (what autoshard plan --html writes); "
    "tensor=NAME (repeatable) draws that tensor's layout too",
)
async def get_report_html(
    request: Request,
    job_id: str,
    tensor: list[str] = Query(default=[]),  # noqa: B008
) -> HTMLResponse:
    job, text = await anyio.to_thread.run_sync(_built_report, request, job_id, tensor)
    if text is None:
        try:
            text = await request.app.state.executor.report(job_id, tuple(tensor))
        except AutoshardError as error:
            raise HTTPException(422, _named(str(error), job.model_path)) from None
    return HTMLResponse(text)


def _built_report(request: Request, job_id: str, tensor: list[str]) -> tuple[Job, str | None]:
    """The done job and its HTML report with these tensors, if built (by the job, or asked
    before); the job's error otherwise."""
    job = _job(request, job_id)
    _artifact(request, job_id, "report")
    return job, _store(request).report_html(job_id, tensor)


def _named(message: str, model_path: str) -> str:
    """An error about a stored model, naming it by its file name, not the server's path."""
    return message.replace(model_path, Path(model_path).name)


_EXPORT_MEDIA = {"dtensor": "text/x-python", "jax": "application/json",
                 "onnx": "application/octet-stream"}  # fmt: skip


@router.get(
    "/v1/plans/{job_id}/export/{target}",
    responses=_TEXT_ERRORS,
    summary="The plan as autoshard export writes it: dtensor (an apply_plan module), jax "
    "(PartitionSpecs JSON) or onnx (the model with IR v11 sharding metadata)",
)
async def get_export(request: Request, job_id: str, target: Target) -> Response:
    job = await anyio.to_thread.run_sync(_done, request, job_id)
    assert job.plan is not None
    try:
        exported = await anyio.to_thread.run_sync(
            export_document, job.plan, job.model_path, target, None, f"{job_id}.json"
        )
    except AutoshardError as error:
        raise HTTPException(422, _named(str(error), job.model_path)) from None
    return Response(exported.payload, media_type=_EXPORT_MEDIA[target])


@router.get("/healthz", summary="Liveness, the worker count and the jobs by status")
def healthz(request: Request) -> dict[str, Any]:
    return {
        "status": "ok",
        "workers": request.app.state.executor.workers,
        "jobs": _store(request).counts(),
    }
