"""The tasks of each agent in each state, read from ``task_counts``: rows that triggers
on ``bus_commands`` keep in the transaction of every change (migration 0021), so a
reader adds up a few rows instead of grouping the whole table.

On PostgreSQL each server process counts into rows of its own (``shard``: its pid),
which no other transaction writes while it runs; ``fold`` adds them into shard 0 so
that their number stays about the agents times the states. SQLite counts into shard 0.
"""

from __future__ import annotations

from collections import Counter

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.db import Database
from agentbus.schema import task_counts as c

#: PostgreSQL: the rows of every other shard, added into shard 0 and deleted. A row
#: that a transaction is counting into now is skipped (the next fold takes it), so a
#: fold never waits on a worker and no worker's count waits on a fold for long.
FOLD_POSTGRES = sa.text(
    """
WITH moved AS (
    DELETE FROM task_counts c
     USING (SELECT agent, status, shard FROM task_counts WHERE shard <> 0
             ORDER BY agent, status, shard FOR UPDATE SKIP LOCKED) m
     WHERE c.agent = m.agent AND c.status = m.status AND c.shard = m.shard
    RETURNING c.agent, c.status, c.n
)
INSERT INTO task_counts (agent, status, shard, n)
SELECT agent, status, 0, SUM(n) FROM moved GROUP BY agent, status ORDER BY agent, status
ON CONFLICT (agent, status, shard) DO UPDATE SET n = task_counts.n + excluded.n
"""
)


def read(conn: Connection) -> Counter[tuple[str, str]]:
    """Task counts keyed by (status, agent); states an agent has no task in are left out."""
    total = sa.func.sum(c.c.n)
    rows = conn.execute(
        sa.select(c.c.status, c.c.agent, total).group_by(c.c.status, c.c.agent).having(total != 0)
    ).all()
    return Counter({(status, agent): int(n) for status, agent, n in rows})


def fold(db: Database) -> int:
    """PostgreSQL: add the server processes' count rows into shard 0, then drop the rows
    that count nothing (an agent gone); how many counts of shard 0 changed. SQLite:
    nothing to do."""
    if db.dialect != "postgresql":
        return 0

    def work(conn: Connection) -> int:
        folded = int(conn.execute(FOLD_POSTGRES).rowcount)
        conn.execute(sa.delete(c).where(c.c.shard == 0, c.c.n == 0))
        return folded

    return int(db.write(work))
