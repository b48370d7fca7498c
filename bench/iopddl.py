"""The IOPDDL contest's public problems (ASPLOS 2025 / EuroSys 2025) solved by `autoshard
solve`, against the best cost a team submitted.

    python bench/iopddl.py INSTANCE_DIR [--time-limit 60] [--only A B ...] [--memory-gib 8]
        [--kill-after S] [--json ROWS.json]

INSTANCE_DIR holds google/iopddl's `benchmarks/asplos-2025-iopddl-?.json.gz` (nothing is
downloaded). Each problem is solved in a child process of its own (a crash or a memory limit
ends that row, not the table), `--time-limit` wall seconds each after reading it, the child
killed after `--kill-after` wall seconds (default three times the limit and 30 s). The
table: nodes, the groups they make (`iopddl.ties`), strategies, our cost, the best team's
(`BEST`, from asplos-contest/2025 `misc/iopddl_final_results.csv`, the least below the
contest's 10**18 penalty), their ratio, the bound we prove (its ratio to the best), the
status and the wall seconds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import sys
import time
from pathlib import Path

BEST = {
    "A": 6548641531, "B": 532843, "C": 84102445260, "D": 313613524736, "E": 338965335230,
    "F": 364364563561, "G": 217039, "H": 527715404257, "I": 583706456444, "J": 1360981630371,
    "K": 2274276676, "L": 1970993742, "M": 49928460991, "N": 202739586553, "O": 222880199765,
    "P": 662197407330, "Q": 526776842042, "R": 371899551572, "S": 1534613444, "T": 682895254913,
    "U": 2569342178, "V": 1632051, "W": 11818845467155, "X": 280461191177, "Y": 621176568278,
}  # fmt: skip
"""The best feasible cost any team submitted, per problem (the contest's final results)."""


def _solve(path: str, time_limit: float, memory_gib: float, out: multiprocessing.Queue) -> None:
    limit = int(memory_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from autoshard.errors import AutoshardError
    from autoshard.search.iopddl.format import read_problem
    from autoshard.search.iopddl.solve import solve_iopddl

    try:
        problem = read_problem(path)
        size = {"nodes": len(problem.costs), "strategies": problem.strategies}
        out.put(size)
        solved = solve_iopddl(problem, time_limit)
        out.put({"cost": solved.cost, "bound": solved.bound, "optimal": solved.optimal,
                 "groups": solved.groups, "neighbourhoods": solved.tried})  # fmt: skip
    except AutoshardError as error:
        out.put({"error": str(error)})
    except MemoryError:
        out.put({"error": f"out of memory ({memory_gib} GiB)"})


def run(path: Path, time_limit: float, memory_gib: float, kill_after: float) -> dict:
    """One problem solved in a child process: its size, cost, bound, status and wall."""
    queue: multiprocessing.Queue = multiprocessing.Queue()
    child = multiprocessing.Process(target=_solve, args=(str(path), time_limit, memory_gib, queue))
    started = time.perf_counter()
    child.start()
    found: dict = {}
    deadline = started + kill_after
    while child.is_alive() or not queue.empty():
        try:
            found |= queue.get(timeout=1.0)
        except Exception:  # queue.Empty: nothing yet
            if time.perf_counter() > deadline:
                child.kill()
                found.setdefault("error", f"killed after {kill_after:.0f} s")
                break
    child.join()
    if "cost" not in found and "error" not in found:
        found["error"] = f"child died (exit {child.exitcode})"
    return found | {"wall": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("instances", type=Path, help="folder of asplos-2025-iopddl-?.json.gz")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--only", nargs="*", help="problem letters (default: all found)")
    parser.add_argument("--memory-gib", type=float, default=8.0)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--kill-after", type=float, help="wall seconds per problem (default 3 x limit + 30)"
    )
    args = parser.parse_args()
    files = sorted(args.instances.glob("asplos-2025-iopddl-*.json*"))
    rows = []
    print(f"{'':3}{'nodes':>7}{'groups':>7}{'strategies':>11}{'cost':>16}{'best':>16}{'ratio':>8}"
          f"{'bound/best':>11}  {'status':9}{'wall s':>7}{'LNS':>6}")  # fmt: skip
    for path in files:
        letter = path.name.split("-")[-1].split(".")[0]
        if args.only and letter not in args.only:
            continue
        kill_after = args.kill_after or 3 * args.time_limit + 30
        found = run(path, args.time_limit, args.memory_gib, kill_after) | {"problem": letter}
        rows.append(found)
        best = BEST.get(letter)
        size = (f"{found.get('nodes', '?'):>7}{found.get('groups', '?'):>7}"
                f"{found.get('strategies', '?'):>11}")  # fmt: skip
        if "cost" in found:
            ratio = f"{found['cost'] / best:8.3f}" if best else f"{'?':>8}"
            bound = f"{found['bound'] / best:11.3f}" if best else f"{'?':>11}"
            status = "OPTIMAL" if found["optimal"] else "FEASIBLE"
            print(f"{letter:3}{size}{found['cost']:>16}{best or '?':>16}{ratio}{bound}  "
                  f"{status:9}{found['wall']:7.0f}{found['neighbourhoods']:6}")  # fmt: skip
        else:
            print(f"{letter:3}{size}  {found['error'][:90]}  ({found['wall']:.0f} s)")
        sys.stdout.flush()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
