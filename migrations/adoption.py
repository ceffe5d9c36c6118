"""Adopting the older system's tables: what was found is kept, and put back on downgrade.

``bus_commands`` is upgraded in place (revision 0002). ``ops_todos`` and
``model_cooldown`` may come in any shape — extra columns, NOT NULL columns
without defaults, no key, duplicate rows — so a table found under either name
is set aside untouched as ``legacy_<name>``, agentbus creates its own, and the
rows that fit are copied into it:

- ``ops_todos``: kind, task_id, agent, why, created_at and resolved_at by name
  (a missing kind reads ``legacy``; a missing why is the row's other columns
  as text). Rows that repeat a (kind, task_id) are copied once, the first in
  the legacy table's key order; every row stays in ``legacy_ops_todos``.
- ``model_cooldown``: one row per model_id with its latest cooldown_until
  (a cooldown is never shortened); rows without a model or a readable time
  are left out of the copy only.

Every adoption is a row of ``adopted_tables``: the table found, where its rows
are kept, how many there were, and for ``bus_commands`` the highest task id
that was there (retention leaves those tasks alone unless told otherwise).
Downgrading drops agentbus's table and renames the legacy one back, so the
older system finds its tables exactly as they were.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from alembic import op

Epoch = sa.Float(precision=53).with_variant(sa.REAL(), "sqlite")
PREFIX = "legacy_"
TODO_COLUMNS = ("kind", "task_id", "agent", "why", "created_at", "resolved_at")


def create_record_table() -> None:
    op.create_table(
        "adopted_tables",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("kept_as", sa.Text),
        sa.Column("found_rows", sa.BigInteger, nullable=False),
        sa.Column("max_id", sa.BigInteger),
        sa.Column("columns_added", sa.JSON),
        sa.Column("adopted_at", Epoch, nullable=False),
    )


RECORDS = sa.table(
    "adopted_tables",
    sa.column("name"),
    sa.column("kept_as"),
    sa.column("found_rows"),
    sa.column("max_id"),
    sa.column("columns_added", sa.JSON),
    sa.column("adopted_at"),
)


def _record(
    name: str, kept_as: str | None, rows: int, max_id: int | None, added: list[str] | None
) -> None:
    op.bulk_insert(
        RECORDS,
        [
            {
                "name": name,
                "kept_as": kept_as,
                "found_rows": rows,
                "max_id": max_id,
                "columns_added": added,
                "adopted_at": time.time(),
            }
        ],
    )


def _recorded(name: str) -> Any:
    query = sa.select(RECORDS).where(RECORDS.c.name == name)
    return op.get_bind().execute(query).first()


def _count(table: str) -> int:
    return int(op.get_bind().execute(sa.text(f"SELECT COUNT(*) FROM {table}")).scalar() or 0)


def record_bus_commands(added: list[str]) -> None:
    """Note the older system's tasks and the columns agentbus adds to their table."""
    top = op.get_bind().execute(sa.text("SELECT MAX(id) FROM bus_commands")).scalar()
    _record("bus_commands", None, _count("bus_commands"), _int(top), added)


def columns_added(name: str) -> set[str] | None:
    """The columns agentbus added to an adopted table (None: agentbus created it)."""
    row = _recorded(name)
    return set(row.columns_added or ()) if row is not None else None


def create_or_adopt(name: str, create: Callable[[], None]) -> None:
    """Create agentbus's ``name``; a table found under that name is kept as legacy_<name>."""
    if not sa.inspect(op.get_bind()).has_table(name):
        create()
        return
    _set_aside(name, create)


def repair(
    name: str, create: Callable[[], None], key: list[str], views: Mapping[str, str] = {}
) -> None:
    """Set aside a ``name`` that an earlier release adopted in place, lacking the ``key``
    agentbus's upserts need (its rows, the columns added then included); ``views``
    (name -> body) read ``name`` and are made again over agentbus's table."""
    inspector = sa.inspect(op.get_bind())
    if not inspector.has_table(name) or inspector.has_table(PREFIX + name):
        return
    keys = [inspector.get_pk_constraint(name).get("constrained_columns") or []]
    keys += [u["column_names"] for u in inspector.get_unique_constraints(name)]
    keys += [i["column_names"] for i in inspector.get_indexes(name) if i.get("unique")]
    if any(list(k) == key for k in keys):
        return
    for view in views:
        op.execute(f"DROP VIEW {view}")
    _set_aside(name, create)
    for view, body in views.items():
        op.execute(f"CREATE VIEW {view} AS {body}")


def _set_aside(name: str, create: Callable[[], None]) -> None:
    kept = PREFIX + name
    op.rename_table(name, kept)
    _record(name, kept, _count(kept), None, None)
    create()
    rows = COPIES[name](_legacy_rows(kept), time.time())
    if rows:
        table = sa.table(name, *(sa.column(c) for c in rows[0]))
        op.bulk_insert(table, rows)


def restore(name: str) -> None:
    """Drop agentbus's ``name``; put back the table it was adopted from, if any."""
    op.drop_table(name)
    row = _recorded(name)
    if row is not None and row.kept_as is not None:
        op.rename_table(row.kept_as, name)


def _legacy_rows(name: str) -> list[dict[str, Any]]:
    bind = op.get_bind()
    table = sa.Table(name, sa.MetaData(), autoload_with=bind)
    order = list(table.primary_key.columns)
    return [dict(r) for r in bind.execute(sa.select(table).order_by(*order)).mappings()]


def todo_rows(found: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """The legacy todos in agentbus's shape, one per (kind, task_id)."""
    out: list[dict[str, Any]] = []
    seen: set[tuple[str, int]] = set()
    for row in found:
        kind = _text(row.get("kind")) or "legacy"
        task_id = _int(row.get("task_id"))
        if task_id is not None:
            if (kind, task_id) in seen:
                continue
            seen.add((kind, task_id))
        why = _text(row.get("why")) or _rest(row) or "(adopted from legacy_ops_todos)"
        out.append(
            {
                "kind": kind,
                "task_id": task_id,
                "agent": _text(row.get("agent")),
                "why": why,
                "created_at": _epoch(row.get("created_at")) or now,
                "resolved_at": _epoch(row.get("resolved_at")),
            }
        )
    return out


def cooldown_rows(found: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """The legacy cooldowns, one per model: the latest end of each."""
    best: dict[str, dict[str, Any]] = {}
    for row in found:
        model, until = _text(row.get("model_id")), _epoch(row.get("cooldown_until"))
        if model is None or until is None:
            continue
        if model in best and best[model]["cooldown_until"] >= until:
            continue
        best[model] = {
            "model_id": model,
            "cooldown_until": until,
            "updated_at": _epoch(row.get("updated_at")) or now,
            "reason": _text(row.get("reason")),
            "source": _text(row.get("source")) or "legacy",
        }
    return list(best.values())


COPIES: dict[str, Callable[[list[dict[str, Any]], float], list[dict[str, Any]]]] = {
    "ops_todos": todo_rows,
    "model_cooldown": cooldown_rows,
}


def _text(value: Any) -> str | None:
    if value is None:
        return None
    text = value if isinstance(value, str) else str(value)
    return text or None


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _epoch(value: Any) -> float | None:
    """Epoch seconds from a number, a numeric string, an ISO time (UTC if naive) or a
    datetime; None when the value says no time."""
    if isinstance(value, (int, float, Decimal)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            try:
                value = dt.datetime.fromisoformat(value.strip())
            except ValueError:
                return None
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return value.timestamp()
    return None


def _rest(row: Mapping[str, Any]) -> str:
    """A legacy row's other columns as text (its todo text when it has no ``why``)."""
    parts = [f"{k}={v}" for k, v in row.items() if k not in TODO_COLUMNS and v is not None]
    return "; ".join(parts)[:2000]
