"""SAEBench's core metrics of an evaluation (sae_dist.evaluate.metrics.core_metrics), as one JSON
column: explained variance, MSE, cosine, L2 ratio, relative reconstruction bias, L0, L1, the latents
alive and firing over 1% and 10%. NULL for evaluations stored before them.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-27 12:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('evaluations', sa.Column('core_json', sa.String(), nullable=True))


def downgrade() -> None:
    op.execute('ALTER TABLE evaluations DROP COLUMN core_json')
