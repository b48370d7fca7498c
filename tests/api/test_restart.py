"""The store outlives the server: a restart keeps every plan, a job running at a crash runs
again (its lost run counted), a queued one is queued again."""

from __future__ import annotations

import json
import re
import time
from itertools import groupby

from autoshard.pipeline import PipelineStage

from .conftest import MODELS, alive

MLP = MODELS / "mlp.onnx"
DECODER = MODELS / "decoder_32l_shape_only.onnx"  # slow enough on 2x4x8 to crash it midway
MLP_FIELDS = {"mesh": "2x2", "dims": '{"batch": 8}'}
# One link speed on every axis: the default network on axes 0 and 1 doubles the solve. A
# budget that binds (about 60 % of the plan's peak without one): CP-SAT's figures change for
# seconds while the search runs, time for the test to see them on the page (where memory is
# no object, one solve tells them once, a moment before the search ends).
DECODER_FIELDS = {
    "mesh": "2x4x8", "dims": json.dumps({"batch": 8, "seq": 2048}), "bandwidth": "450GB/s",
    "memory": "8GB",
}  # fmt: skip


def test_crash_and_restart(new_server, tmp_path) -> None:
    data = tmp_path / "data"
    first = new_server(data, workers=1)
    done = first.wait(first.submit(MLP, MLP_FIELDS).json()["id"])
    assert done["status"] == "done"
    spmd = first.get(f"/v1/plans/{done['id']}/spmd.mlir").text

    # One worker: the decoder runs, a second model waits in the queue; then the server dies.
    running = first.submit(DECODER, DECODER_FIELDS).json()["id"]
    first.wait(running, until=("running",))
    queued = first.submit(MLP, {**MLP_FIELDS, "mesh": "4"}).json()["id"]
    assert first.get(f"/v1/plans/{queued}").json()["status"] == "queued"
    workers = first.children()
    first.kill()
    deadline = time.monotonic() + 10
    while any(map(alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(alive, workers)), "a worker outlived its server"

    second = new_server(data, workers=1)
    assert second.get(f"/v1/plans/{done['id']}").json() == done  # the plan, byte for byte
    assert second.get(f"/v1/plans/{done['id']}/spmd.mlir").text == spmd
    # The crashed job is queued again at startup and runs again (first: it is the older).
    assert second.get(f"/v1/plans/{running}").json()["status"] in ("queued", "running")
    assert second.sql("SELECT attempt, lost FROM jobs WHERE id = :id", id=running) == [(2, 1)]
    # Asked again meanwhile, the same job answers: it runs once more, not twice.
    again = second.submit(DECODER, DECODER_FIELDS)
    assert again.status_code == 200 and again.json()["id"] == running
    pages: list[str] = []  # its web page once the solver's figures are on it

    def look(progress: dict) -> None:
        if progress["objective"] is not None and not pages:
            page = second.get(f"/plans/{running}").text
            if "<dt>solver</dt>" in page:
                pages.append(page)

    finished, seen = second.watch(running, 180, look)  # a generous limit: CI may be loaded
    assert finished["status"] == "done", finished["error"]
    # Its progress while it ran: the pipeline's stages in order, the solver's figures.
    stages = [stage for stage, _ in groupby(p["stage"] for p in seen)]
    order = list(PipelineStage)
    assert "search" in stages and stages[-1] == "partition"
    assert [order.index(s) for s in stages] == sorted(order.index(s) for s in stages)
    assert [p["elapsed_s"] for p in seen] == sorted(p["elapsed_s"] for p in seen)
    solving = [p for p in seen if p["objective"] is not None]
    assert solving and all(p["bound"] <= p["objective"] and p["unit"] == "s" for p in solving)
    (page,) = pages  # polling itself while it runs, with the stage and the solver's figures
    assert '<section id="job" data-running="1">' in page and "setTimeout(poll" in page
    assert "<dt>stage</dt><dd>search</dd>" in page
    assert re.search(r"<dt>solver</dt><dd>objective [\d.]+ ms, bound [\d.]+ ms \(gap", page)
    assert finished["plan"]["model"]["dims"] == {"batch": 8, "seq": 2048}
    assert second.wait(queued)["status"] == "done"  # queued again at startup


def test_a_stopped_server_requeues_its_running_job_without_counting_it_lost(
    new_server, tmp_path
) -> None:
    # A graceful stop (SIGTERM) kills the running job's worker: the job is queued again at
    # once, and the kill is the server's doing, not a lost run (three of those fail a job).
    server = new_server(tmp_path / "data", workers=1)
    running = server.submit(DECODER, DECODER_FIELDS).json()["id"]
    server.wait(running, until=("running",))
    server.stop()
    assert server.process is not None and server.process.returncode is not None
    status = "SELECT status, attempt, lost, owner FROM jobs WHERE id = :id"
    assert server.sql(status, id=running) == [("queued", 2, 0, None)]
