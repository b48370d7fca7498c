"""The IOPDDL contest's problem format (ASPLOS 2025 / EuroSys 2025, google/iopddl): read,
checked, priced as the contest's evaluator prices a solution, and the solution written.

An IOPDDL problem is ours without a graph: a strategy per node, each with a cost and a memory
usage over the node's live interval `[start, end)` (half-open: `[0, 0]` holds nothing), a cost
matrix per edge (row-major over the two nodes' strategies; several edges may join the same
nodes, their costs add up), and a usage limit that the summed usage at every time point must
not pass. A cost of `FORBIDDEN` (10**18) marks a strategy or a pair no solution should take.
A solution is a JSON list of one strategy index per node.
"""

from __future__ import annotations

import gzip
import itertools
import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from autoshard.errors import AutoshardError

FORBIDDEN = 10**18
"""The contest's cost of a strategy or a pair that must not be taken."""


class IopddlError(AutoshardError):
    """A problem or solution file that is not the contest's format, or a problem no solution
    solves within its usage limit."""


@dataclass(frozen=True, eq=False)
class IopddlProblem:
    """A contest problem as read: per node its interval, strategy costs and usages; per edge
    its two nodes and its costs (row-major); the usage limit (None: no limit)."""

    name: str
    intervals: np.ndarray  # (nodes, 2) int64
    costs: tuple[tuple[int, ...], ...]
    usages: tuple[tuple[int, ...], ...]
    edges: np.ndarray  # (edges, 2) int64
    edge_costs: tuple[tuple[int, ...], ...]
    usage_limit: int | None

    @property
    def strategies(self) -> int:
        return sum(map(len, self.costs))

    def cost(self, solution: Sequence[int]) -> int:
        """The solution's total cost, as the contest's evaluator adds it up (exact)."""
        total = sum(c[k] for c, k in zip(self.costs, solution, strict=True))
        for (a, b), costs in zip(self.edges.tolist(), self.edge_costs, strict=True):
            total += costs[solution[a] * len(self.costs[b]) + solution[b]]
        return total

    def usage(self, solution: Sequence[int]) -> int:
        """The most usage live at one time point under the solution."""
        ends = int(self.intervals[:, 1].max(initial=0))
        change = np.zeros(ends + 1, np.int64)
        used = np.array([u[k] for u, k in zip(self.usages, solution, strict=True)], np.int64)
        np.add.at(change, self.intervals[:, 0], used)
        np.add.at(change, self.intervals[:, 1], -used)
        return int(np.cumsum(change).max(initial=0))

    def check(self, solution: Sequence[int]) -> None:
        """A clear error where the solution is not one of this problem's."""
        if len(solution) != len(self.costs):
            raise IopddlError(f"the solution has {len(solution)} strategies; the problem "
                              f"'{self.name}' has {len(self.costs)} nodes")  # fmt: skip
        for node, (k, costs) in enumerate(zip(solution, self.costs, strict=True)):
            if not 0 <= k < len(costs):
                raise IopddlError(f"node {node} has strategies 0..{len(costs) - 1}, not {k}")


# ---- reading and writing ---------------------------------------------------------------------


def read_problem(path: str | Path) -> IopddlProblem:
    """The problem in a contest file (`.json`, or gzipped); `IopddlError` naming what is wrong."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        data = json.loads(raw)
    except OSError as error:
        raise IopddlError(f"cannot read '{path}': {error.strerror}") from None
    except (EOFError, zlib.error, gzip.BadGzipFile):
        raise IopddlError(f"'{path}' is not a readable gzip file") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise IopddlError(f"'{path}' is not JSON: {error}") from None
    return parse_problem(data, str(path))


def parse_problem(data: Any, where: str = "the problem") -> IopddlProblem:
    """The problem of the contest's JSON (`{"problem": {"nodes": ..., "edges": ...}}`)."""
    body = _field(data, "problem", dict, where)
    nodes = _field(body, "nodes", dict, f"{where}: problem")
    edges = _field(body, "edges", dict, f"{where}: problem")
    intervals = _int_lists(nodes, "intervals", where, "problem.nodes")
    costs = _int_lists(nodes, "costs", where, "problem.nodes")
    usages = _int_lists(nodes, "usages", where, "problem.nodes")
    pairs = _int_lists(edges, "nodes", where, "problem.edges")
    edge_costs = _int_lists(edges, "costs", where, "problem.edges")
    limit = body.get("usage_limit")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)):
        raise IopddlError(f"{where}: problem.usage_limit must be an integer, not {limit!r}")
    n = len(intervals)
    for name, lists in (("costs", costs), ("usages", usages)):
        if len(lists) != n:
            raise IopddlError(f"{where}: problem.nodes.{name} has {len(lists)} entries; "
                              f"problem.nodes.intervals has {n}")  # fmt: skip
    if len(edge_costs) != len(pairs):
        raise IopddlError(f"{where}: problem.edges.costs has {len(edge_costs)} entries; "
                          f"problem.edges.nodes has {len(pairs)}")  # fmt: skip
    for i, (start_end, c, u) in enumerate(zip(intervals, costs, usages, strict=True)):
        if len(start_end) != 2 or not 0 <= start_end[0] <= start_end[1]:
            raise IopddlError(f"{where}: node {i}'s interval {start_end} is not [start, end] "
                              "with 0 <= start <= end")  # fmt: skip
        if not c or len(c) != len(u):
            raise IopddlError(f"{where}: node {i} has {len(c)} costs and {len(u)} usages; "
                              "it needs one of each per strategy, at least one")  # fmt: skip
    for e, (pair, c) in enumerate(zip(pairs, edge_costs, strict=True)):
        if len(pair) != 2 or not all(0 <= v < n for v in pair):
            raise IopddlError(f"{where}: edge {e} joins {pair}; an edge joins two of the "
                              f"nodes 0..{n - 1}")  # fmt: skip
        if len(c) != len(costs[pair[0]]) * len(costs[pair[1]]):
            raise IopddlError(f"{where}: edge {e} has {len(c)} costs; its nodes' strategies "
                              f"make {len(costs[pair[0]]) * len(costs[pair[1]])}")  # fmt: skip
    return IopddlProblem(
        name=str(body.get("name", "")),
        intervals=np.array(intervals, np.int64).reshape(-1, 2),
        costs=tuple(map(tuple, costs)), usages=tuple(map(tuple, usages)),
        edges=np.array(pairs, np.int64).reshape(-1, 2), edge_costs=tuple(map(tuple, edge_costs)),
        usage_limit=limit,
    )  # fmt: skip


def _field(data: Any, name: str, kind: type, where: str) -> Any:
    if not isinstance(data, dict) or not isinstance(data.get(name), kind):
        raise IopddlError(
            f"{where} has no '{name}' {kind.__name__} (the IOPDDL format: "
            '{"problem": {"nodes": {...}, "edges": {...}, "usage_limit": N}})'
        )
    return data[name]


def _int_lists(data: dict, name: str, where: str, within: str) -> list[list[int]]:
    lists = data.get(name)
    # The types of all the values at once (millions of them on the contest's problems): a
    # check value by value in Python took most of reading one.
    if not isinstance(lists, list) or not (
        set(map(type, lists)) <= {list} and set(map(type, itertools.chain(*lists))) <= {int}
    ):
        raise IopddlError(f"{where}: {within}.{name} must be a list of lists of integers")
    return lists


def read_solution(path: str | Path) -> list[int]:
    """A solution file: the contest's list of strategy indices (its last line)."""
    try:
        lines = Path(path).read_text().strip().splitlines()
        solution = json.loads(lines[-1]) if lines else None
    except OSError as error:
        raise IopddlError(f"cannot read '{path}': {error.strerror}") from None
    except (ValueError, UnicodeDecodeError):
        solution = None
    if not isinstance(solution, list) or not all(
        isinstance(k, int) and not isinstance(k, bool) for k in solution
    ):
        raise IopddlError(f"'{path}' is not a solution: a list of strategy indices, [0, 2, 1]")
    return solution


def solution_text(solution: Sequence[int]) -> str:
    """The contest's solution line: `[0, 0, 2, 1, 0]`."""
    return "[" + ", ".join(str(int(k)) for k in solution) + "]\n"
