"""Faults under load, with real processes: two API replicas (uvicorn) on one real PostgreSQL
take a stream of submissions; one replica is killed (SIGKILL) and PostgreSQL is restarted
while they come in. No accepted job is lost, every request ends accepted (a client retries a
refused connection or a 5xx on the other replica, as a load balancer would), no job runs twice
but the one its dead replica was solving, and every plan is what `autoshard plan` prints."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from autoshard.cli.main import main

from .conftest import MODELS, Server
from .postgres import Postgres, binaries

MLP = MODELS / "mlp.onnx"
REQUESTS = [
    {"mesh": mesh, "dims": json.dumps({"batch": batch})}
    for mesh in ("2x2", "4")
    for batch in (2, 4, 6, 8, 10, 12, 14, 16)
]
LEASE_S = 3  # a dead replica's job is queued again this long after its last heartbeat


def submit(replicas: list[Server], first: int, fields: dict[str, str], log: list) -> str:
    """Submit until a replica accepts (202) or finds (200) the job; its id. Refused
    connections and 5xx answers are retried on the next replica and noted in `log`."""
    deadline = time.monotonic() + 90
    turn = first
    while time.monotonic() < deadline:
        replica = replicas[turn % len(replicas)]
        turn += 1
        try:
            response = replica.submit(MLP, fields)
        except httpx.TransportError as error:
            log.append(type(error).__name__)
            time.sleep(0.2)
            continue
        if response.status_code >= 500:
            log.append(response.status_code)
            time.sleep(0.2)
            continue
        assert response.status_code in (200, 202), response.text
        return str(response.json()["id"])
    raise AssertionError(f"no replica accepted {fields}: {log}")


@pytest.fixture
def postgres_server() -> Any:
    found = binaries()
    if found is None:
        pytest.skip("no PostgreSQL server (initdb): apt-get install postgresql")
    server = Postgres(found)
    server.start()
    yield server
    server.remove()


def test_killed_replica_and_restarted_postgres_lose_no_job(
    postgres_server: Postgres, new_server, tmp_path, capsys
) -> None:  # PostgreSQL first: it must outlive the servers, which release their jobs at exit
    url = postgres_server.url()
    flags = ("--lease", str(LEASE_S))
    doomed, survivor = (new_server(tmp_path / "data", 1, database=url, flags=flags)
                        for _ in range(2))  # fmt: skip
    replicas = [doomed, survivor]
    retried: list[Any] = []
    accepted: list[str] = []
    lock = threading.Lock()

    def one(index: int) -> str:
        job_id = submit(replicas, index, REQUESTS[index], retried)
        with lock:
            accepted.append(job_id)
        return job_id

    with ThreadPoolExecutor(4) as threads:
        futures = [threads.submit(one, i) for i in range(len(REQUESTS))]
        deadline = time.monotonic() + 120
        while len(accepted) < len(REQUESTS) // 3:
            assert time.monotonic() < deadline, f"too few accepted: {retried}"
            time.sleep(0.05)
        doomed.kill()  # mid-load: whatever it was solving or answering dies with it
        postgres_server.stop()
        time.sleep(2)  # PostgreSQL down for seconds while submissions go on
        postgres_server.start()
        ids = [future.result() for future in futures]

    jobs = [survivor.wait(job_id, timeout=120) for job_id in ids]
    assert len(set(ids)) == len(REQUESTS)  # each request one job, none lost
    for fields, job in zip(REQUESTS, jobs, strict=True):
        assert job["status"] == "done", job["error"]
        code = main(["plan", str(MLP), "--mesh", fields["mesh"], "--dim",
                     f"batch={json.loads(fields['dims'])['batch']}", "--json"])  # fmt: skip
        assert code == 0
        assert untimed(job["plan"]) == untimed(json.loads(capsys.readouterr().out))
    # Claimed once each: a job ran again only when it lost its run to the killed replica.
    runs = survivor.sql("SELECT attempt, lost FROM jobs")
    assert all(attempt == 1 + lost for attempt, lost in runs)
    assert sum(lost for _, lost in runs) <= doomed.workers
    print(f"retried on the other replica: {retried}")


def untimed(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan without its wall-clock figures (`timing`), which differ run to run."""
    return {k: v for k, v in plan.items() if k != "timing"}
