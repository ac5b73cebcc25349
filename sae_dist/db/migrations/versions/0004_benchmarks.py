"""Scaling benchmarks: a run per benchmark, a row per device count, repeat and kind (DDP or ceiling).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 09:43:40.553931
"""

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('benchmark_runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(), nullable=False),
    sa.Column('status', sa.String(), nullable=False),
    sa.Column('mode', sa.String(), nullable=False),
    sa.Column('device_counts', sa.String(), nullable=False),
    sa.Column('config_json', sa.String(), nullable=False),
    sa.Column('steps', sa.Integer(), nullable=False),
    sa.Column('warmup_steps', sa.Integer(), nullable=False),
    sa.Column('repeats', sa.Integer(), nullable=False),
    sa.Column('queued', sa.Boolean(), nullable=False),
    sa.Column('device_kind', sa.String(), nullable=False),
    sa.Column('device_names', sa.String(), nullable=False),
    sa.Column('virtual', sa.Boolean(), nullable=False),
    sa.Column('backend', sa.String(), nullable=False),
    sa.Column('torch_version', sa.String(), nullable=False),
    sa.Column('link', sa.String(), nullable=True),
    sa.Column('host', sa.String(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('error', sa.String(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_benchmark_runs'))
    )
    op.create_table('benchmark_points',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('bench_id', sa.Integer(), nullable=False),
    sa.Column('devices', sa.Integer(), nullable=False),
    sa.Column('repeat', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(), nullable=False),
    sa.Column('per_device_batch', sa.Integer(), nullable=False),
    sa.Column('samples_per_s', sa.Float(), nullable=False),
    sa.Column('step_s', sa.Float(), nullable=False),
    sa.Column('step_no_comm_s', sa.Float(), nullable=True),
    sa.Column('comm_share', sa.Float(), nullable=True),
    sa.Column('peak_memory', sa.BigInteger(), nullable=True),
    sa.Column('grad_bytes', sa.BigInteger(), nullable=True),
    sa.Column('allreduce_bytes_per_s', sa.Float(), nullable=True),
    sa.Column('mean_utilization_pct', sa.Float(), nullable=True),
    sa.Column('job_id', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['bench_id'], ['benchmark_runs.id'], name=op.f('fk_benchmark_points_bench_id_benchmark_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_benchmark_points'))
    )
    with op.batch_alter_table('benchmark_points', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_benchmark_points_bench_id'), ['bench_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('benchmark_points', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_benchmark_points_bench_id'))

    op.drop_table('benchmark_points')
    op.drop_table('benchmark_runs')
