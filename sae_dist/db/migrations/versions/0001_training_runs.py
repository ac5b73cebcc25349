"""Training runs, their step metrics and per-rank stats.

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-22 03:40:05.537413
"""

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('training_runs',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('name', sa.String(), nullable=False),
        sa.Column('status', sa.String(), nullable=False),
        sa.Column('architecture', sa.String(), nullable=False),
        sa.Column('config_json', sa.String(), nullable=False),
        sa.Column('world_size', sa.Integer(), nullable=False),
        sa.Column('backend', sa.String(), nullable=False),
        sa.Column('device_ids', sa.String(), nullable=False),
        sa.Column('host', sa.String(), nullable=False),
        sa.Column('run_dir', sa.String(), nullable=False),
        sa.Column('export_dir', sa.String(), nullable=True),
        sa.Column('total_steps', sa.Integer(), nullable=False),
        sa.Column('last_step', sa.Integer(), server_default='0', nullable=False),
        sa.Column('job_id', sa.Integer(), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('error', sa.String(), nullable=True),
        sa.Column('final_loss', sa.Float(), nullable=True),
        sa.Column('final_mse', sa.Float(), nullable=True),
        sa.Column('final_fvu', sa.Float(), nullable=True),
        sa.Column('final_l0', sa.Float(), nullable=True),
        sa.Column('final_dead_fraction', sa.Float(), nullable=True),
        sa.Column('final_samples_per_s', sa.Float(), nullable=True),
        sa.Column('recovery_mean_cos', sa.Float(), nullable=True),
        sa.Column('recovery_frac', sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_training_runs'))
    )
    op.create_index(op.f('ix_training_runs_run_dir'), 'training_runs', ['run_dir'], unique=False)
    op.create_table('rank_stats',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('device', sa.String(), nullable=False),
        sa.Column('step_time_s', sa.Float(), nullable=False),
        sa.Column('compute_time_s', sa.Float(), nullable=False),
        sa.Column('peak_memory_bytes', sa.BigInteger(), nullable=True),
        sa.Column('is_straggler', sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(['run_id'], ['training_runs.id'], name=op.f('fk_rank_stats_run_id_training_runs'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_rank_stats')),
        sa.UniqueConstraint('run_id', 'step', 'rank', name=op.f('uq_rank_stats_run_id_step_rank'))
    )
    op.create_table('step_metrics',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('samples_seen', sa.BigInteger(), nullable=False),
        sa.Column('time', sa.DateTime(timezone=True), nullable=False),
        sa.Column('loss', sa.Float(), nullable=True),
        sa.Column('mse', sa.Float(), nullable=True),
        sa.Column('fvu', sa.Float(), nullable=True),
        sa.Column('explained_variance', sa.Float(), nullable=True),
        sa.Column('l0', sa.Float(), nullable=True),
        sa.Column('dead_fraction', sa.Float(), nullable=True),
        sa.Column('auxk_loss', sa.Float(), nullable=True),
        sa.Column('lr', sa.Float(), nullable=True),
        sa.Column('grad_norm', sa.Float(), nullable=True),
        sa.Column('samples_per_s', sa.Float(), nullable=True),
        sa.Column('straggler_rank', sa.Integer(), nullable=True),
        sa.Column('recovery_mean_cos', sa.Float(), nullable=True),
        sa.Column('recovery_frac', sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(['run_id'], ['training_runs.id'], name=op.f('fk_step_metrics_run_id_training_runs'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_step_metrics')),
        sa.UniqueConstraint('run_id', 'step', name=op.f('uq_step_metrics_run_id_step'))
    )


def downgrade() -> None:
    op.drop_table('step_metrics')
    op.drop_table('rank_stats')
    op.drop_index(op.f('ix_training_runs_run_dir'), table_name='training_runs')
    op.drop_table('training_runs')
