"""Shared devices (`submit --shared`): a job may share GPUs with other shared jobs while their
declared memory fits; its allocations are marked shared, and the unique index that makes a double
allocation impossible covers the unshared ones only. The devices table keeps each device's
sharers as the daemon last saw them (declared and measured memory).

Columns are added (ALTER TABLE ADD COLUMN), never by recreating `jobs`: its change triggers
(0009) would die with the old table.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27 18:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('jobs', sa.Column('shared', sa.Boolean(), server_default=sa.false(), nullable=False))
    op.add_column('allocations', sa.Column('shared', sa.Boolean(), server_default=sa.false(), nullable=False))
    op.add_column('devices', sa.Column('sharers_json', sa.String(), nullable=True))
    op.drop_index('uq_allocations_active_device', table_name='allocations')
    op.create_index('uq_allocations_active_device', 'allocations', ['device_uuid'], unique=True,
                    sqlite_where=sa.text('released_at IS NULL AND NOT shared'),
                    postgresql_where=sa.text('released_at IS NULL AND NOT shared'))


def downgrade() -> None:
    op.drop_index('uq_allocations_active_device', table_name='allocations')
    op.create_index('uq_allocations_active_device', 'allocations', ['device_uuid'], unique=True,
                    sqlite_where=sa.text('released_at IS NULL'), postgresql_where=sa.text('released_at IS NULL'))
    op.execute('ALTER TABLE devices DROP COLUMN sharers_json')
    op.execute('ALTER TABLE allocations DROP COLUMN shared')
    op.execute('ALTER TABLE jobs DROP COLUMN shared')
