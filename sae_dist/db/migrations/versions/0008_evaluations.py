"""SAE evaluations: an SAE's reconstruction, sparsity and planted recovery on rows of
activations, linked to its training run when it is one's export.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24 04:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('evaluations',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('sae_path', sa.String(), nullable=False),
    sa.Column('data_path', sa.String(), nullable=False),
    sa.Column('rows', sa.BigInteger(), nullable=False),
    sa.Column('fvu', sa.Float(), nullable=True),
    sa.Column('explained_variance', sa.Float(), nullable=True),
    sa.Column('mse', sa.Float(), nullable=True),
    sa.Column('cosine', sa.Float(), nullable=True),
    sa.Column('l0', sa.Float(), nullable=True),
    sa.Column('dead_fraction', sa.Float(), nullable=True),
    sa.Column('dense_fraction', sa.Float(), nullable=True),
    sa.Column('density_json', sa.String(), nullable=False),
    sa.Column('recovery_json', sa.String(), nullable=True),
    sa.Column('model_check_json', sa.String(), nullable=True),
    sa.Column('origin', sa.String(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['training_runs.id'], name=op.f('fk_evaluations_run_id_training_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_evaluations'))
    )
    with op.batch_alter_table('evaluations', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_evaluations_run_id'), ['run_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('evaluations', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_evaluations_run_id'))

    op.drop_table('evaluations')
