"""`autoshard solve`: an IOPDDL contest problem solved by the planner's solver."""

from __future__ import annotations

import argparse
from pathlib import Path

from autoshard.files import write_atomic


def cmd_solve(args: argparse.Namespace) -> int:
    from autoshard.deadline import Deadline
    from autoshard.search.iopddl.format import read_problem, solution_text
    from autoshard.search.iopddl.solve import solve_iopddl

    if args.time_limit <= 0:
        from autoshard.errors import AutoshardError

        raise AutoshardError(f"--time-limit must be positive, not {args.time_limit}")
    out = Path(args.out) if args.out else None
    if out is not None and not out.parent.is_dir():
        from autoshard.files import FileWriteError

        raise FileWriteError(f"cannot write '{out}': its folder does not exist")
    deadline = Deadline.start(args.time_limit)  # (reading the problem counts too)
    problem = read_problem(args.problem)
    solved = solve_iopddl(problem, args.time_limit, deadline)
    text = solution_text(solved.solution)
    if out is not None:
        write_atomic(out, text.encode())
    limit = "none" if problem.usage_limit is None else str(problem.usage_limit)
    status = "OPTIMAL" if solved.optimal else "FEASIBLE"
    print(f"problem {problem.name or args.problem}: {len(problem.costs)} nodes, "
          f"{problem.strategies} strategies, {len(problem.edges)} edges")  # fmt: skip
    print(f"cost {solved.cost}  bound {solved.bound}  gap {solved.gap:.2%}  {status}")
    print(f"usage {solved.usage} of limit {limit}  ({solved.wall_s:.1f} s)")
    if out is None:
        print(text, end="")
    return 0
