"""A device sample keeps the free memory NVML reads (dcgm-exporter's FB_FREE: total less used
less what the driver reserves, which total minus used would count as free). NULL for samples
taken before it, and where it was not read.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-27 19:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('gpu_samples', sa.Column('memory_free', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.execute('ALTER TABLE gpu_samples DROP COLUMN memory_free')
