"""Jobs claimed by a replica: who runs one, its lease's last renewal, the runs it lost.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    with op.batch_alter_table("jobs") as jobs:
        jobs.add_column(sa.Column("owner", sa.Text))
        jobs.add_column(sa.Column("heartbeat", sa.Double))
        jobs.add_column(sa.Column("lost", sa.Integer, nullable=False, server_default="0"))
    op.create_index("jobs_queue", "jobs", ["status", "created", "id"])


def downgrade() -> None:
    op.drop_index("jobs_queue", "jobs")
    with op.batch_alter_table("jobs") as jobs:
        jobs.drop_column("lost")
        jobs.drop_column("heartbeat")
        jobs.drop_column("owner")
