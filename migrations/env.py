"""Alembic environment: runs migrations on an agentbus Database.

``busctl migrate`` hands its Database in ``config.attributes``; plain
``alembic upgrade head`` builds one from ``$AGENTBUS_DATABASE_URL`` (default
``sqlite:///ops_multiagent.db``). SQLite uses batch mode (move and copy).
"""

from __future__ import annotations

import os
from logging.config import fileConfig

import sqlalchemy as sa
from alembic import context

from agentbus.db import Database
from agentbus.schema import metadata
from agentbus.settings import DEFAULT_DATABASE_URL

MIGRATION_LOCK = 0x6D696772617465  # "migrate"
config = context.config
if config.config_file_name is not None and "database" not in config.attributes:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def run_migrations_online() -> None:
    db = config.attributes.get("database")
    owned = db is None
    if db is None:
        db = Database(os.environ.get("AGENTBUS_DATABASE_URL") or DEFAULT_DATABASE_URL)
    try:
        with db.engine.begin() as connection:
            if db.dialect == "postgresql":
                # Processes migrating at once take turns: the later ones find the
                # schema at head and have nothing to do. (SQLite: BEGIN IMMEDIATE.)
                connection.execute(sa.select(sa.func.pg_advisory_xact_lock(MIGRATION_LOCK)))
            context.configure(
                connection=connection,
                target_metadata=metadata,
                render_as_batch=db.dialect == "sqlite",
                compare_type=True,
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        if owned:
            db.dispose()


if context.is_offline_mode():
    raise SystemExit("agentbus migrations run online only: use `busctl migrate`")
run_migrations_online()
