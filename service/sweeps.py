"""Sweeps as a job kind: `POST /v1/sweeps` uploads a model with a grid (meshes or device
counts, memory budgets, dims, a cluster or device, a price per device-hour) and queues one job
that runs `autoshard sweep` over it on a worker of any replica; `GET /v1/sweeps/{id}` gives its
progress (points done, best so far, time left) and, done, its table; `/sweeps/{id}` is its web
page: the progress while it runs, then the sweep's own page of fronts.

A sweep job writes its points to DATA/sweeps/ID/ as it goes (the sweep's resumable folder): a
sweep whose replica died is claimed again and continues where it stopped, planning no point
twice. Its table and page are kept in the store with the job (`report` and the kept report).
"""

from __future__ import annotations

import hashlib
import html
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse

from autoshard.errors import AutoshardError
from autoshard.sweep.ask import PIPELINE_CHOICES, SweepAsk, sweep_of
from autoshard.sweep.run import Sweep
from service.options import RequestError
from service.routes import receive
from service.store import Job, Store
from service.upload import Form, discard, keep

router = APIRouter()

DEFAULT_TIME_LIMIT = 60.0
TRAINING = ("optimizer", "precision", "micro_batches", "recompute", "attention")
TEXT = ("mesh", "devices", "cluster", "device", "memory", "pipeline_axis", "schedule",
        "global_batch", *TRAINING)  # fmt: skip
"""The fields kept as typed, checked when the sweep is made (`sweep.ask.sweep_of`)."""
SWEEP_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model"],
    "properties": {
        "model": {"type": "string", "format": "binary", "description": "the ONNX model"},
        "mesh": {"type": "string", "example": "2x2,4",
                 "description": "mesh shapes to plan, comma-separated (or give devices)"},
        "devices": {"type": "string", "example": "4,8",
                    "description": "device counts: every mesh shape of each (or give mesh)"},
        "memory": {"type": "string", "example": "16GiB,40GiB",
                   "description": "budgets per device, comma-separated (default: the device's)"},
        "dims": {"type": "string", "example": '{"batch": [8, 16]}',
                 "description": "the model's symbolic dims, a JSON object of NAME: SIZE or "
                                "[SIZES] (each size a point)"},
        "cluster": {"type": "string", "example": "dgx-h100", "description": "cluster preset"},
        "device": {"type": "string", "description": "device preset"},
        "mode": {"type": "string", "enum": ["inference", "training"], "default": "inference"},
        "price": {"type": "number", "description": "price per device-hour (the cost front)"},
        "time_limit": {"type": "number", "default": DEFAULT_TIME_LIMIT,
                       "description": "each point's limit, seconds"},
        **{name: {"type": "string", "description": f"training: {name} values, comma-separated "
                                                   "(as autoshard plan's), each a point"}
           for name in TRAINING},
        "pipeline_axis": {"type": "string", "example": "0",
                          "description": "training: pipeline the repeated layers over this axis "
                                         "(a number or a name) of every mesh"},
        "pipeline": {"type": "string", "enum": list(PIPELINE_CHOICES), "default": "none",
                     "description": "training: auto: every mesh of two axes or more is also "
                                    "planned pipelined over its first axis (named pp)"},
        "schedule": {"type": "string", "example": "1f1b",
                     "description": "a pipeline's schedule: 1f1b (default), gpipe, "
                                    "interleaved[:V], zb-h1"},
        "global_batch": {"type": "string", "example": "batch",
                         "description": "the dim whose sizes are global batches, split into "
                                        "micro-batches"},
    },
}  # fmt: skip
"""The form of POST /v1/sweeps, field by field (its OpenAPI schema)."""
FIELDS = tuple(name for name in SWEEP_SCHEMA["properties"] if name != "model")


def sweep_options(fields: Mapping[str, str], max_time_limit: float) -> dict[str, Any]:
    """A sweep request's options (JSON), the fields' own syntax checked; RequestError on a bad
    field. What they ask is checked by `checked_sweep`, as `autoshard sweep` checks it."""
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise RequestError(f"unknown field '{unknown[0]}'; a sweep takes {', '.join(FIELDS)}")
    if bool(fields.get("mesh")) == bool(fields.get("devices")):
        raise RequestError("give the mesh field (e.g. 2x2,4) or devices (e.g. 4,8), not both")
    try:
        dims = json.loads(fields.get("dims") or "{}")
        dims = {str(k): [v] if isinstance(v, int) else [int(x) for x in v] for k, v in dims.items()}
    except (ValueError, TypeError, AttributeError):
        raise RequestError('dims is not JSON of sizes, e.g. {"batch": [8, 16]}') from None
    mode = fields.get("mode") or "inference"
    if mode not in ("inference", "training"):
        raise RequestError(f"mode '{mode}': choose inference or training")
    try:
        price = float(fields["price"]) if fields.get("price") else None
        limit = float(fields.get("time_limit") or DEFAULT_TIME_LIMIT)
    except ValueError:
        raise RequestError("price and time_limit are numbers") from None
    if not 0 < limit <= max_time_limit:
        raise RequestError(f"time_limit {limit}: choose in (0, {max_time_limit}] seconds")
    return {"kind": "sweep", **{name: fields.get(name) or None for name in TEXT}, "dims": dims,
            "mode": mode, "price": price, "time_limit": limit,
            "pipeline": fields.get("pipeline") or "none"}  # fmt: skip


def checked_sweep(options: Mapping[str, Any], model: Path, out: Path) -> Sweep:
    """The sweep a job's options ask, on `model`, written to `out`: every point checked."""
    return sweep_of(SweepAsk(
        model=model, out=out, devices=options["devices"], mesh=options["mesh"],
        cluster=options["cluster"], device=options["device"], memory=options["memory"],
        dims=options["dims"], mode=options["mode"],
        training={name: options[name] for name in TRAINING}, time_limit=options["time_limit"],
        price=options["price"], pipeline_axis=options["pipeline_axis"],
        pipeline=options["pipeline"], schedule=options["schedule"],
        global_batch=options["global_batch"],
    ))  # fmt: skip


def is_sweep(job: Job) -> bool:
    return job.options.get("kind") == "sweep"


def run_sweep_job(store: Store, job_id: str, attempt: int, model_path: str, options: dict) -> None:
    """Run a claimed sweep job (on a worker) into DATA/sweeps/ID and keep its table and page."""
    from autoshard.sweep.run import run_sweep

    out = Path(model_path).parents[2] / "sweeps" / job_id
    sweep = checked_sweep(options, Path(model_path), out)

    def tell(line: str) -> None:
        store.progress(job_id, attempt, {"stage": None, "detail": line})

    run_sweep(sweep, tell)
    store.finish_sweep(job_id, attempt, (out / "points.json").read_text(),
                       (out / "front.html").read_text())  # fmt: skip


@router.post(
    "/v1/sweeps",
    status_code=202,
    summary="Sweep a model over a grid of plans",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"multipart/form-data": {"schema": SWEEP_SCHEMA}},
        }
    },
)
async def submit_sweep(request: Request) -> JSONResponse:
    settings, store = request.app.state.settings, request.app.state.store
    try:
        form = await receive(request)
    except RequestError as error:
        return JSONResponse({"detail": str(error)}, status_code=error.status)
    try:
        options = sweep_options(form.fields, settings.max_time_limit)
        model = form.path or Path()  # (`receive` refuses a form without its model)
        await anyio.to_thread.run_sync(checked_sweep, options, model, model.parent)
        status, body = await anyio.to_thread.run_sync(
            _queue_sweep, store, settings.models, form, options
        )
    except AutoshardError as error:
        return JSONResponse({"detail": str(error)}, status_code=getattr(error, "status", 422))
    finally:
        discard(form)
    if status == 202:
        request.app.state.dispatcher.poke()
    return JSONResponse(body, status_code=status)


def _queue_sweep(
    store: Store, models: Path, form: Form, options: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    """Queue a sweep's job (202) or find an identical request's (200), off the event loop."""
    job_id = hashlib.sha256(json.dumps([form.sha256, options]).encode()).hexdigest()[:20]
    found = store.get(job_id)
    if found is not None and not found.retryable:
        return 200, sweep_view(store, found)
    model = keep(form, models)
    if found is None:
        store.create(job_id, form.sha256, str(model), options)
    else:
        store.requeue(job_id)
    return 202, {"id": job_id, "status": "queued"}


def sweep_view(store: Store, job: Job) -> dict[str, Any]:
    """A sweep job as GET /v1/sweeps/{id} shows it: `points` once done (points.json)."""
    table = store.artifact(job.id, "report")[0] if job.status == "done" else None
    points = json.loads(table)["points"] if table else None
    return {"id": job.id, "status": job.status, "progress": job.progress_view(),
            "error": job.error, "points": points}  # fmt: skip


def _sweep(request: Request, job_id: str) -> Job:
    job = request.app.state.store.get(job_id)
    if job is None or not is_sweep(job):
        raise HTTPException(404, f"no sweep {job_id!r}")
    return job


@router.get("/v1/sweeps/{job_id}", summary="A sweep: status, progress, its table when done")
def get_sweep(request: Request, job_id: str) -> dict[str, Any]:
    return sweep_view(request.app.state.store, _sweep(request, job_id))


@router.get("/sweeps/{job_id}", response_class=HTMLResponse, include_in_schema=False)
def sweep_page(request: Request, job_id: str) -> HTMLResponse:
    """The sweep's page of fronts once done; before, its progress, refreshed every second."""
    job = _sweep(request, job_id)
    if job.status == "done":
        return HTMLResponse(request.app.state.store.report_html(job_id, ()))
    detail = (job.progress or {}).get("detail") or ""
    said = job.error or detail or "waiting for a worker"
    refresh = '<meta http-equiv="refresh" content="1">' if job.status != "failed" else ""
    return HTMLResponse(
        f"<!doctype html><html><head><meta charset='utf-8'>{refresh}<title>autoshard sweep "
        f"{job.id}</title></head><body><h1>Sweep <code>{job.id}</code></h1><p id='status'>"
        f"{job.status}</p><p id='progress'>{_escape(said)}</p></body></html>"
    )


def _escape(text: str) -> str:
    return html.escape(text)
