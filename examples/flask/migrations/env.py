"""Alembic environment of the example Flask shop (online mode only)."""

import os
import sys
from logging.config import fileConfig
from pathlib import Path

from alembic import context
from sqlalchemy import create_engine, pool

from outbox.contrib.alembic import include_name

config = context.config
if config.config_file_name is not None:
    fileConfig(config.config_file_name)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from models import Base  # noqa: E402 - the shop's models, found on the path just set

url = os.environ.get("DATABASE_URL") or config.get_main_option("sqlalchemy.url")
connectable = create_engine(url, poolclass=pool.NullPool)
with connectable.connect() as connection:
    # include_name: autogenerate leaves the relay's tables alone, which are not in the
    # models' MetaData and would otherwise be dropped (docs/flask.md, "Autogenerate").
    context.configure(connection=connection, target_metadata=Base.metadata, include_name=include_name)
    with context.begin_transaction():
        context.run_migrations()
