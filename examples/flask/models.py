"""The example Flask shop's models, apart from the app: Alembic's autogenerate compares
their MetaData with the database (migrations/env.py) without starting the app."""

from __future__ import annotations

from sqlalchemy import Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    customer: Mapped[str] = mapped_column(String(100))
    total_cents: Mapped[int] = mapped_column(Integer)
