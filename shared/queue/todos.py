"""``ops_todos``: work for a person (a demoted task to look at), one row per (kind, task).

Rows are added in the transaction of the change that calls for them, with
ON CONFLICT DO NOTHING on (kind, task_id): two sweepers never file one twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Connection

from agentbus.db import dialect_insert
from agentbus.schema import ops_todos


def add(conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
    """Insert todos (kind, task_id, agent, why, created_at); existing ones stay as they are."""
    if not rows:
        return
    insert = dialect_insert(conn.dialect.name)
    conn.execute(
        insert(ops_todos).on_conflict_do_nothing(index_elements=["kind", "task_id"]), list(rows)
    )
