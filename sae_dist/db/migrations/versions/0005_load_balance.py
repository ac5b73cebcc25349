"""Load balance and failed devices: each rank's share in rank_stats, the window's imbalance in
step_metrics, run_events (rebalanced, continued on fewer devices) and device_faults.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 15:04:44.220198
"""

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('device_faults',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('device_uuid', sa.String(), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=True),
    sa.Column('run_id', sa.Integer(), nullable=True),
    sa.Column('rank', sa.Integer(), nullable=True),
    sa.Column('reason', sa.String(), nullable=False),
    sa.Column('detected_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('cleared_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('cleared_reason', sa.String(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_device_faults'))
    )
    with op.batch_alter_table('device_faults', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_device_faults_device_uuid'), ['device_uuid'], unique=False)

    op.create_table('run_events',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('time', sa.DateTime(timezone=True), nullable=False),
    sa.Column('kind', sa.String(), nullable=False),
    sa.Column('message', sa.String(), nullable=False),
    sa.Column('details_json', sa.String(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['training_runs.id'], name=op.f('fk_run_events_run_id_training_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_run_events'))
    )
    with op.batch_alter_table('run_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_run_events_run_id'), ['run_id'], unique=False)

    with op.batch_alter_table('rank_stats', schema=None) as batch_op:
        batch_op.add_column(sa.Column('batch_size', sa.Integer(), nullable=True))

    with op.batch_alter_table('step_metrics', schema=None) as batch_op:
        batch_op.add_column(sa.Column('imbalance', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('balance_limited_rank', sa.Integer(), nullable=True))



def downgrade() -> None:
    with op.batch_alter_table('step_metrics', schema=None) as batch_op:
        batch_op.drop_column('balance_limited_rank')
        batch_op.drop_column('imbalance')

    with op.batch_alter_table('rank_stats', schema=None) as batch_op:
        batch_op.drop_column('batch_size')

    with op.batch_alter_table('run_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_run_events_run_id'))

    op.drop_table('run_events')
    with op.batch_alter_table('device_faults', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_device_faults_device_uuid'))

    op.drop_table('device_faults')
