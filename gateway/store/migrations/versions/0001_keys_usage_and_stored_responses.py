"""keys, usage and stored responses

Revision ID: 0001
Revises:
Create Date: 2026-12-04 03:01:44.747419
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('api_keys',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('secret_hash', sa.String(length=64), nullable=False),
    sa.Column('secret_hint', sa.String(length=16), nullable=False),
    sa.Column('previous_hash', sa.String(length=64), nullable=True),
    sa.Column('previous_expires_at', sa.Float(precision=53), nullable=True),
    sa.Column('models', sa.JSON(), nullable=False),
    sa.Column('rpm', sa.Integer(), nullable=True),
    sa.Column('tpm', sa.Integer(), nullable=True),
    sa.Column('max_tokens_per_day', sa.BigInteger(), nullable=True),
    sa.Column('max_tokens_per_month', sa.BigInteger(), nullable=True),
    sa.Column('expires_at', sa.Float(precision=53), nullable=True),
    sa.Column('metadata', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.Float(precision=53), nullable=False),
    sa.Column('updated_at', sa.Float(precision=53), nullable=False),
    sa.Column('revoked_at', sa.Float(precision=53), nullable=True),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('secret_hash')
    )
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_keys_name'), ['name'], unique=False)

    op.create_table('responses',
    sa.Column('id', sa.String(length=100), nullable=False),
    sa.Column('owner', sa.String(length=200), nullable=True),
    sa.Column('created_at', sa.Float(precision=53), nullable=False),
    sa.Column('expires_at', sa.Float(precision=53), nullable=False),
    sa.Column('body', sa.LargeBinary(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('responses', schema=None) as batch_op:
        batch_op.create_index('ix_responses_expires_at', ['expires_at'], unique=False)

    op.create_table('usage',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('at', sa.Float(precision=53), nullable=False),
    sa.Column('day', sa.String(length=10), nullable=False),
    sa.Column('request_id', sa.String(length=128), nullable=False),
    sa.Column('key_name', sa.String(length=200), nullable=True),
    sa.Column('model', sa.String(length=200), nullable=True),
    sa.Column('backend', sa.String(length=200), nullable=True),
    sa.Column('route', sa.String(length=100), nullable=False),
    sa.Column('door', sa.String(length=20), nullable=False),
    sa.Column('prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('completion_tokens', sa.Integer(), nullable=False),
    sa.Column('cached_tokens', sa.Integer(), nullable=False),
    sa.Column('ttft_ms', sa.Float(), nullable=True),
    sa.Column('duration_ms', sa.Float(), nullable=False),
    sa.Column('status', sa.Integer(), nullable=False),
    sa.Column('finish_reason', sa.String(length=40), nullable=True),
    sa.Column('prompt_text', sa.Text(), nullable=True),
    sa.Column('output_text', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('usage', schema=None) as batch_op:
        batch_op.create_index('ix_usage_at', ['at'], unique=False)
        batch_op.create_index('ix_usage_key_day', ['key_name', 'day'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('usage', schema=None) as batch_op:
        batch_op.drop_index('ix_usage_key_day')
        batch_op.drop_index('ix_usage_at')

    op.drop_table('usage')
    with op.batch_alter_table('responses', schema=None) as batch_op:
        batch_op.drop_index('ix_responses_expires_at')

    op.drop_table('responses')
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_keys_name'))

    op.drop_table('api_keys')
