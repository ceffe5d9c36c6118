"""The admission's transaction on the database: the gates' locks, a connection lost
mid-way, and the plans its counts run with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from agentbus.admission import slots
from agentbus.admission.admission import Permit
from agentbus.admission.limits import Limits
from agentbus.admission.routing import Candidate
from agentbus.admission.slots import LOCK_CLASS, lock_gates
from agentbus.db import Database
from agentbus.db.compiled import at_once, can_run_at_once, prepared
from agentbus.schema import bus_counters, call_slots
from tests.conftest import Backends
from tests.support import FakeClock
from tests.test_admission import admission, admit, candidate, config


def test_an_admission_whose_connection_was_dropped_is_made_once_on_a_new_one(
    backends: Backends, clock: FakeClock, tmp_path: Path
) -> None:
    """PostgreSQL (an admission there is one pipelined round trip): the server drops the
    connection a process keeps for its admissions; the next admission is retried on a
    new connection and takes exactly one slot."""
    url, name = backends.new("postgresql")
    db = Database(url)
    adm = admission(db, clock, config(tmp_path, rpm=5, concurrency=5))
    a = candidate(adm)
    first = admit(adm, a)
    assert isinstance(first, Permit)
    pids = db.read(
        lambda conn: (
            conn.execute(
                sa.text(
                    "SELECT pid FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            )
            .scalars()
            .all()
        )
    )
    killed = db.read(
        lambda conn: conn.execute(
            sa.text("SELECT count(pg_terminate_backend(pid)) FROM unnest(:pids) AS p(pid)"),
            {"pids": pids},
        ).scalar()
    )
    assert killed and killed >= 1
    second = admit(adm, a)
    assert isinstance(second, Permit) and second.slot_id != first.slot_id
    taken = db.read(lambda conn: conn.execute(sa.select(sa.func.count()).select_from(call_slots)))
    assert taken.scalar() == 2
    db.dispose()
    backends.drop(name)


def test_an_admission_locks_only_the_gates_it_counts(db: Database) -> None:
    """PostgreSQL: the gates' locks are keyed by gate, so admissions through other
    providers, accounts, bulkheads and agents do not wait (SQLite: one writer anyway)."""
    one = Limits(5, 3, ("heavy", 2), (10, 60.0), (50, 1.0), 0, 0.0)
    a = Candidate("sim/a", "sim", "acct", "a")
    assert one.lock_keys(a, "codex") == [
        "concurrency",
        "provider:sim",
        "bulkhead:heavy",
        "rpm:sim/acct",
        "agent:codex",
    ]
    assert Limits(0, None, None, None, None, 100, 1.0).lock_keys(a, "codex") == []  # budgets
    if db.dialect != "postgresql":
        with db.engine.begin() as conn:
            lock_gates(conn, ["rpm:sim/acct"])  # nothing to take
        return
    try_lock = sa.text("SELECT pg_try_advisory_xact_lock(:c, hashtext(:k))")
    with db.engine.begin() as holder, db.engine.begin() as other:
        lock_gates(holder, ["rpm:sim/acct", "agent:codex"])
        assert other.execute(try_lock, {"c": LOCK_CLASS, "k": "rpm:sim/other"}).scalar()
        assert other.execute(try_lock, {"c": LOCK_CLASS, "k": "agent:ron"}).scalar()
        assert not other.execute(try_lock, {"c": LOCK_CLASS, "k": "rpm:sim/acct"}).scalar()
        assert not other.execute(try_lock, {"c": LOCK_CLASS, "k": "agent:codex"}).scalar()


def test_counting_open_slots_plans_no_bitmap_scan(
    backends: Backends, clock: FakeClock, tmp_path: Path
) -> None:
    """PostgreSQL: a release leaves its slot's entry in the index of open slots until
    VACUUM. An admission's counts read that index entry by entry (no bitmap scan, for
    the admission's transaction only), which marks such entries dead as it passes them
    once no snapshot can see them; a bitmap scan would read them all, call after call."""
    url, name = backends.new("postgresql")
    db = Database(url)
    try:
        adm = admission(db, clock, config(tmp_path, global_concurrency=5, concurrency=5))
        a = candidate(adm)
        with db.engine.begin() as conn:  # many calls since the last VACUUM, and statistics
            conn.execute(
                sa.text(
                    "INSERT INTO call_slots (provider, account, model, agent, admitted_at,"
                    " lease_until) SELECT 'p' || (n % 4), '', 'm', 'a' || (n % 8), :now,"
                    " :until FROM generate_series(1, 14000) AS n"
                ),
                {"now": clock.now, "until": clock.now + 60},
            )
        with db.engine.begin() as conn:
            conn.execute(sa.text("UPDATE call_slots SET released_at = :now"), {"now": clock.now})
        with db.engine.connect() as conn:
            conn.execute(sa.text("ANALYZE call_slots"))
            conn.commit()
        limits = Limits.of(adm.catalog, adm.settings, a, "codex")
        slot_gates, windows, _, budgets = limits.shape(take=True)
        take = prepared(db.engine.dialect, slots.take_if_admitted(slot_gates, windows, budgets))
        values = limits.params(a, "codex", clock.now) | slots.row(
            a, "codex", 1, "w1", clock.now, 60
        )
        with db.engine.connect() as conn:
            lock_gates(conn, limits.lock_keys(a, "codex"))  # as an admission begins
            assert conn.execute(sa.text("SHOW enable_bitmapscan")).scalar() == "off"
            cursor = psycopg.RawCursor(conn.connection.driver_connection)
            cursor.execute("EXPLAIN " + take.sql, take.params(values))
            plan = [line for (line,) in cursor.fetchall()]
            conn.rollback()
        assert [line for line in plan if "ix_call_slots_open" in line], plan  # it counts
        assert not [line for line in plan if "Bitmap" in line], plan
        with db.engine.connect() as conn:  # outside an admission's transaction: as configured
            assert conn.execute(sa.text("SHOW enable_bitmapscan")).scalar() == "on"
    finally:
        db.dispose()
        backends.drop(name)


def test_slots_are_taken_and_given_back_in_transactions_that_commit_asynchronously(
    db: Database, clock: FakeClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: the statement that locks the gates and the statements that give a slot
    back turn ``synchronous_commit`` off for their own transaction (its commit does not
    wait for the WAL flush); the next transaction on the connection, a task's transition
    say, commits as the server is configured. SQLite: the admission's and the release's
    transactions run at ``synchronous`` NORMAL, the next one at FULL again."""
    adm = admission(db, clock, config(tmp_path, concurrency=5))
    if db.dialect != "postgresql":
        pragma = "PRAGMA synchronous"
        levels: list[int] = []  # inside each transaction of the admission and the release
        real = Database._transaction

        def seen(self: Database, conn: sa.Connection, work: Any, durable: bool = True) -> Any:
            def reading(c: sa.Connection) -> Any:
                levels.append(c.exec_driver_sql(pragma).scalar())
                return work(c)

            return real(self, conn, reading, durable)

        monkeypatch.setattr(Database, "_transaction", seen)
        permit = admit(adm, candidate(adm))
        assert isinstance(permit, Permit) and permit.slot_id is not None
        permit.__exit__(None, None, None)
        monkeypatch.undo()
        assert levels == [1, 1]  # NORMAL, twice
        assert db.pinned.write(lambda conn: conn.exec_driver_sql(pragma).scalar()) == 2
        return
    show = sa.text("SHOW synchronous_commit")
    permit = admit(adm, candidate(adm))
    assert isinstance(permit, Permit) and permit.slot_id is not None
    # What the admission's one round trip ran, run again step by step on a connection.
    with db.engine.connect() as conn:
        assert conn.execute(show).scalar() == "on"
        lock_gates(conn, ["rpm:sim/acct"])
        assert conn.execute(show).scalar() == "off"
        conn.rollback()
        assert conn.execute(show).scalar() == "on"
        conn.rollback()
        params = {"p_id": permit.slot_id, "p_now": clock.now, "p_provider": "sim"}
        for statement in (slots.RELEASE_POSTGRES, slots.RELEASE_AND_COUNT_SUCCESS_POSTGRES):
            compiled = prepared(conn.dialect, statement)
            compiled.execute(conn, params | {"p_endpoint": "http://127.0.0.1:9/v1"})
            assert conn.execute(show).scalar() == "off", statement
            conn.rollback()  # the slot stays taken for the next statement
    # The admission's own connections, after its transactions: as configured.
    permit.__exit__(None, None, None)
    assert db.pinned.write_one(lambda conn: conn.execute(show).scalar()) == "on"
    assert db.pinned.write(lambda conn: conn.execute(show).scalar()) == "on"
    released = db.read(
        lambda conn: conn.execute(
            sa.select(call_slots.c.released_at).where(call_slots.c.id == permit.slot_id)
        ).scalar()
    )
    assert released == clock.now


def test_the_steps_of_one_round_trip_are_one_transaction(db: Database) -> None:
    """PostgreSQL: ``at_once`` sends its statements with one Sync after the last, and the
    server runs them as one transaction: the gate lock the first step takes is held
    while the second runs and is gone after it, and an error in the second undoes what
    the first wrote."""
    if db.dialect != "postgresql":  # SQLite: one writer at a time, nothing to pipeline
        assert not can_run_at_once(db.engine.dialect)
        return
    dialect = db.engine.dialect
    step = slots.lock_step(dialect, ["rpm:sim/acct"])
    assert step is not None
    mine = "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory'"
    mine += " AND pid = pg_backend_pid()"
    held = prepared(dialect, sa.text(mine).columns(n=sa.Integer))
    rows = db.pinned.write_one(lambda conn: at_once(conn, [step, (held, {})]))
    assert rows[-1] == [(1,)]  # the lock of the step before
    after = db.pinned.write_one(lambda conn: held.tuples(held.execute(conn, {})))
    assert after == [(0,)]  # released with the transaction

    count = prepared(dialect, sa.insert(bus_counters).values(name="probe", label="", value=1))
    fails = prepared(dialect, sa.text("SELECT 1 / 0 AS n").columns(n=sa.Integer))
    with pytest.raises(sa.exc.DataError):
        db.pinned.write_one(lambda conn: at_once(conn, [(count, {}), (fails, {})]))
    kept = db.read(
        lambda conn: conn.execute(
            sa.select(sa.func.count()).where(bus_counters.c.name == "probe")
        ).scalar()
    )
    assert kept == 0
