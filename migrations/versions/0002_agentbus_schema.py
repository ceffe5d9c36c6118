"""agentbus schema: paused state, leases and fencing, event log, cooldowns, workers.

Upgrades bus_commands in place (SQLite: batch move-and-copy; every row keeps
its id, status, text and any column of its own) and creates the other tables.
An ops_todos or model_cooldown of the older system is kept aside as
legacy_<name>, its rows copied into agentbus's table (``agentbus.migrations.adoption``).
Claimed rows of the older system carry no lease: they get one that has
already expired, so the sweeper re-queues them (at-least-once, never lost).
Downgrade returns to the older shape: paused tasks go back to queued, and the
tables that were found are put back as they were.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from alembic import op

from agentbus.migrations import adoption

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Epoch = sa.Float(precision=53).with_variant(sa.REAL(), "sqlite")
STATUS_CHECK = "status IN ('queued', 'claimed', 'done', 'paused', 'failed', 'error')"
LEGACY_CHECK = "status IN ('queued','claimed','done','failed','error')"
PAUSED_INDEX_WHERE = "status = 'paused'"
_EPOCH_COLUMNS = {"created_at", "updated_at"}


def _new_task_columns() -> list[sa.Column[object]]:
    return [
        sa.Column("payload", sa.JSON),
        sa.Column("models", sa.JSON),
        sa.Column("role", sa.Text),
        sa.Column("priority", sa.Integer, nullable=False, server_default="0"),
        sa.Column("run_after", Epoch, nullable=False, server_default="0"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("max_attempts", sa.Integer, nullable=False, server_default="3"),
        sa.Column("claim_token", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("claimed_by", sa.Text),
        sa.Column("claimed_at", Epoch),
        sa.Column("lease_until", Epoch),
        sa.Column("resume_after", Epoch),
        sa.Column("first_paused_at", Epoch),
        sa.Column("pause_reason", sa.Text),
        sa.Column("pause_model", sa.Text),
        sa.Column("pause_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("resume_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("reentry_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("rescue_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("idempotency_key", sa.Text),
        sa.Column("result", sa.Text),
        sa.Column("result_note", sa.Text),
        sa.Column("last_error", sa.Text),
        sa.Column("created_at", Epoch),
        sa.Column("updated_at", Epoch),
    ]


def _columns(table: str) -> set[str]:
    return {c["name"] for c in sa.inspect(op.get_bind()).get_columns(table)}


def _status_checks() -> list[str]:
    """Names of the CHECK constraints on bus_commands.status (unnamed ones go by themselves)."""
    checks = sa.inspect(op.get_bind()).get_check_constraints("bus_commands")
    return [c["name"] for c in checks if c.get("name") and "status" in (c.get("sqltext") or "")]


def _sqlite_sequence() -> int | None:
    bind = op.get_bind()
    has_seq = bind.execute(
        sa.text("SELECT 1 FROM sqlite_master WHERE name = 'sqlite_sequence'")
    ).first()
    if not has_seq:
        return None
    return bind.execute(
        sa.text("SELECT seq FROM sqlite_sequence WHERE name = 'bus_commands'")
    ).scalar()


def _restore_sqlite_sequence(seq: int | None) -> None:
    # Ids are never reused: keep the AUTOINCREMENT high-water mark of the old table.
    if seq is not None:
        op.execute(
            sa.text(
                "UPDATE sqlite_sequence SET seq = max(seq, :seq) WHERE name = 'bus_commands'"
            ).bindparams(seq=seq)
        )


def _upgrade_bus_commands() -> None:
    dialect = op.get_bind().dialect.name
    have = _columns("bus_commands")
    missing = [c for c in _new_task_columns() if c.name not in have]
    if op.get_bind().execute(sa.text("SELECT 1 FROM bus_commands LIMIT 1")).first():
        adoption.record_bus_commands([c.name for c in missing])
    if dialect == "sqlite":
        seq = _sqlite_sequence()
        with op.batch_alter_table(
            "bus_commands",
            recreate="always",
            table_args=(sa.CheckConstraint(STATUS_CHECK, name="ck_bus_commands_status"),),
            table_kwargs={"sqlite_autoincrement": True},
        ) as batch:
            for name in _status_checks():
                batch.drop_constraint(name, type_="check")
            for column in missing:
                batch.add_column(column)
            batch.create_unique_constraint("uq_bus_commands_idempotency_key", ["idempotency_key"])
        _restore_sqlite_sequence(seq)
    else:
        for name in _status_checks():
            op.drop_constraint(name, "bus_commands", type_="check")
        for column in missing:
            op.add_column("bus_commands", column)
        for column in sa.inspect(op.get_bind()).get_columns("bus_commands"):
            # Epoch seconds need 8-byte floats (a 4-byte REAL rounds them to minutes).
            if column["name"] in _EPOCH_COLUMNS and isinstance(column["type"], sa.REAL):
                op.alter_column("bus_commands", column["name"], type_=Epoch)
        op.create_check_constraint("ck_bus_commands_status", "bus_commands", STATUS_CHECK)
        op.create_unique_constraint(
            "uq_bus_commands_idempotency_key", "bus_commands", ["idempotency_key"]
        )
    op.execute(
        sa.text(
            "UPDATE bus_commands SET lease_until = :now "
            "WHERE status = 'claimed' AND lease_until IS NULL"
        ).bindparams(now=time.time())
    )
    op.create_index(
        "ix_bus_commands_claim",
        "bus_commands",
        ["agent", sa.text("priority DESC"), "id"],
        sqlite_where=sa.text("status = 'queued'"),
        postgresql_where=sa.text("status = 'queued'"),
    )
    op.create_index(
        "ix_bus_commands_paused_due",
        "bus_commands",
        ["resume_after"],
        sqlite_where=sa.text(PAUSED_INDEX_WHERE),
        postgresql_where=sa.text(PAUSED_INDEX_WHERE),
    )
    op.create_index(
        "ix_bus_commands_lease",
        "bus_commands",
        ["lease_until"],
        sqlite_where=sa.text("status = 'claimed'"),
        postgresql_where=sa.text("status = 'claimed'"),
    )


def _create_model_cooldown() -> None:
    op.create_table(
        "model_cooldown",
        sa.Column("model_id", sa.Text, primary_key=True),
        sa.Column("cooldown_until", Epoch, nullable=False),
        sa.Column("updated_at", Epoch, nullable=False),
        sa.Column("reason", sa.Text),
        sa.Column("source", sa.Text),
    )


def _create_ops_todos() -> None:
    op.create_table(
        "ops_todos",
        sa.Column("id", BigId, primary_key=True),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("task_id", sa.BigInteger),
        sa.Column("agent", sa.Text),
        sa.Column("why", sa.Text, nullable=False),
        sa.Column("created_at", Epoch, nullable=False),
        sa.Column("resolved_at", Epoch),
        sa.UniqueConstraint("kind", "task_id", name="uq_ops_todos_kind_task"),
        sqlite_autoincrement=True,
    )


def upgrade() -> None:
    adoption.create_record_table()
    _upgrade_bus_commands()
    op.create_table(
        "task_events",
        sa.Column("id", BigId, primary_key=True),
        sa.Column("task_id", sa.BigInteger, nullable=False),
        sa.Column("from_status", sa.Text),
        sa.Column("to_status", sa.Text, nullable=False),
        sa.Column("reason", sa.Text),
        sa.Column("worker", sa.Text),
        sa.Column("claim_token", sa.BigInteger),
        sa.Column("at", Epoch, nullable=False),
        sa.Column("detail", sa.JSON),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_task_events_task", "task_events", ["task_id", "id"])
    op.create_index("ix_task_events_at", "task_events", ["at"])
    adoption.create_or_adopt("model_cooldown", _create_model_cooldown)
    adoption.create_or_adopt("ops_todos", _create_ops_todos)
    op.create_table(
        "workers",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("agent", sa.Text, nullable=False),
        sa.Column("host", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("started_at", Epoch, nullable=False),
        sa.Column("heartbeat_at", Epoch, nullable=False),
        sa.Column("consecutive_failures", sa.Integer, nullable=False, server_default="0"),
        sa.Column("backoff_until", Epoch),
        sa.Column("current_task", sa.BigInteger),
    )


def downgrade() -> None:
    op.drop_table("workers")
    adoption.restore("ops_todos")
    adoption.restore("model_cooldown")
    op.drop_table("task_events")
    for index in ("ix_bus_commands_lease", "ix_bus_commands_paused_due", "ix_bus_commands_claim"):
        op.drop_index(index, table_name="bus_commands")
    # The older system knows no paused state: hand those tasks back to the queue.
    op.execute("UPDATE bus_commands SET status = 'queued' WHERE status = 'paused'")
    added = adoption.columns_added("bus_commands")
    legacy = {"result_note", "created_at", "updated_at"}
    dropped = [
        c.name
        for c in _new_task_columns()
        if (c.name in added if added is not None else c.name not in legacy)
    ]
    if op.get_bind().dialect.name == "sqlite":
        seq = _sqlite_sequence()
        with op.batch_alter_table(
            "bus_commands",
            recreate="always",
            table_args=(sa.CheckConstraint(LEGACY_CHECK),),
            table_kwargs={"sqlite_autoincrement": True},
        ) as batch:
            batch.drop_constraint("uq_bus_commands_idempotency_key", type_="unique")
            batch.drop_constraint("ck_bus_commands_status", type_="check")
            for name in dropped:
                batch.drop_column(name)
        _restore_sqlite_sequence(seq)
    else:
        op.drop_constraint("uq_bus_commands_idempotency_key", "bus_commands", type_="unique")
        op.drop_constraint("ck_bus_commands_status", "bus_commands", type_="check")
        for name in dropped:
            op.drop_column("bus_commands", name)
        op.create_check_constraint("ck_bus_commands_status", "bus_commands", LEGACY_CHECK)
    op.drop_table("adopted_tables")
