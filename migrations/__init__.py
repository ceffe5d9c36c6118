"""Alembic migrations, shipped as a package so that ``busctl migrate`` finds them, and
the functions that run them (Alembic is loaded only when one is called)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentbus.db import Database

#: The newest revision. Processes compare the database with it at start without
#: loading Alembic; a test checks that it is Alembic's head.
HEAD = "0030"


def migrations_dir() -> Path:
    return Path(str(resources.files("agentbus.migrations")))


def alembic_config(db: Database | None = None) -> Any:
    """An Alembic Config for the shipped migrations (bound to ``db`` if given)."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if db is not None:
        cfg.attributes["database"] = db
    return cfg


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def migrate(db: Database, revision: str = "head") -> None:
    """Bring the schema to ``revision`` (adopting an older bus_commands table)."""
    from alembic import command

    db.check_connection()
    command.upgrade(alembic_config(db), revision)


def downgrade(db: Database, revision: str) -> None:
    from alembic import command

    command.downgrade(alembic_config(db), revision)
