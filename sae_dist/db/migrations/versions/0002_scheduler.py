"""Scheduler: jobs, allocations, devices, gpu samples.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 04:06:08.353294
"""

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('devices',
    sa.Column('uuid', sa.String(), nullable=False),
    sa.Column('index', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(), nullable=False),
    sa.Column('virtual', sa.Boolean(), nullable=False),
    sa.Column('available', sa.Boolean(), nullable=False),
    sa.Column('error', sa.String(), nullable=True),
    sa.Column('memory_total', sa.BigInteger(), nullable=True),
    sa.Column('pci_bus_id', sa.String(), nullable=True),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('uuid', name=op.f('pk_devices'))
    )
    op.create_table('gpu_samples',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('device_uuid', sa.String(), nullable=False),
    sa.Column('time', sa.DateTime(timezone=True), nullable=False),
    sa.Column('utilization_pct', sa.Float(), nullable=True),
    sa.Column('memory_used', sa.BigInteger(), nullable=True),
    sa.Column('memory_total', sa.BigInteger(), nullable=True),
    sa.Column('temperature_c', sa.Float(), nullable=True),
    sa.Column('power_w', sa.Float(), nullable=True),
    sa.Column('job_id', sa.Integer(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_gpu_samples'))
    )
    with op.batch_alter_table('gpu_samples', schema=None) as batch_op:
        batch_op.create_index('ix_gpu_samples_device_time', ['device_uuid', 'time'], unique=False)
        batch_op.create_index(batch_op.f('ix_gpu_samples_job_id'), ['job_id'], unique=False)

    op.create_table('jobs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(), nullable=False),
    sa.Column('user', sa.String(), nullable=False),
    sa.Column('kind', sa.String(), nullable=False),
    sa.Column('argv_json', sa.String(), nullable=False),
    sa.Column('train_config_json', sa.String(), nullable=True),
    sa.Column('state', sa.String(), nullable=False),
    sa.Column('reason', sa.String(), nullable=True),
    sa.Column('priority', sa.Integer(), server_default='0', nullable=False),
    sa.Column('gpus', sa.Integer(), nullable=False),
    sa.Column('gpu_ids_json', sa.String(), nullable=True),
    sa.Column('mem_per_gpu', sa.BigInteger(), nullable=True),
    sa.Column('time_limit_s', sa.Float(), nullable=True),
    sa.Column('begin_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('dependencies_json', sa.String(), server_default='[]', nullable=False),
    sa.Column('held', sa.Boolean(), nullable=False),
    sa.Column('requeue_on_failure', sa.Boolean(), nullable=False),
    sa.Column('requeue_count', sa.Integer(), server_default='0', nullable=False),
    sa.Column('workdir', sa.String(), nullable=False),
    sa.Column('env_json', sa.String(), server_default='{}', nullable=False),
    sa.Column('stdout_pattern', sa.String(), nullable=True),
    sa.Column('stderr_pattern', sa.String(), nullable=True),
    sa.Column('stdout_path', sa.String(), nullable=True),
    sa.Column('stderr_path', sa.String(), nullable=True),
    sa.Column('devices_json', sa.String(), nullable=True),
    sa.Column('port', sa.Integer(), nullable=True),
    sa.Column('supervisor_pid', sa.Integer(), nullable=True),
    sa.Column('supervisor_start_ticks', sa.BigInteger(), nullable=True),
    sa.Column('pid', sa.Integer(), nullable=True),
    sa.Column('pgid', sa.Integer(), nullable=True),
    sa.Column('proc_start_ticks', sa.BigInteger(), nullable=True),
    sa.Column('cancel_requested', sa.Boolean(), nullable=False),
    sa.Column('exit_code', sa.Integer(), nullable=True),
    sa.Column('signal', sa.Integer(), nullable=True),
    sa.Column('submitted_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs'))
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_jobs_state'), ['state'], unique=False)
        batch_op.create_index('uq_jobs_running_port', ['port'], unique=True, sqlite_where=sa.text("state = 'RUNNING'"), postgresql_where=sa.text("state = 'RUNNING'"))

    op.create_table('allocations',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('device_uuid', sa.String(), nullable=False),
    sa.Column('allocated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('released_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_allocations_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_allocations'))
    )
    with op.batch_alter_table('allocations', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_allocations_job_id'), ['job_id'], unique=False)
        batch_op.create_index('uq_allocations_active_device', ['device_uuid'], unique=True, sqlite_where=sa.text('released_at IS NULL'), postgresql_where=sa.text('released_at IS NULL'))



def downgrade() -> None:
    with op.batch_alter_table('allocations', schema=None) as batch_op:
        batch_op.drop_index('uq_allocations_active_device', sqlite_where=sa.text('released_at IS NULL'), postgresql_where=sa.text('released_at IS NULL'))
        batch_op.drop_index(batch_op.f('ix_allocations_job_id'))

    op.drop_table('allocations')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('uq_jobs_running_port', sqlite_where=sa.text("state = 'RUNNING'"), postgresql_where=sa.text("state = 'RUNNING'"))
        batch_op.drop_index(batch_op.f('ix_jobs_state'))

    op.drop_table('jobs')
    with op.batch_alter_table('gpu_samples', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_gpu_samples_job_id'))
        batch_op.drop_index('ix_gpu_samples_device_time')

    op.drop_table('gpu_samples')
    op.drop_table('devices')
