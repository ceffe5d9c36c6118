"""Every task count an operator reads (``busctl status``, the dashboard's document, the
``agentbus_tasks`` metric), each against a ``GROUP BY`` over the table."""

from __future__ import annotations

from collections import Counter

import sqlalchemy as sa

from agentbus.admin import serve, status
from agentbus.config import Settings
from agentbus.db import Database
from agentbus.schema import bus_commands as t


def grouped(db: Database) -> Counter[tuple[str, str]]:
    """(status, agent) -> tasks, as the whole table says."""
    rows = db.read(
        lambda conn: conn.execute(
            sa.select(t.c.status, t.c.agent, sa.func.count()).group_by(t.c.status, t.c.agent)
        ).all()
    )
    return Counter({(state, agent): int(n) for state, agent, n in rows})


def differences(db: Database) -> list[str]:
    """What any reader shows that the table does not say; empty when all agree."""
    table = grouped(db)
    doc = status.snapshot(db, Settings(), kpis=False)
    shown = Counter(
        {(state, agent): n for agent, by in doc["queue"].items() for state, n in by.items()}
    )
    totals: Counter[str] = Counter()
    for (state, _), n in table.items():
        totals[state] += n
    (family,) = [
        f
        for f in serve.SnapshotCollector(lambda _: doc, list).collect()
        if f.name == "agentbus_tasks"
    ]
    metric = Counter(
        {(s.labels["status"], s.labels["agent"]): int(s.value) for s in family.samples}
    )
    out = []
    for name, seen, want in (
        ("status queue", shown, table),
        ("status totals", Counter(doc["totals"]), totals),
        ("agentbus_tasks", metric, table),
    ):
        if +seen != +want:
            out.append(f"{name}: shows {dict(+seen)}, the table says {dict(+want)}")
    return out
