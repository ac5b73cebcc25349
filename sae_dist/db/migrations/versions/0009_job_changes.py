"""Job changes: a row per change that can let a pending job start, written by database triggers
for every writer, so the scheduler daemon follows changes instead of re-reading its queue.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24 10:50:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None

# What a pending job's start depends on; reasons, pids and paths written while jobs run are not.
WATCHED = ("state", "held", "priority", "begin_at", "dependencies_json", "gpus", "gpu_ids_json",
           "mem_per_gpu", "time_limit_s", "exclusive", "cancel_requested")


def upgrade() -> None:
    op.create_table('job_changes',
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_job_changes')),
    sqlite_autoincrement=True
    )
    columns = ", ".join(WATCHED)
    if op.get_bind().dialect.name == "postgresql":
        op.execute("CREATE FUNCTION job_changed() RETURNS trigger AS $$ BEGIN "
                   "INSERT INTO job_changes (job_id) VALUES (CASE WHEN TG_OP = 'DELETE' THEN OLD.id "
                   "ELSE NEW.id END); RETURN NULL; END $$ LANGUAGE plpgsql")
        op.execute("CREATE TRIGGER jobs_changed AFTER INSERT OR DELETE OR UPDATE OF "
                   f"{columns} ON jobs FOR EACH ROW EXECUTE FUNCTION job_changed()")
        return
    # A trigger dies with its table: a batch migration that recreates `jobs` must create these again.
    for event, row in (("INSERT", "NEW"), ("DELETE", "OLD"), (f"UPDATE OF {columns}", "NEW")):
        name = "jobs_changed_" + event.split()[0].lower()
        op.execute(f"CREATE TRIGGER {name} AFTER {event} ON jobs "
                   f"BEGIN INSERT INTO job_changes (job_id) VALUES ({row}.id); END")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER jobs_changed ON jobs")
        op.execute("DROP FUNCTION job_changed()")
    else:
        for event in ("insert", "delete", "update"):
            op.execute(f"DROP TRIGGER jobs_changed_{event}")
    op.drop_table('job_changes')
