"""Sweeps as a job kind of the service, on SQLite and on PostgreSQL: a sweep submitted over
HTTP runs on a worker, its progress says the points done, and its table and page of fronts are
what `autoshard sweep` writes for the same grid."""

from __future__ import annotations

import json
import time

from autoshard.cli.main import main

from .conftest import MODELS, Server

MLP = MODELS / "mlp.onnx"
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


def httpx_post_sweep(server: Server, fields: dict[str, str] = FIELDS):  # type: ignore[no-untyped-def]
    import httpx

    return httpx.post(f"{server.url}/v1/sweeps", files={"model": ("mlp.onnx", MLP.read_bytes())},
                      data=fields, timeout=60)  # fmt: skip
