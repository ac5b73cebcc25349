"""Benchmarks that refuse to mislead: exclusive jobs, and each benchmark point's other load,
reliability and the reason it is not reliable.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24 01:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('exclusive', sa.Boolean(), server_default=sa.false(), nullable=False))

    with op.batch_alter_table('benchmark_points', schema=None) as batch_op:
        batch_op.add_column(sa.Column('other_load_json', sa.String(), nullable=True))
        batch_op.add_column(sa.Column('reliable', sa.Boolean(), server_default=sa.true(), nullable=False))
        batch_op.add_column(sa.Column('reason', sa.String(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('benchmark_points', schema=None) as batch_op:
        batch_op.drop_column('reason')
        batch_op.drop_column('reliable')
        batch_op.drop_column('other_load_json')

    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('exclusive')
