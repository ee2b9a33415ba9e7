"""staged rollouts: state, decisions, per-replica windows, leader lease

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-04 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

Timestamp = sa.Float(precision=53)


def upgrade() -> None:
    op.create_table('rollouts',
                    sa.Column('model', sa.String(200), primary_key=True),
                    sa.Column('version', sa.Integer(), nullable=False),
                    sa.Column('doc', sa.JSON(), nullable=False),
                    sa.Column('updated_at', Timestamp, nullable=False))
    op.create_table('rollout_decisions',
                    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), primary_key=True,
                              autoincrement=True),
                    sa.Column('model', sa.String(200), nullable=False),
                    sa.Column('at', Timestamp, nullable=False),
                    sa.Column('doc', sa.JSON(), nullable=False))
    op.create_index('ix_rollout_decisions_model', 'rollout_decisions', ['model'])
    op.create_table('rollout_windows',
                    sa.Column('model', sa.String(200), primary_key=True),
                    sa.Column('replica', sa.String(200), primary_key=True),
                    sa.Column('epoch', sa.Integer(), nullable=False),
                    sa.Column('doc', sa.JSON(), nullable=False),
                    sa.Column('updated_at', Timestamp, nullable=False))
    op.create_table('leases',
                    sa.Column('name', sa.String(100), primary_key=True),
                    sa.Column('holder', sa.String(200), nullable=False),
                    sa.Column('expires_at', Timestamp, nullable=False))


def downgrade() -> None:
    op.drop_table('leases')
    op.drop_table('rollout_windows')
    op.drop_index('ix_rollout_decisions_model', 'rollout_decisions')
    op.drop_table('rollout_decisions')
    op.drop_table('rollouts')
