"""The job store's schema as Alembic revisions (versions/), applied at a server's startup so
an upgrade keeps every job and plan. The first revision is the schema of the services before
Alembic: on a store of theirs it finds the tables there and only records the revision.

Replicas starting together on one PostgreSQL take an advisory lock around the upgrade: one
upgrades, the others then find the schema current.
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy
from alembic import command
from alembic.config import Config
from sqlalchemy.engine import Engine

HERE = Path(__file__).parent
_LOCK = 0x6175746F  # the advisory lock's key ("auto")


def config(connection: sqlalchemy.engine.Connection) -> Config:
    """Alembic's configuration of this folder, on an open connection."""
    alembic = Config()
    alembic.set_main_option("script_location", str(HERE))
    alembic.attributes["connection"] = connection
    return alembic


def upgrade(engine: Engine) -> None:
    """Bring the store's schema to the newest revision."""
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            lock = sqlalchemy.text("SELECT pg_advisory_xact_lock(:key)")
            connection.execute(lock, {"key": _LOCK})
        command.upgrade(config(connection), "head")


def revision(engine: Engine) -> str | None:
    """The store's revision (None: no schema yet)."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()
