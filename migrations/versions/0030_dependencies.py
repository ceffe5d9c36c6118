"""Dependencies: a task may wait for other tasks (``task_dependencies``, one row per task
it waits for, in the order given), and the trigger that makes it due when the last of
them ends.

A waiting task is ``queued`` with ``run_after`` at 9999-12-31 (``WAITING_DUE``): every
claim passes over it as a task not yet due, through the index it already reads, and the
claim statements stay as they are. ``after_policy`` ('all_done' or 'any_end') is set on
the tasks that wait (NULL on the others); ``awaited`` on the tasks some task waits for,
so that the trigger's condition, read from the changed row, costs the others nothing.

When an awaited task reaches an end, the trigger sets ``run_after`` of each of its
waiters whose dependencies have all ended as its policy asks (all done; or, for
'any_end', ended in any way) to the moment of that change, and (PostgreSQL) wakes their
agents' idle workers. Before it counts, it locks those waiters in the order of their
ids: of two transactions that end a waiter's last two dependencies at once, the second
then counts after the first has committed and sees both ended. A waiter whose
dependency failed is the sweeper's to cancel (``agentbus.queue.dependencies``): a
change of state writes its event, which a trigger cannot.

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
WAITING_DUE = "253402214400.0"
#: A state is tested by equalities, not ``IN (…)``: SQLite builds a table of such a list
#: at each run of a statement, here every change of state of every task (0018).
BAD_END = "({s}.status = 'failed' OR {s}.status = 'error' OR {s}.status = 'cancelled')"
#: The tasks that wait for others, while they do (the sweeper's and status's reads).
WAITING = f"after_policy IS NOT NULL AND status = 'queued' AND run_after = {WAITING_DUE}"
#: Waiters of the task ``{ended}`` whose every dependency has ended as their policy asks.
READY = (
    "id IN (SELECT task_id FROM task_dependencies WHERE after_id = {ended}) "
    f"AND status = 'queued' AND run_after = {WAITING_DUE} "
    "AND NOT EXISTS (SELECT 1 FROM task_dependencies e JOIN bus_commands d ON d.id = e.after_id "
    "WHERE e.task_id = bus_commands.id AND d.status <> 'done' AND NOT ("
    f"bus_commands.after_policy = 'any_end' AND {BAD_END.format(s='d')}))"
)
ENDS = f"(NEW.status = 'done' OR {BAD_END.format(s='NEW')})"
WHEN = f"NEW.awaited AND OLD.status <> NEW.status AND {ENDS}"


def upgrade() -> None:
    op.add_column("bus_commands", sa.Column("after_policy", sa.Text))
    op.add_column(
        "bus_commands", sa.Column("awaited", sa.Boolean, nullable=False, server_default=sa.false())
    )
    op.create_table(
        "task_dependencies",
        sa.Column("task_id", sa.BigInteger, primary_key=True),
        sa.Column("position", sa.Integer, primary_key=True),
        sa.Column("after_id", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_task_dependencies_after", "task_dependencies", ["after_id", "task_id"])
    op.create_index(
        "ix_bus_commands_waiting",
        "bus_commands",
        ["agent", "id"],
        sqlite_where=sa.text(WAITING),
        postgresql_where=sa.text(WAITING),
    )
    if op.get_bind().dialect.name == "postgresql":
        release = READY.format(ended="NEW.id")
        op.execute(
            "CREATE FUNCTION agentbus_release_waiters() RETURNS trigger LANGUAGE plpgsql AS $$ "
            "DECLARE waiter_agent text; BEGIN "
            "PERFORM 1 FROM bus_commands WHERE id IN "
            "(SELECT task_id FROM task_dependencies WHERE after_id = NEW.id) "
            f"AND status = 'queued' AND run_after = {WAITING_DUE} ORDER BY id FOR UPDATE; "
            "FOR waiter_agent IN UPDATE bus_commands SET run_after = NEW.updated_at "
            f"WHERE {release} RETURNING agent LOOP "
            "PERFORM pg_notify('agentbus_queued', waiter_agent); END LOOP; "
            "RETURN NULL; END $$"
        )
        op.execute(
            "CREATE TRIGGER release_waiters AFTER UPDATE OF status ON bus_commands "
            f"FOR EACH ROW WHEN ({WHEN}) EXECUTE FUNCTION agentbus_release_waiters()"
        )
    else:
        op.execute(
            "CREATE TRIGGER release_waiters AFTER UPDATE OF status ON bus_commands "
            f"WHEN {WHEN} BEGIN "
            "UPDATE bus_commands SET run_after = "
            "COALESCE(NEW.updated_at, CAST(strftime('%s', 'now') AS REAL)) "
            f"WHERE {READY.format(ended='NEW.id')}; END"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS release_waiters ON bus_commands")
        op.execute("DROP FUNCTION IF EXISTS agentbus_release_waiters()")
    else:
        op.execute("DROP TRIGGER IF EXISTS release_waiters")
    op.drop_index("ix_bus_commands_waiting", "bus_commands")
    op.drop_index("ix_task_dependencies_after", "task_dependencies")
    op.drop_table("task_dependencies")
    op.execute("ALTER TABLE bus_commands DROP COLUMN awaited")
    op.execute("ALTER TABLE bus_commands DROP COLUMN after_policy")
