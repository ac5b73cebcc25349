"""A pending job's expected start: the scheduler's reservation for the job at the head of the
queue (the earliest time enough devices come back, by the running jobs' time limits), as
`squeue --start` shows it. NULL for every other job, and for the head when nothing says when.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-30 08:15:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('jobs', sa.Column('expected_start_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.execute('ALTER TABLE jobs DROP COLUMN expected_start_at')
