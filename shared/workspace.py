"""Workspace settings: values every process of a workspace (a database) shares,
rows of ``workspace_settings`` written by ``busctl`` and read by everyone.

A value is JSON; a name not set reads as absent (the caller's default).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.db import dialect_insert
from agentbus.schema import workspace_settings as ws


@dataclass(frozen=True)
class Setting:
    value: Any
    updated_at: float
    updated_by: str | None


def read(conn: Connection, names: Iterable[str]) -> dict[str, Setting]:
    """The settings of ``names`` that are set."""
    rows = conn.execute(sa.select(ws).where(ws.c.name.in_(list(names))))
    return {r.name: Setting(r.value, r.updated_at, r.updated_by) for r in rows}


def write(conn: Connection, values: Mapping[str, Any], now: float, by: str | None) -> None:
    """Set each name to its value (in the caller's transaction)."""
    insert = dialect_insert(conn.dialect.name)(ws)
    upsert = insert.on_conflict_do_update(
        index_elements=[ws.c.name],
        set_={
            "value": insert.excluded.value,
            "updated_at": insert.excluded.updated_at,
            "updated_by": insert.excluded.updated_by,
        },
    )
    rows = [
        {"name": name, "value": value, "updated_at": now, "updated_by": by}
        for name, value in values.items()
    ]
    conn.execute(upsert, rows)
