"""The queue's version: a one-row counter that database triggers raise on every change that can
let a pending job start, so the scheduler daemon follows changes instead of re-reading its queue.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24 10:50:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None

# What a pending job's start depends on; reasons, pids and paths written while jobs run are not.
WATCHED = ("state", "held", "priority", "begin_at", "dependencies_json", "gpus", "gpu_ids_json",
           "mem_per_gpu", "time_limit_s", "exclusive", "cancel_requested")
BUMP = "UPDATE queue_version SET version = version + 1 WHERE id = 1"


def upgrade() -> None:
    op.create_table('queue_version',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('version', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_queue_version'))
    )
    op.execute("INSERT INTO queue_version (id, version) VALUES (1, 0)")
    columns = ", ".join(WATCHED)
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"CREATE FUNCTION queue_version_bump() RETURNS trigger AS $$ BEGIN {BUMP}; "
                   "RETURN NULL; END $$ LANGUAGE plpgsql")
        op.execute("CREATE TRIGGER jobs_queue_version AFTER INSERT OR DELETE OR UPDATE OF "
                   f"{columns} ON jobs FOR EACH STATEMENT EXECUTE FUNCTION queue_version_bump()")
        return
    for event in ("INSERT", "DELETE", f"UPDATE OF {columns}"):
        name = "jobs_queue_version_" + event.split()[0].lower()
        op.execute(f"CREATE TRIGGER {name} AFTER {event} ON jobs BEGIN {BUMP}; END")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER jobs_queue_version ON jobs")
        op.execute("DROP FUNCTION queue_version_bump()")
    else:
        for event in ("insert", "delete", "update"):
            op.execute(f"DROP TRIGGER jobs_queue_version_{event}")
    op.drop_table('queue_version')
