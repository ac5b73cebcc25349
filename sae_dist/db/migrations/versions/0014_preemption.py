"""Preemption: a job may be preemptible (with its grace time), is marked while a preemption of it is
under way (`preempted_by`), and keeps its earlier runs (`attempts_json`: requeued after a preemption
or a failure, as SLURM's `sacct -D` lists them).

Columns are added (ALTER TABLE ADD COLUMN), never by recreating `jobs`: its change triggers
(0009) would die with the old table.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27 18:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None

COLUMNS = ('preemptible', 'preempt_grace_s', 'preempted_by', 'attempts_json')


def upgrade() -> None:
    op.add_column('jobs', sa.Column('preemptible', sa.Boolean(), server_default=sa.false(), nullable=False))
    op.add_column('jobs', sa.Column('preempt_grace_s', sa.Float(), nullable=True))
    op.add_column('jobs', sa.Column('preempted_by', sa.Integer(), nullable=True))
    op.add_column('jobs', sa.Column('attempts_json', sa.String(), nullable=True))


def downgrade() -> None:
    for column in reversed(COLUMNS):
        op.execute(f'ALTER TABLE jobs DROP COLUMN {column}')
