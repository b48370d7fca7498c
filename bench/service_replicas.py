"""The service scaled out: concurrent submissions across two API replicas (real uvicorn
processes) on one real PostgreSQL (a throwaway cluster, as the tests start one), each replica
solving on its own process pool; optionally a replica killed and PostgreSQL restarted mid-load.

    python bench/service_replicas.py [--submissions 200] [--workers 1] [--faults]

Each submission is a distinct MLP plan request (mesh x batch), all sent at once from as many
client threads, alternating replicas; a client retries a refused connection or a 5xx on the
other replica, as a load balancer would (counted). Printed: accepted, lost (accepted, never
done), 5xx answers, retried connections, plans equal to `autoshard plan --json`'s (all but the
`timing` block, wall-clock figures), and the wall time from the first submission to the last
plan done.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoshard.cli.main import main  # noqa: E402
from tests.api.conftest import Server  # noqa: E402
from tests.api.postgres import Postgres, binaries  # noqa: E402

MLP = ROOT / "models" / "mlp.onnx"


def requests(count: int) -> list[dict[str, str]]:
    meshes = ("2x2", "4", "2x4", "8")
    return [
        {"mesh": meshes[i % 4], "dims": json.dumps({"batch": 1 + i // 4})} for i in range(count)
    ]


def submit(replicas: list[Server], first: int, fields: dict[str, str], errors: list) -> str | None:
    for turn in range(first, first + 200):
        replica = replicas[turn % len(replicas)]
        try:
            response = replica.submit(MLP, fields)
        except httpx.TransportError as error:
            errors.append(type(error).__name__)
            time.sleep(0.2)
            continue
        if response.status_code >= 500:
            errors.append(response.status_code)
            time.sleep(0.2)
            continue
        return str(response.json()["id"]) if response.status_code in (200, 202) else None
    return None


def cli_plan(fields: dict[str, str]) -> dict:
    batch = json.loads(fields["dims"])["batch"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", str(MLP), "--mesh", fields["mesh"], "--dim", f"batch={batch}", "--json"])
    return untimed(json.loads(out.getvalue()))


def untimed(plan: dict) -> dict:
    return {k: v for k, v in plan.items() if k != "timing"}


def run(args: argparse.Namespace, postgres: Postgres, data: Path) -> None:
    url = postgres.url()
    flags = ("--lease", "5")
    replicas = [Server(data, args.workers, url, flags, start_s=120).start() for _ in range(2)]
    asked = requests(args.submissions)
    errors: list = []
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(len(asked)) as threads:
            futures = [threads.submit(submit, replicas, i, f, errors) for i, f in enumerate(asked)]
            if args.faults:
                time.sleep(2)
                replicas[0].kill()
                postgres.stop()
                time.sleep(3)
                postgres.start()
            ids = [future.result() for future in futures]
        survivor = replicas[-1]
        jobs = [survivor.wait(i, timeout=1800) if i else None for i in ids]
        wall = time.monotonic() - started
    finally:
        for replica in replicas:
            replica.stop()
    done = [j for j in jobs if j is not None and j["status"] == "done"]
    same = sum(untimed(j["plan"]) == cli_plan(f) for j, f in zip(jobs, asked, strict=True) if j)
    fivexx = sum(1 for e in errors if isinstance(e, int))
    print(
        f"submissions {len(asked)} across 2 replicas ({args.workers} worker each)"
        f"{', a replica killed and PostgreSQL restarted' if args.faults else ''}"
    )
    print(
        f"accepted {sum(i is not None for i in ids)}, done {len(done)}, "
        f"lost {sum(i is not None for i in ids) - len(done)}"
    )
    print(f"5xx answers {fivexx}, connections retried {len(errors) - fivexx}")
    print(f"plans equal to autoshard plan's {same}/{len(asked)}")
    print(f"wall {wall:.1f} s ({len(asked) / wall:.2f} plans/s)")


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--submissions", type=int, default=200)
    parser.add_argument("--workers", type=int, default=1, help="solver processes per replica")
    parser.add_argument("--faults", action="store_true", help="kill a replica, restart the DB")
    args = parser.parse_args()
    found = binaries()
    if found is None:
        sys.exit("no PostgreSQL server (initdb): apt-get install postgresql")
    postgres = Postgres(found)
    postgres.start()
    try:
        with tempfile.TemporaryDirectory() as folder:
            run(args, postgres, Path(folder) / "data")
    finally:
        postgres.remove()


if __name__ == "__main__":
    main_()
