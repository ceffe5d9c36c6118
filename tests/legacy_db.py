"""Databases of the older system, built by hand: its bus_commands, and ops_todos and
model_cooldown in the shapes found in the field (keys or none, NOT NULL columns
without defaults, duplicate rows)."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from agentbus.db import Database

BUS_COMMANDS = """
CREATE TABLE bus_commands (
  id {serial} PRIMARY KEY{autoincrement},
  agent TEXT NOT NULL,
  command TEXT,
  status TEXT NOT NULL DEFAULT 'queued'
    CHECK (status IN ('queued','claimed','done','failed','error')),
  result_note TEXT,
  created_at REAL,
  updated_at REAL,
  origin TEXT DEFAULT 'orchestrator'
)"""
TASKS = [
    (1, "codex", "write the parser", "done", "ok", "orchestrator"),
    (2, "analyst-macro", "macro brief", "failed", "all candidate models are cooling down", "cron"),
    (3, "codex", "review PR", "claimed", None, "orchestrator"),
    (4, "ron", "summarise", "queued", None, "slack"),
    (7, "codex", "explode", "error", "Traceback …", None),
]
TASK_COLUMNS = ("id", "agent", "command", "status", "note", "origin")
CREATED_AT, UPDATED_AT = 1755400000.5, 1755400100.25


@dataclass(frozen=True)
class Variant:
    """One shape of the older ops_todos and model_cooldown: DDL ({serial} is the
    backend's auto-increment integer, {real} an 8-byte float: a Postgres REAL would
    round epoch seconds to minutes) and rows as SQL VALUES lists."""

    name: str
    todos_ddl: str
    todos: tuple[str, ...]
    cooldown_ddl: str | None = None
    cooldowns: tuple[str, ...] = ()


VARIANTS = [
    Variant(
        # The older system's own: a key, a NOT NULL note without a default, and the
        # same (kind, task) filed twice; model_cooldown in the shape of the first rollout.
        "keyed",
        "CREATE TABLE ops_todos (id {serial} PRIMARY KEY, kind TEXT NOT NULL,"
        " task_id INTEGER, note TEXT NOT NULL, owner TEXT, created_at {real})",
        (
            "(1, 'demoted', 2, 'paused too long', 'ops', 1755400200)",
            "(2, 'demoted', 2, 'paused too long (again)', 'ops', 1755400300)",
            "(3, 'review', 7, 'crashed', NULL, 1755400400)",
        ),
        "CREATE TABLE model_cooldown (model_id TEXT PRIMARY KEY, cooldown_until {real},"
        " updated_at {real})",
        ("('sim/a', 1755400500, 1755400400)", "('sim/b', 2000000000, 1755400400)"),
    ),
    Variant(
        # No key at all, ISO times, duplicates in both tables, a NOT NULL extra column.
        "unkeyed",
        "CREATE TABLE ops_todos (kind TEXT, task_id INTEGER, why TEXT,"
        " created_at TEXT, assignee TEXT NOT NULL)",
        (
            "('demoted', 4, 'stuck', '2025-08-17T03:00:00', 'kim')",
            "('demoted', 4, 'stuck', '2025-08-17T03:00:00', 'kim')",
            "('demoted', NULL, 'no task', NULL, 'lee')",
            "('demoted', NULL, 'no task', NULL, 'lee')",
        ),
        "CREATE TABLE model_cooldown (model_id TEXT NOT NULL, cooldown_until {real} NOT NULL,"
        " updated_at {real} NOT NULL, note TEXT NOT NULL)",
        (
            "('sim/a', 1755400500, 1755400400, 'first 429')",
            "('sim/a', 1900000000, 1755400450, 'second 429')",
            "('sim/a', 1755400600, 1755400460, 'stale write')",
        ),
    ),
    Variant(
        # Another tool's todo list under the same name; no model_cooldown.
        "foreign",
        "CREATE TABLE ops_todos (todo_id {serial} PRIMARY KEY, title TEXT NOT NULL,"
        " priority INTEGER NOT NULL, done BOOLEAN NOT NULL)",
        ("(10, 'rotate the keys', 1, FALSE)", "(11, 'rotate the keys', 1, FALSE)"),
    ),
]
LEGACY_TABLES = ("ops_todos", "model_cooldown")


def _ddl(db: Database, text: str) -> str:
    if db.dialect == "sqlite":
        return text.format(serial="INTEGER", autoincrement=" AUTOINCREMENT", real="REAL")
    return text.format(serial="SERIAL", autoincrement="", real="DOUBLE PRECISION")


def build(db: Database, variant: Variant | None = None) -> None:
    """The older system's database: bus_commands with TASKS, and ``variant``'s tables."""
    with db.engine.begin() as conn:
        conn.exec_driver_sql(_ddl(db, BUS_COMMANDS))
        for row in TASKS:
            conn.execute(
                sa.text(
                    "INSERT INTO bus_commands (id, agent, command, status, result_note, origin,"
                    " created_at, updated_at) VALUES (:id, :agent, :command, :status, :note,"
                    " :origin, :created, :updated)"
                ),
                {
                    **dict(zip(TASK_COLUMNS, row, strict=True)),
                    "created": CREATED_AT,
                    "updated": UPDATED_AT,
                },
            )
        # The older system deleted its newest row: ids must still never be reused.
        conn.execute(
            sa.text("INSERT INTO bus_commands (id, agent, command) VALUES (9, 'codex', 'gone')")
        )
        conn.execute(sa.text("DELETE FROM bus_commands WHERE id = 9"))
        if db.dialect == "postgresql":
            conn.execute(sa.text("SELECT setval('bus_commands_id_seq', 9)"))
        if variant is None:
            return
        tables = [(variant.todos_ddl, "ops_todos", variant.todos)]
        if variant.cooldown_ddl is not None:
            tables.append((variant.cooldown_ddl, "model_cooldown", variant.cooldowns))
        for ddl, name, rows in tables:
            conn.exec_driver_sql(_ddl(db, ddl))
            for values in rows:
                conn.exec_driver_sql(f"INSERT INTO {name} VALUES {values}")


def snapshot(db: Database, table: str) -> list[tuple[object, ...]]:
    """Every row of ``table`` with every column, in a stable order."""
    with db.engine.connect() as conn:
        columns = [c["name"] for c in sa.inspect(conn).get_columns(table)]
        order = ", ".join(str(i + 1) for i in range(len(columns)))
        return [tuple(r) for r in conn.exec_driver_sql(f"SELECT * FROM {table} ORDER BY {order}")]
