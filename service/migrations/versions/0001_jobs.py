"""The jobs and their kept HTML reports, as the services before Alembic made them.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None


def upgrade() -> None:
    tables = sa.inspect(op.get_bind()).get_table_names()
    if "jobs" not in tables:  # a store of a service before Alembic has it already
        op.create_table(
            "jobs",
            sa.Column("id", sa.Text, primary_key=True),
            sa.Column("status", sa.Text, nullable=False),
            sa.Column("attempt", sa.Integer, nullable=False, server_default="1"),
            sa.Column("model_sha256", sa.Text, nullable=False),
            sa.Column("model_path", sa.Text, nullable=False),
            sa.Column("options", sa.Text, nullable=False),
            *(sa.Column(name, sa.Text) for name in ("progress", "error", "cause", "plan")),
            *(sa.Column(name, sa.Text) for name in ("spmd", "spmd_error", "report")),
            sa.Column("created", sa.Double, nullable=False),
            sa.Column("started", sa.Double),
            sa.Column("finished", sa.Double),
        )
    if "reports" not in tables:
        op.create_table(
            "reports",
            sa.Column("job_id", sa.Text, primary_key=True),
            sa.Column("tensors", sa.Text, primary_key=True),
            sa.Column("html", sa.Text, nullable=False),
        )


def downgrade() -> None:
    op.drop_table("reports")
    op.drop_table("jobs")
