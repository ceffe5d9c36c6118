"""The status snapshot of a workspace: one document for ``busctl status
--json``, ``GET /workspace/status``, the dashboard and the Prometheus metrics."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.admin import kpi, observe
from agentbus.admission import accounts, shares, workspace_events
from agentbus.admission.budget import client_budget
from agentbus.admission.cooldowns import CooldownStore
from agentbus.catalog import Catalog
from agentbus.config import Settings
from agentbus.db import Database
from agentbus.queue import deadlines, dependencies, events, groups, holds, malformed, reads
from agentbus.queue.statements import in_state
from agentbus.queue.states import TaskStatus
from agentbus.schema import bus_commands as t
from agentbus.schema import route_log, task_events, workers

DUE_SOON = 20  # paused tasks listed, soonest first
KPI_WINDOW_SEC = 3600.0  # the KPIs shown: the last hour's (busctl kpi: any window, all time)
RECENT_REFUSALS = 20  # refused or skipped candidates listed, newest first


def snapshot(
    db: Database,
    settings: Settings,
    now: float | None = None,
    *,
    kpis: bool = True,
    catalog: Catalog | None = None,
) -> dict[str, Any]:
    """The status document. Its KPIs are the last hour's (``KPI_WINDOW_SEC``: read through
    the time indexes, what a dashboard that polls can afford); ``kpis`` False leaves them
    out (/metrics keeps its own). ``catalog``: the config's, for the limits of the
    accounts' windows (without it, only those learnt from the answers)."""
    now = db.clock() if now is None else now
    budget = client_budget(db, settings, holder="status")
    counts = reads.counts(db)
    queue: dict[str, dict[str, int]] = {}
    for (status, agent), n in sorted(counts.items()):
        queue.setdefault(agent, {})[status] = n
    totals: dict[str, int] = {}
    for (status, _), n in counts.items():
        totals[status] = totals.get(status, 0) + n
    doc, seen, bad, windows, held, next_deadline, grouped, waiting = db.read(
        lambda conn: (
            _tables(conn, now),
            observe.observe(conn, now, settings.worker_stale_sec),
            malformed.summary(conn),
            shares.standing(conn, catalog, accounts.learnt(conn), settings.rpm_window_sec, now),
            holds.holds(conn),
            conn.execute(deadlines.NEXT_DEADLINE).scalar(),
            groups.standing(conn),
            dependencies.waiting_by_agent(conn),
        )
    )
    cooling = CooldownStore(db, clock=lambda: now, cache_sec=1e-9).details()
    return {
        "now": now,
        "budget": budget.snapshot(),
        "statuses": [s.value for s in TaskStatus],  # every task state, in lifecycle order
        "queue": queue,
        "totals": totals,
        **doc,
        **seen,
        "unserved": observe.unserved(queue, seen["live_workers"]),
        # agents whose queue an operator put on hold (busctl agents pause): who, why
        "holds": [h.as_dict() for h in held],
        # tasks a deadline ended (ever: a counter), and the next deadline of a waiting task
        "deadlines": {
            "expired": seen["counters"].get("expiries", {}).get("", 0),
            "next": next_deadline,
        },
        # per agent: its groups with unfinished tasks, and those tasks by state
        "groups": grouped,
        # per agent: its queued tasks that wait for other tasks to end (enqueued with after)
        "waiting": waiting,
        # the config's schedules: when each runs next, its last occurrence and task
        "schedules": schedules_of(db, catalog, now),
        # names the client budget refused, ever (a counter: retention leaves it)
        "budget_refused": seen["counters"].get("budget_refused", {}).get("", 0),
        "malformed": bad,
        "cooldowns": [
            {
                "model": c["model_id"],
                "until": c["cooldown_until"],
                "seconds_left": c["cooldown_until"] - now,
                "reason": c["reason"],
                "source": c["source"],
            }
            for c in cooling
        ],
        "circuits": [
            {
                **{k: c[k] for k in ("provider", "state", "consecutive_failures", "open_until")},
                "seconds_left": max(0.0, c["open_until"] - now) if c["open_until"] else None,
            }
            for c in reads.circuit_states(db)
        ],
        # provider accounts' rpm and token windows: used / limit, the agents waiting
        "windows": windows,
        "usage_today": reads.usage_by_day(db, now),
        "kpis": [k.as_dict() for k in kpi.compute(db, now - KPI_WINDOW_SEC)] if kpis else [],
        "kpis_since": now - KPI_WINDOW_SEC,
        "events": workspace_events.recent(db, limit=20),
    }


def schedules_of(db: Database, catalog: Catalog | None, now: float) -> list[dict[str, Any]]:
    """The config's schedules: when each runs next, and its last occurrence and task."""
    from agentbus.sweeper import schedules as timetable

    configured = catalog.schedules if catalog is not None else {}
    kept = timetable.read(db, configured) if configured else {}
    out = []
    for name, schedule in sorted(configured.items()):
        run = kept.get(name)
        out.append(
            {
                "name": name,
                "agent": schedule.agent,
                "when": schedule.when,
                "timezone": schedule.timezone,
                "catch_up": schedule.catch_up,
                "next_at": schedule.next_after(max(now, run.since()) if run else now),
                "first_seen": run.first_seen if run else None,
                "last_at": run.last_at if run else None,
                "last_task_id": run.last_task_id if run else None,
            }
        )
    return out


def windows(
    db: Database, settings: Settings, catalog: Catalog | None, now: float | None = None
) -> list[dict[str, Any]]:
    """The provider accounts' windows as the status document has them (``windows``)."""
    at = db.clock() if now is None else now
    window = settings.rpm_window_sec
    return db.read(lambda conn: shares.standing(conn, catalog, accounts.learnt(conn), window, at))


def _tables(conn: Connection, now: float) -> dict[str, Any]:
    paused = conn.execute(
        sa.select(t.c.id, t.c.agent, t.c.resume_after, t.c.pause_reason, t.c.pause_model)
        .where(in_state(TaskStatus.PAUSED))
        .order_by(t.c.resume_after)
        .limit(DUE_SOON)
    ).all()
    why = _pause_refusals(conn, [p.id for p in paused])
    beats = conn.execute(sa.select(workers).order_by(workers.c.agent, workers.c.id)).all()
    recent = conn.execute(
        sa.select(
            route_log.c.at,
            route_log.c.agent,
            route_log.c.task_id,
            route_log.c.model,
            route_log.c.account,
            route_log.c.refusal,
        )
        .where(route_log.c.refusal.is_not(None))
        .order_by(route_log.c.id.desc())
        .limit(RECENT_REFUSALS)
    ).all()
    return {
        "paused_due_soon": [
            {
                "id": p.id,
                "agent": p.agent,
                "resume_after": p.resume_after,
                "seconds_left": max(0.0, (p.resume_after or now) - now),
                "model": p.pause_model,
                "reason": p.pause_reason,
                "refusals": why.get(p.id, {}),
            }
            for p in paused
        ],
        "recent_refusals": [
            {
                "at": r.at,
                "agent": r.agent,  # mcp:<client> for a governed MCP call (no task)
                "task_id": r.task_id or None,
                "candidate": f"{r.model}@{r.account}" if r.account else r.model,
                **r.refusal,
            }
            for r in recent
        ],
        "workers": [
            {
                "id": w.id,
                "agent": w.agent,
                "host": w.host,
                "pid": w.pid,
                "heartbeat_age": now - w.heartbeat_at,
                "current_task": w.current_task,
                "concurrency": w.concurrency,
                "running": list(w.running) if isinstance(w.running, list) else [],
                "clock_offset": w.clock_offset or 0.0,
                "consecutive_failures": w.consecutive_failures,
                "backoff_until": w.backoff_until,
                "backoff_left": max(0.0, w.backoff_until - now) if w.backoff_until else 0.0,
            }
            for w in beats
        ],
    }


def _pause_refusals(conn: Connection, task_ids: list[int]) -> dict[int, dict[str, Any]]:
    """Task id -> candidate -> refusal, from each task's latest pause event."""
    if not task_ids:
        return {}
    rows = conn.execute(
        sa.select(task_events.c.task_id, task_events.c.detail)
        .where(task_events.c.task_id.in_(task_ids), task_events.c.to_status == TaskStatus.PAUSED)
        .order_by(task_events.c.id.desc())
    )
    out: dict[int, dict[str, Any]] = {}
    for task_id, detail in rows:
        if task_id not in out:
            out[task_id] = events.pause_refusals(detail)
    return out
