"""`submit --snapshot`: the commit a job was queued at (`<sha>` or `<sha>+uncommitted`) and the
copy of its working directory in the snapshot it runs (scheduler.snapshot). NULL for other jobs.

Columns are added (ALTER TABLE ADD COLUMN), never by recreating `jobs`: its change triggers
(0009) would die with the old table.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-27 17:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('jobs', sa.Column('snapshot_commit', sa.String(), nullable=True))
    op.add_column('jobs', sa.Column('snapshot_dir', sa.String(), nullable=True))


def downgrade() -> None:
    for column in ('snapshot_dir', 'snapshot_commit'):
        op.execute(f'ALTER TABLE jobs DROP COLUMN {column}')
