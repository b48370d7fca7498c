"""Where the job store lives: a database URL, checked and given its driver, and the engine
that reaches it. SQLite (a file under the data folder) is the embedded default; PostgreSQL
(`--database postgresql://USER:PASSWORD@HOST/DB`) lets several API replicas share one store.

Both are reached through SQLAlchemy Core, one SQL text for both but where they differ (row
claiming, see store.py); the schema is Alembic's (service/migrations), applied at startup.

A PostgreSQL that restarts or drops a connection is ridden out: `retrying` runs a transaction
again on a connection error for up to `RETRY_S` seconds, so a store that is back within that
time costs a request a delay, not an error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import sqlalchemy
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from autoshard.errors import AutoshardError

log = logging.getLogger("autoshard.service")

RETRY_S = 20.0  # how long a store call waits out a database that is down
_T = TypeVar("_T")


class DatabaseError(AutoshardError):
    """A --database URL the service cannot use."""


def database_url(given: str | Path) -> str:
    """SQLAlchemy's URL of `--database` (a path is a SQLite file); DatabaseError if it is
    neither SQLite nor PostgreSQL."""
    text = str(given)
    if "://" not in text:
        return f"sqlite:///{Path(text).resolve()}"
    scheme, rest = text.split("://", 1)
    postgres = "postgresql+psycopg"
    driver = {"postgresql": postgres, "postgres": postgres, postgres: postgres,
              "sqlite": "sqlite"}.get(scheme)  # fmt: skip
    if driver is None:
        raise DatabaseError(
            f"--database {text}: unknown scheme '{scheme}'; give postgresql://USER:PASSWORD@HOST"
            "/DB or sqlite:///PATH"
        )
    if driver.startswith("postgresql"):
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise DatabaseError(
                "--database postgresql://...: the PostgreSQL driver is not installed; "
                "pip install 'autoshard[postgres]'"
            ) from None
    return f"{driver}://{rest}"


def is_postgres(url: str) -> bool:
    return url.startswith("postgresql")


def make_engine(url: str) -> Engine:
    """An engine of `database_url(...)`'s URL: SQLite in WAL mode (readers never wait for the
    one writer), PostgreSQL with connections checked before use."""
    if is_postgres(url):
        return sqlalchemy.create_engine(
            url,
            pool_pre_ping=True,
            pool_size=4,
            max_overflow=8,
            connect_args={"connect_timeout": 5},
        )
    engine = sqlalchemy.create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _pragmas(connection, _record) -> None:  # type: ignore[no-untyped-def]
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=NORMAL")

    return engine


def retrying(engine: Engine, work: Callable[[], _T], retry_s: float = RETRY_S) -> _T:
    """`work()` (one transaction), run again while the database is unreachable, up to
    `retry_s` seconds; the last error after that."""
    deadline = time.monotonic() + retry_s
    delay = 0.05
    while True:
        try:
            return work()
        except DBAPIError as error:
            lost = error.connection_invalidated or isinstance(
                error.orig, _connection_errors(engine)
            )
            if not lost or time.monotonic() + delay > deadline:
                raise
            log.warning("database unreachable, retrying: %s", str(error.orig).strip())
            engine.dispose()
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


def _connection_errors(engine: Engine) -> tuple[type[BaseException], ...]:
    """The driver's errors that mean the server is down or restarting, not a bad statement."""
    if engine.dialect.name != "postgresql":
        return ()
    import psycopg

    return (psycopg.OperationalError, psycopg.errors.AdminShutdown, psycopg.InterfaceError)
