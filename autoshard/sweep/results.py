"""The finished points of a sweep, one JSON line each in `OUT/results.jsonl`, appended and
synced to disk as each point finishes: a killed sweep restarted with the same output reads
them back and plans only the points it has no line for (a line cut short by the kill is
planned again)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from autoshard.sweep.grid import SweepError

RESULTS = "results.jsonl"


def read_results(folder: Path) -> dict[str, dict[str, Any]]:
    """The rows already in the folder by key (the last row of a key counts)."""
    path = folder / RESULTS
    rows: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line the kill cut short: its point is planned again
        if isinstance(row, dict) and "key" in row:
            rows[row["key"]] = row
    return rows


class Results:
    """The results file, open for appending: `add` writes a row and syncs it."""

    def __init__(self, folder: Path) -> None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._out: IO[str] = open(folder / RESULTS, "a")  # noqa: SIM115 - closed by close
        except OSError as error:
            raise SweepError(
                f"cannot write the sweep's output {folder}: {error.strerror}"
            ) from None
        self._cut = self._ends_cut(folder / RESULTS)

    @staticmethod
    def _ends_cut(path: Path) -> bool:
        """Whether the file's last line lacks its newline (a kill mid-write)."""
        with open(path, "rb") as existing:
            existing.seek(0, os.SEEK_END)
            if existing.tell() == 0:
                return False
            existing.seek(-1, os.SEEK_END)
            return existing.read(1) != b"\n"

    def add(self, row: dict[str, Any]) -> None:
        prefix = "\n" if self._cut else ""
        self._cut = False
        self._out.write(prefix + json.dumps(row, sort_keys=True) + "\n")
        self._out.flush()
        os.fsync(self._out.fileno())

    def close(self) -> None:
        self._out.close()


def rows_in_order(keys: list[str], rows: dict[str, dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The rows of `keys` that are done, in the grid's order."""
    return (rows[key] for key in keys if key in rows)
