"""Sweeps: one job training many SAEs from one activation stream. A `sweeps` row is the job's
training (its run directory, swept keys, placement); each SAE is an ordinary training run that
names its sweep (`sweep_id`) and its point (`sweep_point`, e.g. "k32-x16").

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-24 19:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'sweeps',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('name', sa.String(), nullable=False),
        sa.Column('status', sa.String(), nullable=False),
        sa.Column('run_dir', sa.String(), nullable=False),
        sa.Column('job_id', sa.Integer(), nullable=True),
        sa.Column('keys_json', sa.String(), nullable=False),
        sa.Column('config_json', sa.String(), nullable=False),
        sa.Column('placement_json', sa.String(), nullable=True),
        sa.Column('world_size', sa.Integer(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('error', sa.String(), nullable=True),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_sweeps')),
    )
    op.create_index(op.f('ix_sweeps_run_dir'), 'sweeps', ['run_dir'], unique=False)
    op.add_column('training_runs', sa.Column('sweep_id', sa.Integer(), nullable=True))
    op.add_column('training_runs', sa.Column('sweep_point', sa.String(), nullable=True))
    op.create_index(op.f('ix_training_runs_sweep_id'), 'training_runs', ['sweep_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_training_runs_sweep_id'), table_name='training_runs')
    for column in ('sweep_point', 'sweep_id'):
        op.execute(f'ALTER TABLE training_runs DROP COLUMN {column}')
    op.drop_index(op.f('ix_sweeps_run_dir'), table_name='sweeps')
    op.drop_table('sweeps')
