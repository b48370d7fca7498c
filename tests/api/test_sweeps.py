"""Sweeps as a job kind of the service, on SQLite and on PostgreSQL: a sweep submitted over
HTTP runs on a worker, its progress says the points done, and its table and page of fronts are
what `autoshard sweep` writes for the same grid."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from autoshard.cli.main import main

from .conftest import MODELS, Server

MLP = MODELS / "mlp.onnx"
GPT2 = MODELS / "gpt2.onnx"
FIELDS = {"mesh": "2x2,4", "memory": "100KB,1MB", "dims": '{"batch": 8}', "price": "2.5"}
FLAGS = ["--mesh", "2x2,4", "--memory", "100KB,1MB", "--dim", "batch=8", "--executor", "local",
         "--price-per-device-hour", "2.5", "--workers", "1", "-q"]  # fmt: skip


def test_a_sweep_job_is_what_autoshard_sweep_writes(server: Server, tmp_path, capsys) -> None:
    response = httpx_post_sweep(server)
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    seen: list[str] = []
    pages = 0  # progress pages seen while it ran
    deadline = time.monotonic() + 120
    while (job := server.get(f"/v1/sweeps/{job_id}").json())["status"] not in ("done", "failed"):
        assert time.monotonic() < deadline, job
        if job["progress"] and job["progress"]["detail"] not in seen:
            seen.append(job["progress"]["detail"])
        page = server.get(f"/sweeps/{job_id}").text
        if "<h1>Sweep" in page:  # not done yet (it may end between the two requests)
            assert 'http-equiv="refresh"' in page and "</p>" in page
            pages += 1
        time.sleep(0.1)
    assert job["status"] == "done", job["error"]
    assert seen and pages and all(line.startswith("sweep: ") for line in seen)
    out = tmp_path / "sweep"
    assert main(["sweep", str(MLP), *FLAGS, "-o", str(out)]) == 0
    capsys.readouterr()
    assert job["points"] == json.loads((out / "points.json").read_text())["points"]
    assert len(job["points"]) == 4
    assert server.get(f"/sweeps/{job_id}").text == (out / "front.html").read_text()
    # The same request again finds the sweep; the plan routes do not take it.
    again = httpx_post_sweep(server)
    assert again.status_code == 200 and again.json() == job
    assert server.get(f"/v1/plans/{job_id}").status_code == 404


def test_a_bad_sweep_field_is_422(server: Server) -> None:
    response = httpx_post_sweep(server, {"mesh": "2x2", "devices": "4"})
    assert response.status_code == 422
    assert response.json() == {
        "detail": "give the mesh field (e.g. 2x2,4) or devices (e.g. 4,8), not both"
    }
    response = httpx_post_sweep(server, {"mesh": "2x2", "pipeline": "always"})
    assert response.status_code == 422
    assert response.json() == {"detail": "--pipeline 'always': choose auto or none"}


def test_a_pipelined_sweep_job_is_what_autoshard_sweep_writes(
    server: Server, tmp_path, capsys
) -> None:
    """The training and pipeline fields reach the sweep: `pipeline=auto` adds the mesh
    pipelined over its first axis, each row as `autoshard sweep --pipeline auto` writes it."""
    fields = {"mesh": "2x2", "dims": '{"batch": 2, "seq": 16}', "mode": "training",
              "pipeline": "auto", "schedule": "gpipe", "micro_batches": "2"}  # fmt: skip
    response = httpx_post_sweep(server, fields, GPT2)
    assert response.status_code == 202, response.text
    job = _finished(server, response.json()["id"])
    out = tmp_path / "sweep"
    flags = ["--mesh", "2x2", "--dim", "batch=2", "--dim", "seq=16", "--mode", "training",
             "--pipeline", "auto", "--schedule", "gpipe", "--micro-batches", "2",
             "--executor", "local", "--workers", "1", "-q"]  # fmt: skip
    assert main(["sweep", str(GPT2), *flags, "-o", str(out)]) == 0
    capsys.readouterr()
    assert [p["mesh"] for p in job["points"]] == ["2x2", "pp=2,x1=2"]
    assert job["points"] == json.loads((out / "points.json").read_text())["points"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"pipeline": "auto"}, "--pipeline auto pipelines a training step: add --mode training"),
        ({"schedule": "gpipe"}, "--schedule gpipe orders a pipeline: give --pipeline-axis or "
                                "--pipeline auto"),
        ({"mode": "training", "optimizer": "adagrad"}, None),
    ],
)  # fmt: skip
def test_a_sweep_asking_what_autoshard_sweep_refuses_is_422_in_its_words(
    server: Server, tmp_path, capsys, fields: dict[str, str], message: str | None
) -> None:
    response = httpx_post_sweep(server, {"mesh": "2x2", "dims": '{"batch": 8}', **fields})
    assert response.status_code == 422
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in fields.items()]
    assert main(["sweep", str(MLP), "--mesh", "2x2", "--dim", "batch=8", *flags,
                 "-o", str(tmp_path / "s")]) == 2  # fmt: skip
    said = capsys.readouterr().err.removeprefix("autoshard: error: ").strip()
    assert response.json() == {"detail": message or said} and said == (message or said)


def _finished(server: Server, job_id: str) -> dict:
    deadline = time.monotonic() + 300
    while (job := server.get(f"/v1/sweeps/{job_id}").json())["status"] not in ("done", "failed"):
        assert time.monotonic() < deadline, job
        time.sleep(0.2)
    assert job["status"] == "done", job["error"]
    return job


def httpx_post_sweep(server: Server, fields: dict[str, str] = FIELDS, model: Path = MLP):  # type: ignore[no-untyped-def]
    import httpx

    return httpx.post(f"{server.url}/v1/sweeps", files={"model": (model.name, model.read_bytes())},
                      data=fields, timeout=60)  # fmt: skip
