"""A worker's steady state: acknowledge completed claims and claim the next tasks, in
one transaction, with as few round trips and as little Python as each database allows.

PostgreSQL runs it as one statement (data-modifying CTEs) in autocommit: one
round trip per claim. The statement completes the acknowledged claims (each
guarded by its claim token), appends their events, routing rows and usage for
exactly the claims that held, claims up to ``p_limit`` due tasks with
``FOR UPDATE SKIP LOCKED`` and appends the claim events. SQLite has no
data-modifying CTEs: the same steps run as separate statements on the driver's
cursor inside one ``BEGIN IMMEDIATE`` transaction.

Either way the statements are the ones ``agentbus.queue.statements`` builds,
compiled once (``agentbus.db.compiled.Prepared``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.admission import usage
from agentbus.admission.gates import day_of
from agentbus.db import Database
from agentbus.db.compiled import Prepared, prepared
from agentbus.queue import events, wakeups
from agentbus.queue.decisions import Complete, Settlement
from agentbus.queue.groups import GroupRule, mode_of
from agentbus.queue.inserts import INSERT_EVENT, INSERT_ROUTE
from agentbus.queue.statements import (
    COMPLETE_MANY_POSTGRES,
    COMPLETE_ONE_POSTGRES,
    P_NOW,
    P_WORKER,
    SETTLE,
    claim_statement,
    settle_params,
)
from agentbus.queue.states import TaskStatus
from agentbus.schema import route_log, task_events

QUEUED, CLAIMED = TaskStatus.QUEUED.value, TaskStatus.CLAIMED.value


def _recordset(name: str, table: sa.Table, extra: Sequence[sa.ColumnClause[Any]] = ()) -> Any:
    """``jsonb_to_recordset(:p_<name>) AS <name>(column type, …)``: the rows of ``table``
    (without its key) passed as one JSON array."""
    from sqlalchemy.dialects.postgresql import JSONB  # a PostgreSQL statement: made there

    columns = [sa.column(c.name, c.type) for c in table.c if c.name != "id"]
    return (
        sa.func.jsonb_to_recordset(sa.bindparam(f"p_{name}", type_=JSONB))
        .table_valued(*columns, *extra)
        .render_derived(name=name, with_types=True)
    )


@functools.cache
def ack_and_claim_postgres(
    *, single: bool = False, limit: int | None = None, groups: str | None = None
) -> sa.Select[Any]:
    """PostgreSQL: the steady state in one statement.

    Parameters: those of ``COMPLETE_MANY_POSTGRES`` (with ``single``: of
    ``COMPLETE_ONE_POSTGRES``, one completion or none, ``p_id`` NULL) and of the claim
    (with ``limit``: claiming up to that many, ``p_limit`` not read; with ``groups``, the
    agent's group order, ``p_group_limit``),
    ``p_events`` (the settlement events), ``p_routes`` (routing rows, each with its
    ``day``) as JSON arrays. Returns one row per claimed task (all its columns) and,
    in column ``acked`` of every row, the ids whose completion held; at least one row.
    """
    complete = COMPLETE_ONE_POSTGRES if single else COMPLETE_MANY_POSTGRES
    acked = complete.cte("acked")
    held = sa.select(acked.c.id)
    # How many to claim written in the statement: the plan the server keeps for every
    # run (its generic plan) then counts on as many rows as a plan made for each run's
    # values does, and is chosen over making one at every run. With ``p_limit`` it
    # counted on a tenth of the queued tasks of the table's statistics and was dearer,
    # so the server planned the statement again at every run, which cost it about as
    # much again as running it once statistics said tasks were queued.
    claimed = claim_statement("postgresql", limit=limit, groups=groups).cte("claimed")
    ev = _recordset("events", task_events)
    event_columns = [c.name for c in task_events.c if c.name != "id"]
    settle_events = sa.select(*(ev.c[n] for n in event_columns)).where(ev.c.task_id.in_(held))
    claim_events = sa.select(
        claimed.c.id,
        sa.literal(QUEUED, sa.Text),
        sa.literal(CLAIMED, sa.Text),
        sa.literal("claim", sa.Text),
        P_WORKER,
        claimed.c.claim_token,
        P_NOW,
        sa.null(),
    )
    write_events = (
        sa.insert(task_events)
        .from_select(event_columns, sa.union_all(settle_events, claim_events))
        .cte("write_events")
    )
    rt = _recordset("routes", route_log, [sa.column("day", sa.Float)])
    route_columns = [c.name for c in route_log.c if c.name != "id"]
    done_routes = rt.c.task_id.in_(held)
    write_routes = (
        sa.insert(route_log)
        .from_select(route_columns, sa.select(*(rt.c[n] for n in route_columns)).where(done_routes))
        .cte("write_routes")
    )
    account = sa.func.coalesce(rt.c.account, "")
    by = sa.func.coalesce(rt.c.worker, "")
    write_usage = usage.upsert_from(
        sa.select(
            rt.c.day,
            rt.c.model,
            account,
            by,
            sa.func.min(rt.c.provider),
            sa.func.count(),
            sa.func.sum(sa.func.coalesce(rt.c.prompt_tokens, 0)),
            sa.func.sum(sa.func.coalesce(rt.c.completion_tokens, 0)),
            sa.func.sum(sa.func.coalesce(rt.c.cost, 0.0)),
        )
        .where(done_routes, rt.c.decision == "call", rt.c.provider.is_not(None))
        .group_by(rt.c.day, rt.c.model, account, by)
    ).cte("write_usage")
    one = sa.select(sa.literal(1).label("one")).subquery("one")
    acked_ids = sa.select(sa.func.array_agg(acked.c.id)).scalar_subquery().label("acked")
    # Producers waiting for tasks hear that some are done (one notification per commit,
    # only while one listens).
    settled = (
        wakeups.ended_notice(sa.exists(sa.select(acked.c.id))).scalar_subquery().label("settled")
    )
    return (
        sa.select(acked_ids, settled, *claimed.c)
        .select_from(one.outerjoin(claimed, sa.true()))
        .add_cte(write_events, write_routes, write_usage)
    )


class _SQLiteStatements(NamedTuple):
    """The SQLite steady state's statements, compiled once for one database, and where a
    claim's event takes its task's id and claim token (``insert_event``'s parameters)
    and where a claimed row holds them (both claims return the same columns)."""

    complete: Prepared
    claim_one: Prepared
    claim_many: Prepared
    insert_event: Prepared
    insert_route: Prepared
    add_usage: Prepared
    claim_event_places: tuple[tuple[int, int], tuple[int, int]]

    @classmethod
    def compile(cls, dialect: sa.Dialect, groups: str | None) -> _SQLiteStatements:
        insert_event, claim_one = (
            prepared(dialect, INSERT_EVENT),
            prepared(dialect, claim_statement("sqlite", single=True, groups=groups)),
        )
        names, columns = insert_event.names, claim_one.columns
        return cls(
            prepared(dialect, SETTLE["complete"]),
            claim_one,
            prepared(dialect, claim_statement("sqlite", groups=groups)),
            insert_event,
            prepared(dialect, INSERT_ROUTE),
            prepared(dialect, usage.upsert("sqlite")),
            (
                (names.index("task_id"), names.index("claim_token")),
                (columns.index("id"), columns.index("claim_token")),
            ),
        )


class SteadyState:
    """``run``: settle completions and claim, on one database."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.postgres = db.dialect == "postgresql"

    @functools.cache  # noqa: B019 (one per queue, kept as long as it)
    def _sqlite_statements(self, groups: str | None) -> _SQLiteStatements:
        """Compiled at the first claim (a queue that never claims, a command's, compiles
        none) and kept, for each group order claimed with."""
        return _SQLiteStatements.compile(self.db.engine.dialect, groups)

    def run(
        self,
        acks: Sequence[Settlement],
        *,
        agent: str,
        worker: str | None,
        now: float,
        lease_sec: float,
        limit: int,
        groups: GroupRule | None = None,
    ) -> tuple[set[int], list[dict[str, Any]]]:
        """Complete ``acks`` (each ``decision`` a ``Complete``) and claim up to ``limit``
        tasks of ``agent`` (``groups``: its rule for its tasks' groups): (the ids whose
        claim held, the claimed rows)."""
        assert all(isinstance(a.decision, Complete) for a in acks)
        claim = {
            "p_agent": agent,
            "p_worker": worker,
            "p_now": now,
            "p_lease_until": now + lease_sec,
            "p_limit": max(limit, 0),
            **(groups.params if groups is not None else {}),
        }
        mode = mode_of(groups)
        if self.postgres:
            return self.db.pinned.write_one(lambda conn: self._postgres(conn, acks, claim, mode))
        return self._sqlite(acks, claim, mode)

    def _postgres(
        self,
        conn: Connection,
        acks: Sequence[Settlement],
        claim: dict[str, Any],
        groups: str | None,
    ) -> tuple[set[int], list[dict[str, Any]]]:
        now, worker = claim["p_now"], claim["p_worker"]
        results = [settle_params(a.decision)[1] for a in acks]
        params = {
            **claim,
            "p_events": [events.for_settlement(a, worker, now) for a in acks],
            "p_routes": [{**r.row(), "day": day_of(r.at)} for a in acks for r in a.routes],
        }
        # One at a time: plain parameters, no array to encode. A worker that claims more
        # at once runs the array form every time, its first claim included: one statement
        # to compile and for the server to prepare (for each number of tasks it claims:
        # its batch, and the free slots of one with several).
        single = len(acks) <= 1 and claim["p_limit"] <= 1
        if single:  # none: p_id NULL matches no row
            first = acks[0] if acks else None
            params["p_id"] = first.task_id if first else None
            params["p_token"] = first.token if first else None
            values = results[0] if results else dict.fromkeys(("p_result", "p_note", "p_detail"))
            params.update((k, events.storable(v)) for k, v in values.items())
        else:
            params["p_ids"] = [a.task_id for a in acks]
            params["p_tokens"] = [a.token for a in acks]
            params["p_results"] = [events.storable(r["p_result"]) for r in results]
            params["p_notes"] = [events.storable(r["p_note"]) for r in results]
            params["p_details"] = [events.storable(r["p_detail"]) for r in results]
        statement = ack_and_claim_postgres(single=single, limit=claim["p_limit"], groups=groups)
        both = prepared(conn.dialect, statement)
        rows = both.rows(both.execute(conn, params))
        acked = set(rows[0]["acked"] or ())
        return acked, [row for row in rows if row["id"] is not None]

    def _sqlite(
        self, acks: Sequence[Settlement], claim: dict[str, Any], groups: str | None
    ) -> tuple[set[int], list[dict[str, Any]]]:
        """Every statement's parameters are made before the transaction begins (a claim's
        event from a template its task's id and token are put in) and the claimed rows
        are read after it ends: the writers' turn (one writer at a time on SQLite) holds
        the statements and little else."""
        now, worker = claim["p_now"], claim["p_worker"]
        statements = self._sqlite_statements(groups)
        complete, insert_event = statements.complete, statements.insert_event
        insert_route, add_usage = statements.insert_route, statements.add_usage
        claiming = statements.claim_one if claim["p_limit"] == 1 else statements.claim_many
        completes = []
        for a in acks:
            values = {"p_id": a.task_id, "p_token": a.token, "p_now": now}
            values.update((k, events.storable(v)) for k, v in settle_params(a.decision)[1].items())
            completes.append((a, complete.params(values)))
        settled = {
            a.task_id: insert_event.params(events.for_settlement(a, worker, now)) for a in acks
        }
        all_routes = [r for a in acks for r in a.routes]
        route_rows = [insert_route.params(r.row()) for r in all_routes]
        usage_rows = [add_usage.params(row) for row in usage.rows(all_routes)]
        claimed = insert_event.params(
            events.event(0, QUEUED, CLAIMED, now, worker=worker, claim_token=0, reason="claim")
        )
        claiming_params = claiming.params(claim)
        (task_at, token_at), (id_at, claim_token_at) = statements.claim_event_places

        def claim_event(row: tuple[Any, ...]) -> list[Any]:
            event = list(claimed)
            event[task_at], event[token_at] = row[id_at], row[claim_token_at]
            return event

        def work(conn: Connection) -> tuple[list[Settlement], list[tuple[Any, ...]]]:
            done = [a for a, params in completes if complete.run(conn, params).rowcount == 1]
            fetched = (
                claiming.fetch(claiming.run(conn, claiming_params)) if claim["p_limit"] else []
            )
            moves = [settled[a.task_id] for a in done]
            moves.extend(claim_event(row) for row in fetched)
            insert_event.run_many(conn, moves)
            if len(done) == len(acks):  # as nearly always: the rows made beforehand
                insert_route.run_many(conn, route_rows)
                add_usage.run_many(conn, usage_rows)
            else:
                routes = [r for a in done for r in a.routes]
                insert_route.execute_many(conn, [r.row() for r in routes])
                add_usage.execute_many(conn, usage.rows(routes))
            return done, fetched

        done, fetched = self.db.pinned.write(work)
        return {a.task_id for a in done}, claiming.dicts(fetched)
