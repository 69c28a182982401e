"""orders, and the outbox table with the relay's own DDL

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

from outbox.contrib.alembic import create_outbox_table

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "orders",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("customer", sa.String(100), nullable=False),
        sa.Column("total_cents", sa.Integer, nullable=False),
    )
    create_outbox_table(op)


def downgrade() -> None:
    op.drop_table("orders")  # the outbox table stays: it may hold undelivered events
