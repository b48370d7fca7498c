"""POST /v1/plans, polling, the plan, its SPMD program and report, identical-request reuse, a
burst of concurrent submissions, and every kind of bad input, over real HTTP."""

from __future__ import annotations

import html
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from autoshard.cli.main import main
from autoshard.mlir import parse_module
from service.options import in_form_words
from service.sweeps import FIELDS as SWEEP_FIELDS

from .conftest import MODELS, UPLOAD_LIMIT, Server

MLP = MODELS / "mlp.onnx"
# 100 KB per device: replicated weights (DP) do not fit, so the plan splits the first Gemm's
# weight rows over mesh axis 1 and the second's over both axes, and all-gathers the hidden
# activation over axis 1 before the second Gemm (since the H100 preset prices its L2 and
# access patterns, measured: the batch split over axis 0 before, 1.2 ns dearer now).
FIELDS = {"mesh": "2x2", "dims": '{"batch": 8}', "memory": "100KB"}
CLI_FLAGS = ["--mesh", "2x2", "--dim", "batch=8", "--memory", "100KB"]


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def untimed(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan without its wall-clock figures (`timing`), which differ run to run."""
    return {k: v for k, v in plan.items() if k != "timing"}


@pytest.fixture(scope="module")
def done(server: Server) -> dict[str, Any]:
    response = server.submit(MLP, FIELDS)
    assert response.status_code == 202, response.text
    body = response.json()
    assert body == {"id": body["id"], "status": "queued"}
    return server.wait(body["id"])


def test_plan_is_what_autoshard_plan_json_prints(
    done: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert done["status"] == "done" and done["error"] is None
    # Where it last was: the partition, after the plan; its time is the job's.
    progress = done["progress"]
    assert (progress["stage"], progress["detail"]) == ("partition", "4 devices")
    assert progress["objective"] is None and progress["elapsed_s"] > 0
    code, out, _ = cli(["plan", str(MLP), *CLI_FLAGS, "--json"], capsys)
    assert code == 0
    assert untimed(done["plan"]) == untimed(json.loads(out))
    collectives = [
        (c["kind"], c["mesh_axes"], c["bytes_per_device"]) for c in done["plan"]["collectives"]
    ]
    assert collectives == [("all_gather", [1], 4096)]


def test_plan_json_is_what_autoshard_plan_o_writes(
    server: Server, done: dict[str, Any], tmp_path, capsys
) -> None:
    written = tmp_path / "plan.json"
    assert cli(["plan", str(MLP), *CLI_FLAGS, "-o", str(written)], capsys)[0] == 0
    response = server.get(f"/v1/plans/{done['id']}/plan.json")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.text.endswith("}\n") and "\n  " in response.text  # indented, as -o writes
    assert json.loads(response.text) == done["plan"]
    assert untimed(json.loads(response.text)) == untimed(json.loads(written.read_text()))


def test_spmd_program(server: Server, done: dict[str, Any]) -> None:
    response = server.get(f"/v1/plans/{done['id']}/spmd.mlir")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert "mesh.mesh @mesh0(shape = 2x2)" in text
    # Per-device types: x [8, 64] whole, the first weight's rows 2 ways, the second's 4 ways.
    assert (
        "func.func @main_graph(%arg0: tensor<8x64xf32>, %arg1: tensor<128x64xf32>, "
        "%arg2: tensor<128xf32>, %arg3: tensor<16x256xf32>, %arg4: tensor<16xf32>) "
        "-> tensor<8x16xf32> {"
    ) in text
    gathers = [line.strip() for line in text.splitlines() if "mesh.all_gather" in line]
    assert gathers == [
        "%3 = mesh.all_gather %_1_Relu_output_0 on @mesh0 mesh_axes = [1] gather_axis = 1 : "
        "tensor<8x128xf32> -> tensor<8x256xf32>"
    ]
    module = parse_module(text)
    assert str(module.to_program().mesh) == "2x2"


def test_report(server: Server, done: dict[str, Any]) -> None:
    response = server.get(f"/v1/plans/{done['id']}/report.md")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/markdown")
    lines = response.text.splitlines()
    assert lines[0] == "# Plan: mlp.onnx batch=8 on mesh 2x2"
    assert "| memory | 62.56 KiB of 97.66 KiB (64.1%) |" in lines
    assert "## Collectives (1)" in lines
    for name, op in done["plan"]["ops"].items():
        assert f"| `{name}` | {op['type']} | `{op['sharding_option']}` |" in lines


def test_exports(server: Server, done: dict[str, Any], tmp_path, capsys) -> None:
    import onnx

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(done["plan"]))
    for target in ("dtensor", "jax", "onnx"):
        response = server.get(f"/v1/plans/{done['id']}/export/{target}")
        assert response.status_code == 200, response.text
        out = tmp_path / f"export.{target}"
        assert cli(["export", str(plan), "--to", target, "--model", str(MLP), "-o", str(out)],
                   capsys)[0] == 0  # fmt: skip
        if target == "onnx":
            onnx.checker.check_model(onnx.load_from_string(response.content))
        else:  # the module names the plan it came from: the job's id here
            expected = out.read_text().replace("plan.json", f"{done['id']}.json")
            assert response.text == expected
    assert "0.weight" in json.loads(out.with_suffix(".jax").read_text())["parameters"]
    assert server.get(f"/v1/plans/{done['id']}/export/tf").status_code == 422


def kept_reports(server: Server, job_id: str) -> dict[str, str]:
    """The HTML reports the store keeps for a job, by the tensors they draw."""
    return dict(server.sql("SELECT tensors, html FROM reports WHERE job_id = :id", id=job_id))


def test_html_report_is_what_autoshard_html_writes(
    server: Server, done: dict[str, Any], tmp_path, capsys
) -> None:
    job_id = done["id"]
    # The job built its report with the plan, before anyone asked for it.
    assert list(kept_reports(server, job_id)) == ["[]"]
    response = server.get(f"/v1/plans/{job_id}/report.html")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    plan, out = tmp_path / "plan.json", tmp_path / "report.html"
    plan.write_text(json.dumps(done["plan"]))
    assert cli(["html", str(plan), "--model", str(MLP), "-o", str(out)], capsys)[0] == 0
    assert response.content == out.read_bytes() == kept_reports(server, job_id)["[]"].encode()
    # A report drawing a tensor: built on its first request, the CLI's bytes, and kept.
    tensor = "/1/Relu_output_0"
    first = server.get(f"/v1/plans/{job_id}/report.html?tensor={tensor}")
    assert first.status_code == 200, first.text
    drawn = tmp_path / "drawn.html"
    flags = ["html", str(plan), "--model", str(MLP), "--tensor", tensor, "-o", str(drawn)]
    assert cli(flags, capsys)[0] == 0
    assert first.content == drawn.read_bytes() != out.read_bytes()
    assert kept_reports(server, job_id) == {"[]": out.read_text(), f'["{tensor}"]': first.text}
    # The second request is served from the store, not built again: what the store holds.
    kept = kept_reports(server, job_id)
    server.sql("UPDATE reports SET html = 'kept ' || tensors WHERE job_id = :id", id=job_id)
    for path, key in (("report.html", "[]"), (f"report.html?tensor={tensor}", f'["{tensor}"]')):
        assert server.get(f"/v1/plans/{job_id}/{path}").text == f"kept {key}"
    rows = [{"html": html, "id": job_id, "key": key} for key, html in kept.items()]
    server.sql("UPDATE reports SET html = :html WHERE job_id = :id AND tensors = :key", rows)
    asked = server.get(f"/v1/plans/{job_id}/report.html?tensor=nope")
    assert asked.status_code == 422 and asked.json()["detail"].startswith("no tensor 'nope'")
    assert set(kept_reports(server, job_id)) == {"[]", f'["{tensor}"]'}


def test_identical_request_reuses_the_job(server: Server, done: dict[str, Any]) -> None:
    before = server.get("/healthz").json()["jobs"]
    # The same options spelled differently are the same request.
    again = server.submit(MLP, {**FIELDS, "dims": '{ "batch":8 }', "time_limit": "60"})
    assert again.status_code == 200
    assert again.json() == done  # the stored plan, its solver time included: no second solve
    assert server.get("/healthz").json()["jobs"] == before
    other = server.submit(MLP, {**FIELDS, "objective": "bytes"})
    assert other.status_code == 202 and other.json()["id"] != done["id"]
    assert server.wait(other.json()["id"])["status"] == "done"


def test_twenty_concurrent_submissions_all_complete(server: Server) -> None:
    requests = [
        {"mesh": mesh, "dims": json.dumps({"batch": batch})}
        for mesh in ("2x2", "4", "2x4", "8")
        for batch in (3, 5, 8, 16, 24)
    ]
    with ThreadPoolExecutor(20) as threads:
        responses = list(threads.map(lambda f: server.submit(MLP, f), requests))
    assert [r.status_code for r in responses] == [202] * 20
    ids = [r.json()["id"] for r in responses]
    assert len(set(ids)) == 20
    jobs = [server.wait(i) for i in ids]
    for fields, job in zip(requests, jobs, strict=True):
        assert job["status"] == "done", job["error"]
        assert job["plan"]["mesh"] == fields["mesh"]
        assert job["plan"]["model"]["dims"] == json.loads(fields["dims"])
    # The pool ran at most `workers` solves at once; the rest queued.
    rows = server.sql("SELECT id, started, finished FROM jobs")
    spans = [(started, finished) for id_, started, finished in rows if id_ in ids]
    most = max(sum(s <= t < f for s, f in spans) for t, _ in spans)
    assert 1 <= most <= server.workers


RANDOM = bytes(range(256)) * 40
TRUNCATED = MLP.read_bytes()[:60000]


def _annotation(value: str, sharding: str) -> dict[str, str]:
    return {"annotations": json.dumps({"annotations": [{"value": value, "sharding": sharding}]})}


BATCH8 = ["--dim", "batch=8"]


@pytest.mark.parametrize(
    ("filename", "content", "fields", "flags"),
    [
        pytest.param("random.onnx", RANDOM, {"mesh": "2x2"}, ["--mesh", "2x2"], id="random-bytes"),
        pytest.param("truncated.onnx", TRUNCATED, FIELDS, CLI_FLAGS, id="truncated"),
        pytest.param(
            "mlp.onnx", None, {**FIELDS, "mesh": "2xq"}, ["--mesh", "2xq", *BATCH8], id="bad-mesh"
        ),
        pytest.param("mlp.onnx", None, {"mesh": "2x2"}, ["--mesh", "2x2"], id="unbound-dim"),
        pytest.param(
            "mlp.onnx", None, {**FIELDS, "device": "abacus"}, [*CLI_FLAGS, "--device", "abacus"],
            id="bad-device",
        ),
        pytest.param(
            "mlp.onnx", None, {**FIELDS, **_annotation("nope", "[[0]]")},
            [*CLI_FLAGS, "--annotate", "nope=[[0]]"], id="annotation-of-unknown-value",
        ),
        pytest.param(
            "mlp.onnx", None, {**FIELDS, **_annotation("x", "[[5]]")},
            [*CLI_FLAGS, "--annotate", "x=[[5]]"], id="annotation-bad-axis",
        ),
    ],
)  # fmt: skip
def test_bad_input_is_422_with_the_cli_message(
    server: Server, tmp_path, capsys, filename, content, fields, flags
) -> None:
    model = tmp_path / filename
    model.write_bytes(MLP.read_bytes() if content is None else content)
    code, _, err = cli(["plan", str(model), *flags], capsys)
    assert code == 2 and err.startswith("autoshard: error: ")
    message = err.removeprefix("autoshard: error: ").strip().replace(str(model), filename)
    response = server.submit(model, fields)
    assert (response.status_code, response.json()) == (422, {"detail": message})


GPT2_FIELDS = {"dims": '{"batch": 2, "seq": 16}', "mode": "training"}
GPT2_FLAGS = ["--dim", "batch=2", "--dim", "seq=16", "--mode", "training"]


@pytest.mark.parametrize(
    ("fields", "flags"),
    [
        pytest.param({"mesh": "pp=4,dp=1"}, ["--mesh", "pp=4,dp=1"], id="more-stages-than-layers"),
        pytest.param({"mesh": "pp=2,dp=1", "schedule": "zigzag"},
                     ["--mesh", "pp=2,dp=1", "--schedule", "zigzag"], id="unknown-schedule"),
        pytest.param({"mesh": "pp=2,dp=1", "schedule": "interleaved", "micro_batches": "3"},
                     ["--mesh", "pp=2,dp=1", "--schedule", "interleaved", "--micro-batches", "3"],
                     id="micro-batches-not-divisible-by-stages"),
        pytest.param({"mesh": "2x1", "pipeline_axis": "tp"},
                     ["--mesh", "2x1", "--pipeline-axis", "tp"], id="unknown-axis-name"),
        pytest.param({"mesh": "2x1", "pipeline_axis": "5"},
                     ["--mesh", "2x1", "--pipeline-axis", "5"], id="axis-out-of-range"),
    ],
)  # fmt: skip
def test_pipeline_refusals_are_the_cli_message(server: Server, capsys, fields, flags) -> None:
    gpt2 = MODELS / "gpt2.onnx"
    code, _, err = cli(["plan", str(gpt2), *GPT2_FLAGS, *flags], capsys)
    assert code == 2 and err.startswith("autoshard: error: ") and err.count("\n") == 1
    message = in_form_words(err.removeprefix("autoshard: error: ").strip())
    response = server.submit(gpt2, {**GPT2_FIELDS, **fields})
    assert (response.status_code, response.json()) == (422, {"detail": message})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param({"dims": '{"seq": 16}', "global_batch": "batch=8", "micro_batches": "3"},
                     "micro_batches=3 does not divide the global batch batch=8 (a micro-batch "
                     "is the global batch / micro-batches); choose one of: 1, 2, 4, 8",
                     id="micro-batches-not-dividing"),
        pytest.param({"global_batch": "batch=8"},
                     "global_batch batch=8 sets dim batch: drop it from dims", id="dim-twice"),
    ],
)  # fmt: skip
def test_a_bad_global_batch_is_422(server: Server, fields, message) -> None:
    asked = {**GPT2_FIELDS, "mesh": "pp=2,dp=1", **fields}
    response = server.submit(MODELS / "gpt2.onnx", asked)
    assert (response.status_code, response.json()) == (422, {"detail": message})


def test_bad_annotation_file_is_the_cli_message(server: Server, tmp_path, capsys) -> None:
    annotations = {"annotations": [{"value": "x", "sharding": "[[0]]", "for": "everyone"}]}
    path = tmp_path / "a.json"
    path.write_text(json.dumps(annotations))
    _, _, err = cli(["plan", str(MLP), *CLI_FLAGS, "--annotations", str(path)], capsys)
    cli_message = err.removeprefix("autoshard: error: ").strip()
    response = server.submit(MLP, {**FIELDS, "annotations": json.dumps(annotations)})
    assert response.status_code == 422
    # The CLI names the file; the service's source is the form field.
    assert cli_message == response.json()["detail"].replace(
        "annotations: ", f"annotations file '{path}': ", 1
    )
    assert response.json()["detail"] == (
        "annotations: annotation 0 (x): 'for' is 'everyone'; valid: result, users"
    )


@pytest.mark.parametrize(
    ("fields", "status", "message"),
    [
        pytest.param(
            {**FIELDS, "annotations": "[1"}, 400,
            "form field 'annotations' is not JSON: Expecting ',' delimiter: line 1 column 3 "
            "(char 2)",
            id="annotations-not-json",
        ),
        pytest.param(
            {**FIELDS, "dims": '["batch"]'}, 422,
            'dims must be a JSON object of NAME: SIZE, e.g. {"batch": 8}', id="dims-not-object",
        ),
        pytest.param(
            {**FIELDS, "dims": '{"batch": 0}'}, 422,
            "dims: size of 'batch' must be an integer >= 1, not 0", id="dims-zero",
        ),
        pytest.param(
            {**FIELDS, "objective": "speed"}, 422, "objective 'speed' is not one of: time, bytes",
            id="objective",
        ),
        pytest.param(
            {**FIELDS, "time_limit": "1e9"}, 422,
            "time_limit 1e9 must be > 0 and <= 600 seconds (the server's --max-time-limit)",
            id="time-limit",
        ),
        pytest.param(
            {**FIELDS, "colour": "blue"}, 400,
            "unknown form field 'colour'; valid: model, mesh, dims, cluster, device, bandwidth, "
            "latency, memory, annotations, objective, time_limit, mode, optimizer, precision, "
            "micro_batches, recompute, attention, loss, kernels, prefetch, bucket_mb, async_tp, "
            "overlap, global_batch, pipeline_axis, pipeline, schedule",
            id="unknown-field",
        ),
        pytest.param(
            {"dims": '{"batch": 8}'}, 422,
            "form field 'mesh' is required (a device mesh, e.g. 4x8)", id="no-mesh",
        ),
        pytest.param(
            {**FIELDS, "optimizer": "sgd"}, 422,
            "form field 'optimizer' plans a training step: add mode=training",
            id="training-field-without-mode",
        ),
        pytest.param(
            {**FIELDS, "mode": "training", "precision": "fp8"}, 422,
            "unknown precision 'fp8'; choose one of: bf16-mixed, fp16-mixed, fp8-mixed, fp32",
            id="training-precision",
        ),
    ],
)  # fmt: skip
def test_bad_form_fields(server: Server, fields, status, message) -> None:
    response = server.submit(MLP, fields)
    assert (response.status_code, response.json()) == (status, {"detail": message})


def test_oversized_upload_is_413(server: Server) -> None:
    response = server.submit(b"\0" * (2 * UPLOAD_LIMIT), {"mesh": "2x2"}, "big.onnx")
    assert response.status_code == 413
    assert response.json() == {
        "detail": f"model upload is larger than the limit of {UPLOAD_LIMIT} bytes "
        "(the server's --max-upload)"
    }
    (replica,) = (server.data / "uploads").iterdir()  # the server's own uploads in flight
    assert list(replica.iterdir()) == []  # nothing left behind


def test_not_a_form(server: Server) -> None:
    no_model = httpx.post(f"{server.url}/v1/plans", files={"mesh": (None, "2x2")})
    assert (no_model.status_code, no_model.json()) == (
        400, {"detail": "the form has no 'model' file field (the ONNX model)"},
    )  # fmt: skip
    as_json = httpx.post(f"{server.url}/v1/plans", json={"mesh": "2x2"})
    assert as_json.status_code == 415


def test_infeasible_budget(server: Server, capsys) -> None:
    fields = {**FIELDS, "memory": "1KiB"}
    _, _, err = cli(["plan", str(MLP), "--mesh", "2x2", *BATCH8, "--memory", "1KiB"], capsys)
    # The last line: progress lines come first where the run passes 1 s (a loaded machine).
    message = err.strip().splitlines()[-1].removeprefix("autoshard: error: ")
    assert message.startswith(
        "infeasible budget: no plan fits 1024 bytes (1.00 KiB) per device; the lowest feasible "
        "budget is"
    )
    # The CLI names its flag; the REST API and the web page their form field.
    (lowest,) = re.findall(r"; --memory (\d+)\)", message)
    api = message.replace(f"--memory {lowest}", f"memory={lowest}")
    web = message.replace(f"--memory {lowest}", f"the memory field, {lowest}")
    assert "--" not in api and api != message and "--" not in web
    # Found only by solving: the job fails with the CLI's message in the API's words...
    response = server.submit(MLP, fields)
    assert response.status_code == 202
    job = server.wait(response.json()["id"])
    assert (job["status"], job["error"], job["plan"]) == ("failed", api, None)
    # ...its artifacts answer 422 with it, and so does the identical request.
    for path in ("spmd.mlir", "report.md", "report.html", "plan.json"):
        fetched = server.get(f"/v1/plans/{job['id']}/{path}")
        assert (fetched.status_code, fetched.json()) == (422, {"detail": api})
    again = server.submit(MLP, fields)
    assert (again.status_code, again.json()) == (422, {"detail": api})
    # The web page: the plan's page, and the form sent again (refused, shown with the form).
    shown = server.get(f"/plans/{job['id']}")
    assert error_paragraph(shown.text) == web
    files = {"model": (MLP.name, MLP.read_bytes())}
    refused = httpx.post(f"{server.url}/", files=files, data=fields, timeout=60)
    assert refused.status_code == 422
    assert error_paragraph(refused.text) == f"The plan was not started: {web}"


@pytest.mark.parametrize(
    ("message", "api", "web"),
    [
        ("budget is 37888 bytes (37.00 KiB, proven optimal; --memory 37888); the largest",
         "budget is 37888 bytes (37.00 KiB, proven optimal; memory=37888); the largest",
         "budget is 37888 bytes (37.00 KiB, proven optimal; the memory field, 37888); the largest"),
        ("no plan within --time-limit 2 s (UNKNOWN); raise --time-limit",
         "no plan within time_limit=2 s (UNKNOWN); raise time_limit",
         "no plan within the time_limit field, 2 s (UNKNOWN); raise the time_limit field"),
        ("--micro-batches 0 must be >= 1", "micro_batches=0 must be >= 1",
         "the micro_batches field, 0 must be >= 1"),
        # No field of the form: the serve flag and the CLI's own options stay as they are.
        ("--max-time-limit 600; give --dim batch=8", "--max-time-limit 600; give --dim batch=8",
         "--max-time-limit 600; give --dim batch=8"),
    ],
    ids=["memory", "time-limit", "micro-batches", "not-a-field"],
)  # fmt: skip
def test_messages_in_the_forms_words(message: str, api: str, web: str) -> None:
    """In process: the service package itself (tests/api does not shadow it)."""
    from service.options import in_form_words

    assert in_form_words(message) == api
    assert in_form_words(message, web=True) == web


def error_paragraph(page: str) -> str:
    """The text of a web page's error paragraph."""
    (found,) = re.findall(r'<p class="error" id="error"[^>]*>(.*?)</p>', page, re.S)
    return html.unescape(found)


def test_unknown_plan_and_docs(server: Server) -> None:
    assert server.get("/v1/plans/0123456789abcdef0123").status_code == 404
    assert server.get("/v1/plans/../etc").status_code == 404
    assert server.get("/docs").status_code == 200
    paths = server.get("/openapi.json").json()["paths"]
    assert sorted(paths) == [
        "/healthz", "/v1/plans", "/v1/plans/{job_id}", "/v1/plans/{job_id}/export/{target}",
        "/v1/plans/{job_id}/plan.json", "/v1/plans/{job_id}/report.html",
        "/v1/plans/{job_id}/report.md",
        "/v1/plans/{job_id}/spmd.mlir", "/v1/sweeps", "/v1/sweeps/{job_id}",
    ]  # fmt: skip
    form = paths["/v1/plans"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert form["schema"]["required"] == ["model", "mesh"]
    sweep = paths["/v1/sweeps"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert sorted(sweep["schema"]["properties"]) == sorted(["model", *SWEEP_FIELDS])


def planned_as_cli(
    server: Server, model: Any, fields: dict[str, str], flags: list[str],
    capsys: pytest.CaptureFixture[str],
) -> dict[str, Any]:  # fmt: skip
    """The plan of `fields` through the API, checked to be what `autoshard plan --json` of
    `flags` prints, timing aside, to the byte."""
    response = server.submit(model, fields)
    assert response.status_code == 202, response.text
    job = server.wait(response.json()["id"])
    assert job["status"] == "done", job["error"]
    code, out, _ = cli(["plan", str(model), *flags, "--json"], capsys)
    assert code == 0
    as_cli = json.dumps(untimed(json.loads(out)), sort_keys=True)
    assert json.dumps(untimed(job["plan"]), sort_keys=True) == as_cli
    plan: dict[str, Any] = job["plan"]
    return plan


def test_a_training_plan_is_what_autoshard_plan_mode_training_prints(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    fields = {"mesh": "2x2", "dims": '{"batch": 8}', "mode": "training", "optimizer": "sgd"}
    flags = ["--mesh", "2x2", "--dim", "batch=8", "--mode", "training", "--optimizer", "sgd"]
    plan = planned_as_cli(server, MLP, fields, flags, capsys)
    assert plan["training"]["optimizer"] == "sgd"


def test_listing_newest_first_a_page_at_a_time(new_server) -> None:
    server = new_server(workers=1)
    assert server.get("/v1/plans").json() == {"plans": [], "next": None}
    first = server.submit(MLP, {**FIELDS, "mesh": "4"}).json()["id"]
    server.wait(first)
    second = server.submit(MLP, FIELDS).json()["id"]
    server.wait(second)
    listed = server.get("/v1/plans").json()
    assert [item["id"] for item in listed["plans"]] == [second, first]
    assert listed["next"] is None
    item = listed["plans"][1]
    assert {k: v for k, v in item.items() if k not in ("created", "links")} == {
        "id": first, "status": "done", "model": "mlp.onnx", "mesh": "4",
    }  # fmt: skip
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", item["created"])
    base = f"/v1/plans/{first}"
    assert item["links"] == {
        "job": base, "page": f"/plans/{first}", "plan.json": f"{base}/plan.json",
        "report.html": f"{base}/report.html", "report.md": f"{base}/report.md",
        "spmd.mlir": f"{base}/spmd.mlir",
    }  # fmt: skip
    for link in item["links"].values():
        assert server.get(link).status_code == 200, link
    # A page at a time: each page links the next; the last links none.
    page = server.get("/v1/plans?limit=1").json()
    assert [i["id"] for i in page["plans"]] == [second]
    assert page["next"] == "/v1/plans?limit=1&offset=1"
    page = server.get(page["next"]).json()
    assert ([i["id"] for i in page["plans"]], page["next"]) == ([first], None)
    assert server.get("/v1/plans?offset=2").json() == {"plans": [], "next": None}
    assert server.get("/v1/plans?limit=0").status_code == 422
    assert server.get("/v1/plans?limit=101").status_code == 422


CALIBRATED = MODELS.parent / "bench" / "data" / "h100" / "cluster_h100.json"


@pytest.mark.parametrize(
    ("cluster", "flag"),
    [
        pytest.param("dgx-a100", "dgx-a100", id="preset"),
        pytest.param(CALIBRATED.read_text(), str(CALIBRATED), id="calibrated-file"),
        pytest.param("device: mi300x\nlatency: 2us\n", None, id="yaml-content"),
    ],
)
def test_cluster_field_is_the_cli_cluster_flag(
    server: Server, tmp_path, capsys, cluster: str, flag: str | None
) -> None:
    if flag is None:  # content the CLI reads from a file
        flag = str(tmp_path / "cluster.yaml")
        (tmp_path / "cluster.yaml").write_text(cluster)
    response = server.submit(MLP, {**FIELDS, "cluster": cluster})
    assert response.status_code == 202, response.text
    job = server.wait(response.json()["id"])
    assert job["status"] == "done", job["error"]
    code, out, _ = cli(["plan", str(MLP), *CLI_FLAGS, "--cluster", flag, "--json"], capsys)
    assert code == 0
    assert untimed(job["plan"]) == untimed(json.loads(out))
    # The same cluster written otherwise (other spaces, other key order) is the same request.
    if cluster.startswith("{"):
        respaced = json.dumps(dict(reversed(json.loads(cluster).items())))
        again = server.submit(MLP, {**FIELDS, "cluster": respaced})
        assert (again.status_code, again.json()["id"]) == (200, job["id"])


@pytest.mark.parametrize(
    ("cluster", "message"),
    [
        pytest.param(
            "dgx-h10",
            "unknown cluster preset 'dgx-h10'; presets: dgx-h100, dgx-a100, selene, "
            "grand-teton-h100, mi300x-8, tpu-v5e-256, g2-l4-8 (or give a cluster file's JSON or "
            "YAML content)",
            id="bad-preset",
        ),
        pytest.param(
            '{"device": "h100", "speed": 1}',
            "unknown key(s) ['speed'] in cluster; valid: ['bandwidth', 'calibration', "
            "'device', 'latency', 'memory', 'mesh']",
            id="unknown-key",
        ),
        pytest.param(
            '{"device": "h200"}', "unknown device 'h200'; presets: a100, h100, h100-hbm2e, l4, "
            "mi300x, tpu-v5e", id="unknown-device",
        ),
        pytest.param("[1, 2]", "cluster must hold a mapping of keys", id="not-a-mapping"),
    ],
)  # fmt: skip
def test_bad_cluster_is_422_with_the_cli_message(
    server: Server, tmp_path, capsys, cluster: str, message: str
) -> None:
    response = server.submit(MLP, {**FIELDS, "cluster": cluster})
    assert (response.status_code, response.json()) == (422, {"detail": message})
    if cluster.startswith(("{", "[")):  # a file's content: the CLI says it of the file
        path = tmp_path / "cluster.json"
        path.write_text(cluster)
        _, _, err = cli(["plan", str(MLP), *CLI_FLAGS, "--cluster", str(path)], capsys)
        said = err.removeprefix("autoshard: error: ").strip()
        assert said == message.replace("in cluster", f"in {path}").replace(
            "cluster must", f"cluster file {path} must"
        )


def test_a_global_batch_is_planned_in_the_searched_micro_batches(server: Server) -> None:
    fields = {**GPT2_FIELDS, "dims": '{"seq": 16}', "mesh": "pp=2,dp=1", "global_batch": "batch=4"}
    response = server.submit(MODELS / "gpt2.onnx", fields)
    assert response.status_code == 202, response.json()
    done = server.wait(response.json()["id"])
    assert done["status"] == "done", done
    plan = server.get(f"/v1/plans/{done['id']}/plan.json").json()
    assert plan["story"].startswith("micro-batches: ")
    assert [c["micro_batches"] for c in plan["pipeline"]["micro_batches_considered"]] == [1, 2, 4]


def test_a_pipelined_plan_is_what_autoshard_plan_prints(server: Server, capsys) -> None:
    """The pipeline fields (`pipeline_axis`, `schedule`, `micro_batches`) plan what the
    flags do: the same document, timing aside, to the byte."""
    gpt2 = MODELS / "gpt2.onnx"
    fields = {**GPT2_FIELDS, "mesh": "2x1", "pipeline_axis": "0", "schedule": "gpipe",
              "micro_batches": "2"}  # fmt: skip
    flags = [*GPT2_FLAGS, "--mesh", "2x1", "--pipeline-axis", "0", "--schedule", "gpipe",
             "--micro-batches", "2"]  # fmt: skip
    block = planned_as_cli(server, gpt2, fields, flags, capsys)["pipeline"]
    assert (block["schedule"], len(block["stages"]), block["micro_batches"]) == ("gpipe", 2, 2)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param({"mesh": "2x1", "pipeline": "sometimes"},
                     "pipeline 'sometimes' is not one of: auto, none", id="unknown-pipeline"),
        pytest.param({"mesh": "2x1", "pipeline_axis": "0", "mode": "inference"},
                     "a pipeline plans a training step: add mode=training", id="inference"),
    ],
)  # fmt: skip
def test_bad_pipeline_fields_are_one_422_line(server: Server, fields, message) -> None:
    response = server.submit(MODELS / "gpt2.onnx", {**GPT2_FIELDS, **fields})
    assert (response.status_code, response.json()) == (422, {"detail": message})


def test_every_training_option_of_the_cli_is_a_form_field(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    fields = {"mesh": "2x2", "dims": '{"batch": 8}', "mode": "training",
              "loss": "cross-entropy", "kernels": "compiled", "prefetch": "0", "bucket_mb": "0",
              "async_tp": "true", "overlap": "false"}  # fmt: skip
    flags = ["--mesh", "2x2", "--dim", "batch=8", "--mode", "training",
             "--loss", "cross-entropy", "--kernels", "compiled", "--prefetch", "0",
             "--bucket-mb", "0", "--async-tp", "--no-overlap"]  # fmt: skip
    plan = planned_as_cli(server, MLP, fields, flags, capsys)
    assert plan["training"]["loss"] == "cross-entropy"
    assert plan["training"]["kernels"] == "compiled"
