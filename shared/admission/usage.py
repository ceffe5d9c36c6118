"""The usage ledger: tokens and cost of settled calls, summed per UTC day.

Written in the settle transaction from the call's routing rows, one row per
(day, model, account, worker) so that no two workers ever wait on one row.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.admission.gates import day_of
from agentbus.db import dialect_insert
from agentbus.schema import usage_daily as u

if TYPE_CHECKING:
    from agentbus.admission.routing import Route


def record(conn: Connection, routes: Iterable[Route]) -> None:
    """Add the calls among ``routes`` to the ledger."""
    batch = rows(routes)
    if batch:
        conn.execute(upsert(conn.dialect.name), batch)


def rows(routes: Iterable[Route]) -> list[dict[str, Any]]:
    """The ledger rows to add for the calls among ``routes`` (parameters of ``upsert``)."""
    sums: dict[tuple[float, str, str, str], list[Any]] = {}
    for r in routes:
        if r.decision != "call" or r.provider is None:
            continue
        key = (day_of(r.at), r.model, r.account or "", r.worker or "")
        row = sums.setdefault(key, [r.provider, 0, 0, 0, 0.0])
        row[1] += 1
        row[2] += r.prompt_tokens or 0
        row[3] += r.completion_tokens or 0
        row[4] += r.cost or 0.0
    return [
        {
            "day": day,
            "model": model,
            "account": account,
            "worker": worker,
            "provider": provider,
            "calls": calls,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "cost": cost,
        }
        for (day, model, account, worker), (provider, calls, prompt, completion, cost) in sorted(
            sums.items()
        )
    ]


@functools.cache
def upsert(dialect: str) -> sa.Insert:
    """Add to a ledger row, creating it (built once: it runs with every settle)."""
    insert = dialect_insert(dialect)(u)
    return _adding(insert)


def upsert_from(select: sa.Select[Any]) -> sa.Insert:
    """PostgreSQL: add the rows ``select`` yields (the ledger's columns in order, one
    row per key) to the ledger."""
    return _adding(dialect_insert("postgresql")(u).from_select([c.name for c in u.c], select))


def _adding(insert: Any) -> sa.Insert:
    added: sa.Insert = insert.on_conflict_do_update(
        index_elements=[u.c.day, u.c.model, u.c.account, u.c.worker],
        set_={
            "calls": u.c.calls + insert.excluded.calls,
            "prompt_tokens": u.c.prompt_tokens + insert.excluded.prompt_tokens,
            "completion_tokens": u.c.completion_tokens + insert.excluded.completion_tokens,
            "cost": u.c.cost + insert.excluded.cost,
        },
    )
    return added


def today_columns(day: Any) -> list[sa.ScalarSelect[Any]]:
    """Tokens and cost settled so far on ``day`` (its first epoch second: a value or a
    bind parameter), as two scalar subqueries (admission asks them in the statement
    that counts its other gates)."""
    today = u.c.day == day
    return [
        sa.select(sa.func.coalesce(sa.func.sum(u.c.prompt_tokens + u.c.completion_tokens), 0))
        .where(today)
        .scalar_subquery(),
        sa.select(sa.func.coalesce(sa.func.sum(u.c.cost), 0.0)).where(today).scalar_subquery(),
    ]


def by_day(conn: Connection, since: float) -> list[dict[str, Any]]:
    """Usage per day and model since ``since`` (for ``busctl status``)."""
    rows = conn.execute(
        sa.select(
            u.c.day,
            u.c.model,
            sa.func.sum(u.c.calls).label("calls"),
            sa.func.sum(u.c.prompt_tokens + u.c.completion_tokens).label("tokens"),
            sa.func.sum(u.c.cost).label("cost"),
        )
        .where(u.c.day >= day_of(since))
        .group_by(u.c.day, u.c.model)
        .order_by(u.c.day.desc(), u.c.model)
    ).mappings()
    # Postgres sums BIGINT as NUMERIC: plain numbers for JSON and tables.
    return [
        {
            "day": float(r["day"]),
            "model": r["model"],
            "calls": int(r["calls"]),
            "tokens": int(r["tokens"]),
            "cost": float(r["cost"]),
        }
        for r in rows
    ]
