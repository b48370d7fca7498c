"""A throwaway PostgreSQL server for the tests: a cluster made by initdb in a temporary folder,
started with pg_ctl on a free port (as the `postgres` user when the tests run as root, since
PostgreSQL refuses to run as root), stopped and removed at the end."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import psycopg

from .conftest import free_port


def binaries() -> Path | None:
    """The folder of initdb and pg_ctl: on PATH, or Debian's newest under /usr/lib/postgresql."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent  # Debian links initdb alone onto PATH at most
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version)
    return Path(versions[-1]).parent if versions else None


def _version(path: str) -> int:
    return int(Path(path).parts[-3]) if Path(path).parts[-3].isdigit() else 0


class Postgres:
    """One PostgreSQL server; `url()` of a fresh database on it."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="autoshard-pg-"))
        self.data, self.port = self.root / "data", free_port()
        self._as: list[str] = []
        if os.geteuid() == 0:
            self._as = ["runuser", "-u", "postgres", "--"]
            shutil.chown(self.root, "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8")
        self._databases = 0

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([*self._as, str(self.bin / tool), *args], check=True,
                       capture_output=True, cwd=self.root)  # fmt: skip

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l",
                  str(self.root / "log"), "-w", "start")  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def url(self) -> str:
        """A new empty database's URL."""
        self._databases += 1
        name = f"autoshard{self._databases}"
        url = f"postgresql://postgres@127.0.0.1:{self.port}"
        with psycopg.connect(f"{url}/postgres", autocommit=True) as db:
            db.execute(f"CREATE DATABASE {name}")
        return f"{url}/{name}"

    def remove(self) -> None:
        try:
            self.stop("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
