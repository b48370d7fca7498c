"""The service's web page: plain HTML over the same routes' logic, no build step and nothing
fetched from elsewhere.

    GET  /            the upload form (the fields of POST /v1/plans, from its schema) and the
                      latest plans, with links to their reports and plan JSON
    POST /            the form submitted: the plan's page (303), or the form again with the
                      error in words and the values as given
    GET  /plans/{id}  a plan's status and progress, polled by a few lines of inline script
                      until it is done or failed; then its links, strategy, step time and
                      memory, the standard recipes priced beside it, or its error

Every string from a user or a model (file names, options, errors) is escaped.
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterable, Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from autoshard.document.plan_document import PlanDocument
from autoshard.document.recipes import RECIPE_HEADER, recipe_cells
from autoshard.progress import Progress
from autoshard.units import format_bytes, format_seconds
from service.options import FORM_SCHEMA, MODEL_FIELD, RequestError, in_form_words
from service.routes import receive, submit
from service.store import Job, Store
from service.upload import discard

router = APIRouter(include_in_schema=False)

LISTED = 50  # plans listed on the page, newest first
POLL_MS = 1000

_STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 70em; padding: 0 1em;
       color: #1b1f24; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; }
form { display: grid; grid-template-columns: 11em 22em 1fr; gap: .45em 1em; align-items: center; }
label { font-weight: 600; } .hint { color: #57606a; font-size: .9em; }
input, select, textarea { font: inherit; padding: .2em .35em; }
button { font: inherit; padding: .35em 1.4em; grid-column: 2; justify-self: start; }
.error { background: #ffebe9; border: 1px solid #cf222e; padding: .6em .9em; color: #82071e; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: .3em .6em; border-bottom: 1px solid #d0d7de; }
.done { color: #1a7f37; } .failed { color: #cf222e; } .queued, .running { color: #9a6700; }
dl { display: grid; grid-template-columns: 9em 1fr; gap: .3em 1em; } dt { font-weight: 600; }
code { font-size: .95em; }
"""


def _page(title: str, body: str, head: str = "") -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<link rel="icon" href="data:,"><title>{_e(title)}</title>'
        f"<style>{_STYLE}</style>{head}</head>\n<body><main>{body}</main></body></html>\n"
    )


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


# ---- the form and the list -----------------------------------------------------------------


def _field(name: str, spec: Mapping[str, Any], value: str, required: bool) -> str:
    """One row of the form: label, input (a select for a closed vocabulary), hint."""
    need = " required" if required else ""
    if spec.get("format") == "binary":
        control = f'<input type="file" id="{name}" name="{name}" accept=".onnx"{need}>'
    elif "enum" in spec or spec.get("type") == "boolean":
        said = spec.get("default")
        said = str(said).lower() if isinstance(said, bool) else said  # JSON's spelling
        default = f" ({_e(said)})" if said is not None else ""
        options = [f'<option value="">default{default}</option>'] + [
            f"<option{' selected' if value == choice else ''}>{_e(choice)}</option>"
            for choice in spec.get("enum", ("true", "false"))
        ]
        control = f'<select id="{name}" name="{name}">{"".join(options)}</select>'
    elif spec.get("x-multiline"):  # a file's content, pasted
        example = f'placeholder="e.g. {_e(spec["example"])}"'
        control = f'<textarea id="{name}" name="{name}" rows="2" {example}>{_e(value)}</textarea>'
    else:
        example = (
            f'placeholder="default {_e(spec["default"])}"' if "default" in spec
            else f'placeholder="e.g. {_e(spec["example"])}"' if "example" in spec
            else ""
        )  # fmt: skip
        control = (
            f'<input type="text" id="{name}" name="{name}" value="{_e(value)}" {example}{need}>'
        )
    hint = _e(spec.get("description", ""))
    return f'<label for="{name}">{name}</label>{control}<span class="hint">{hint}</span>'


def _form(values: Mapping[str, str]) -> str:
    required = set(FORM_SCHEMA["required"])
    rows = [
        _field(name, spec, values.get(name, ""), name in required)
        for name, spec in FORM_SCHEMA["properties"].items()
    ]
    return (
        '<form method="post" action="/" enctype="multipart/form-data">'
        + "".join(rows)
        + '<button type="submit">Plan</button></form>'
    )


def _when(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def _setup(job: Job) -> str:
    """`mesh 2x2, batch=8, training`: what the job was asked, in short."""
    options = job.options
    dims = ", ".join(f"{k}={v}" for k, v in options.get("dims", {}).items())
    parts = [f"mesh {options.get('mesh')}", dims, options.get("mode", "inference")]
    return ", ".join(part for part in parts if part)


def _links(job: Job) -> str:
    if job.status != "done":
        return ""
    base = f"/v1/plans/{job.id}"
    links = (("report.html", "report"), ("plan.json", "plan JSON"), ("report.md", "Markdown"),
             ("spmd.mlir", "SPMD program"))  # fmt: skip
    return " · ".join(f'<a href="{base}/{path}">{text}</a>' for path, text in links)


def _listing(jobs: Iterable[Job]) -> str:
    rows = [
        f'<tr><td><a href="/plans/{job.id}"><code>{job.id}</code></a></td>'
        f"<td>{_e(job.model_name)}</td><td>{_e(_setup(job))}</td>"
        f'<td class="{_e(job.status)}">{_e(job.status)}</td><td>{_e(_when(job.created))}</td>'
        f"<td>{_links(job)}</td></tr>"
        for job in jobs
    ]
    if not rows:
        return "<p>No plans yet.</p>"
    head = "<tr><th>plan</th><th>model</th><th>setup</th><th>status</th><th>submitted</th>"
    return f'<table id="plans">{head}<th></th></tr>{"".join(rows)}</table>'


def _index(store: Store, values: Mapping[str, str], error: str | None = None) -> str:
    shown = f'<p class="error" id="error" role="alert">{_e(error)}</p>' if error else ""
    body = (
        "<h1>autoshard</h1><p>Upload an ONNX model and the options of <code>autoshard plan"
        '</code>; the REST API behind this page is at <a href="/docs">/docs</a>.</p>'
        f"{shown}{_form(values)}<h2>Plans</h2>{_listing(store.recent(LISTED))}"
    )
    return _page("autoshard", body)


@router.get("/favicon.ico")
async def favicon() -> Response:
    """No icon: said without an error, for the pages a browser shows without ours (JSON)."""
    return Response(status_code=204)


@router.get("/", response_class=HTMLResponse)
def index(request: Request) -> HTMLResponse:
    return HTMLResponse(_index(_store(request), {}))


@router.post("/", response_class=HTMLResponse)
async def submit_form(request: Request) -> Response:
    try:
        form = await receive(request)
    except RequestError as error:
        return _refused(request, error, {})
    try:
        _, body = await submit(request, form)
    except RequestError as error:
        return _refused(request, error, form.fields)
    finally:
        discard(form)
    return RedirectResponse(f"/plans/{body['id']}", status_code=303)


def _refused(request: Request, error: RequestError, values: Mapping[str, str]) -> HTMLResponse:
    message = f"The plan was not started: {in_form_words(str(error), web=True)}"
    page = _index(_store(request), {k: v for k, v in values.items() if k != MODEL_FIELD}, message)
    return HTMLResponse(page, status_code=error.status)


# ---- one plan ------------------------------------------------------------------------------


def _progress(job: Job) -> str:
    """Status and time; while it runs (or where it stopped, when it failed) the stage, what
    it does and the solver's figures."""
    rows = [("status", f'<span class="{_e(job.status)}">{_e(job.status)}</span>')]
    elapsed = job.elapsed()
    if elapsed is not None:
        rows.append(("elapsed", f"{elapsed:.1f} s"))
    if job.progress is not None and job.status != "done":
        progress = Progress.from_json(job.progress)
        if progress.stage:
            rows.append(("stage", _e(progress.stage)))
        if progress.detail:
            rows.append(("doing" if job.status == "running" else "last step", _e(progress.detail)))
        if figures := progress.figures():
            rows.append(("solver", _e(figures)))
    return "<dl>" + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows) + "</dl>"


def _outcome(plan: PlanDocument) -> str:
    """A done plan in short: its strategy in words, its step time and its memory per device
    against the budget, in the units a reader reads (the plan document's own figures)."""
    rows = []
    cost, cluster = plan.cost, plan.cluster
    if cost is not None:
        overlapped = "" if cost.scheduled_s is None else ", overlapped: the critical path"
        rows.append(("step time", f"{format_seconds(cost.step_time_s)} (compute "
                     f"{format_seconds(cost.compute_time_s)} + communication "
                     f"{format_seconds(cost.comm_time_s)}{overlapped}, "
                     f"{format_bytes(cost.comm_bytes_per_device)} sent per device)"))  # fmt: skip
        peak = f"{format_bytes(cost.memory_bytes_per_device)} per device"
        if cluster is not None and cluster.memory_bytes:
            share = cost.memory_bytes_per_device / cluster.memory_bytes
            peak += f" of {format_bytes(cluster.memory_bytes)} budget ({share:.1%})"
        if cost.memory_by_kind:
            kinds = cost.memory_by_kind.items()
            peak += ": " + ", ".join(
                f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in kinds if v
            )
        rows.append(("peak memory", peak))
    if cluster is not None:
        rows.append(("priced on", f"{cluster.device}, mesh {cluster.mesh}"))
    story = f'<p id="story">{_e(plan.story)}</p>' if plan.story else ""
    figures = "".join(f"<dt>{k}</dt><dd>{_e(v)}</dd>" for k, v in rows)
    return f'<section id="plan"><h2>Strategy</h2>{story}<dl>{figures}</dl></section>'


def _recipes(plan: PlanDocument) -> str:
    """The standard recipes priced beside a done plan, and how the plan differs from the
    best of them (the plan document's `recipes`); nothing for a plan without the block."""
    block = plan.recipes
    if block is None:
        return ""
    head = "".join(f"<th>{_e(h)}</th>" for h in RECIPE_HEADER)
    rows = "".join(
        "<tr>" + "".join(f"<td>{_e(cell)}</td>" for cell in row) + "</tr>"
        for row in recipe_cells(block)
    )
    return (
        f'<section id="recipes"><h2>Beside the standard recipes</h2>'
        f'<p id="difference">{_e(block.difference)}</p><table><tr>{head}</tr>{rows}</table>'
        "</section>"
    )


# Replaces the plan's section with the page's own, fetched again, until the job ends; then
# the page is loaded once more, with its links or its error.
_POLL = """<script>
const poll = async () => {
  const note = document.getElementById("note");
  try {
    const page = await fetch(location.href, {cache: "no-store"});
    const html = new DOMParser().parseFromString(await page.text(), "text/html");
    const job = html.getElementById("job");
    if (!job || !job.dataset.running) { location.reload(); return; }
    document.getElementById("job").replaceWith(job);
    note.textContent = "";
  } catch (error) {
    note.textContent = "The server cannot be reached (" + error.message + "); trying again.";
  }
  setTimeout(poll, POLL_MS);
};
setTimeout(poll, POLL_MS);
</script>""".replace("POLL_MS", str(POLL_MS))


@router.get("/plans/{job_id}", response_class=HTMLResponse)
def plan_page(request: Request, job_id: str) -> Response:
    job = _store(request).get(job_id)
    if job is not None and job.options.get("kind") == "sweep":
        return RedirectResponse(f"/sweeps/{job_id}", status_code=303)
    if job is None:
        body = f'<h1>No plan {_e(job_id)}</h1><p><a href="/">All plans</a></p>'
        return HTMLResponse(_page("autoshard: no such plan", body), status_code=404)
    running = job.status in ("queued", "running")
    said = in_form_words(job.error or "", web=True)  # the library's flags, as the form's fields
    error = f'<p class="error" id="error">{_e(said)}</p>' if said else ""
    links = f"<p>{_links(job)}</p>" if job.status == "done" else ""
    if job.status == "done" and job.plan is not None:
        links += _outcome(job.plan) + _recipes(job.plan)
    attribute = ' data-running="1"' if running else ""
    body = (
        f'<p><a href="/">autoshard</a></p><h1>Plan <code>{job.id}</code></h1>'
        f"<p>{_e(job.model_name)}: {_e(_setup(job))}, submitted {_e(_when(job.created))}</p>"
        f'<section id="job"{attribute}>{_progress(job)}{error}{links}</section>'
        '<p class="hint" id="note"></p>'
    )
    refresh = f'<noscript><meta http-equiv="refresh" content="{POLL_MS // 1000}"></noscript>'
    return HTMLResponse(_page(f"autoshard plan {job.id}", body + (_POLL if running else ""),
                              refresh if running else ""))  # fmt: skip
