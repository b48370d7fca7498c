"""Plan jobs on Ray (`autoshard serve --executor ray`: a local Ray the server starts), its
store on a real PostgreSQL: the plans are what `autoshard plan` prints; a Ray worker killed
while it solves is replaced and the job still ends done, once."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from autoshard.cli.main import main

from .test_faults import MLP, untimed

pytest.importorskip("ray", reason="Ray is the sweep extra (in dev): pip install 'autoshard[sweep]'")

DECODER = Path(MLP).parent / "decoder_32l_shape_only.onnx"
DECODER_FIELDS = {"mesh": "2x4", "dims": json.dumps({"batch": 8, "seq": 2048})}


def solving_workers() -> list[int]:
    """The Ray worker processes running a plan job now (Ray names them by their task)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            task = (proc / "cmdline").read_bytes() if proc.name.isdigit() else b""
            if task.startswith(b"ray::ray_solve"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def test_jobs_run_as_ray_tasks(postgres, new_server, tmp_path, capsys) -> None:
    server = new_server(tmp_path / "data", 2, database=postgres.url(), flags=("--executor", "ray"),
                        start_s=180)  # fmt: skip
    requests = [{"mesh": mesh, "dims": json.dumps({"batch": 8})} for mesh in ("2x2", "4")]
    ids = [server.submit(MLP, fields).json()["id"] for fields in requests]
    # A worker killed mid-solve (the decoder's, or an MLP's still running): Ray runs its task
    # again on a new worker.
    slow = server.submit(DECODER, DECODER_FIELDS).json()["id"]
    server.wait(slow, until=("running",))
    deadline = time.monotonic() + 30
    while not (workers := solving_workers()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert workers, "no Ray worker is running a plan job"
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    for fields, job_id in zip(requests, ids, strict=True):
        job = server.wait(job_id, timeout=120)
        assert job["status"] == "done", job["error"]
        code = main(["plan", str(MLP), "--mesh", fields["mesh"], "--dim", "batch=8", "--json"])
        assert code == 0
        assert untimed(job["plan"]) == untimed(json.loads(capsys.readouterr().out))
    assert server.wait(slow, timeout=240)["status"] == "done"
    # Ray ran the killed worker's task again: no job lost a run, none was queued twice.
    assert server.sql("SELECT attempt, lost FROM jobs") == [(1, 0)] * 3
