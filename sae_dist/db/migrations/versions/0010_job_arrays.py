"""Job arrays: a task of an array is a job row that names its array (the id of its first task)
and its task id; `array_max_running` is the array's `%N` (at most N of its tasks run at once).

Columns are added (ALTER TABLE ADD COLUMN), never by recreating `jobs`: its change triggers
(0009) would die with the old table.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-24 14:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('jobs', sa.Column('array_job_id', sa.Integer(), nullable=True))
    op.add_column('jobs', sa.Column('array_task_id', sa.Integer(), nullable=True))
    op.add_column('jobs', sa.Column('array_max_running', sa.Integer(), nullable=True))
    op.create_index(op.f('ix_jobs_array_job_id'), 'jobs', ['array_job_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_jobs_array_job_id'), table_name='jobs')
    for column in ('array_max_running', 'array_task_id', 'array_job_id'):
        # ALTER TABLE ... DROP COLUMN (SQLite 3.35+), not a batch copy: the triggers stay.
        op.execute(f'ALTER TABLE jobs DROP COLUMN {column}')
