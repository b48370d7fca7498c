"""The store outlives the server: a restart keeps every plan, a job running at a crash is
failed with the reason (and runs again when asked again), a queued one is queued again."""

from __future__ import annotations

import json
import time

from .conftest import MODELS, alive

MLP = MODELS / "mlp.onnx"
DECODER = MODELS / "decoder_32l_shape_only.onnx"  # ~7 s on 2x4x8: time to crash it
MLP_FIELDS = {"mesh": "2x2", "dims": '{"batch": 8}'}
# One link speed on every axis: the default network on axes 0 and 1 doubles the solve (~15 s).
DECODER_FIELDS = {
    "mesh": "2x4x8", "dims": json.dumps({"batch": 8, "seq": 2048}), "bandwidth": "450GB/s",
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
    crashed = second.get(f"/v1/plans/{running}").json()
    assert crashed == {
        "id": running,
        "status": "failed",
        "progress": crashed["progress"],
        "error": "the server stopped while this job was running (crash or restart); submit "
        "the same request again to retry",
        "plan": None,
    }
    assert second.wait(queued)["status"] == "done"  # queued again at startup
    # Asked again, the crashed job runs again under the same id.
    again = second.submit(DECODER, DECODER_FIELDS)
    assert (again.status_code, again.json()) == (202, {"id": running, "status": "queued"})
    finished = second.wait(running, timeout=60)
    assert finished["status"] == "done", finished["error"]
    assert finished["plan"]["model"]["dims"] == {"batch": 8, "seq": 2048}
