"""Jobs handed to a real SLURM cluster (submit --cluster slurm): ours, with their last known state.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 16:04:54.166139
"""

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('cluster_jobs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('cluster', sa.String(), nullable=False),
    sa.Column('cluster_job_id', sa.String(), nullable=False),
    sa.Column('name', sa.String(), nullable=False),
    sa.Column('user', sa.String(), nullable=False),
    sa.Column('kind', sa.String(), nullable=False),
    sa.Column('workdir', sa.String(), nullable=False),
    sa.Column('script_path', sa.String(), nullable=False),
    sa.Column('train_config_json', sa.String(), nullable=True),
    sa.Column('state', sa.String(), nullable=False),
    sa.Column('exit_code', sa.Integer(), nullable=True),
    sa.Column('signal', sa.Integer(), nullable=True),
    sa.Column('submitted_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_cluster_jobs')),
    sa.UniqueConstraint('cluster', 'cluster_job_id', name=op.f('uq_cluster_jobs_cluster_cluster_job_id'))
    )


def downgrade() -> None:
    op.drop_table('cluster_jobs')
