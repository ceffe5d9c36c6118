"""``busctl schedules``: the configured schedules, when each runs next, and what ran last."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from agentbus import cli
from agentbus.admin.context import Context, pass_ctx

if TYPE_CHECKING:
    from agentbus.db import Database


@click.command("schedules")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def schedules_cmd(c: Context, as_json: bool) -> None:
    """The schedules of the config file ([schedules.NAME]): next run, last occurrence."""
    from agentbus.sweeper import schedules as timetable

    configured = c.catalog.schedules if c.catalog is not None else {}
    db = c.database()
    now = db.clock()
    kept = timetable.read(db, configured)
    rows: list[dict[str, Any]] = []
    for name, schedule in sorted(configured.items()):
        run = kept.get(name)
        last_id = run.last_task_id if run is not None else None
        status = _status(db, last_id) if last_id is not None else None
        rows.append(
            {
                "name": name,
                "agent": schedule.agent,
                "when": schedule.when,
                "timezone": schedule.timezone,
                "catch_up": schedule.catch_up,
                "next_at": schedule.next_after(max(now, run.since()) if run else now),
                "first_seen": run.first_seen if run is not None else None,
                "last_at": run.last_at if run is not None else None,
                "last_task_id": last_id,
                "last_task_status": status,
            }
        )
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no schedule is configured ([schedules.NAME] in the config file)")
        return
    table = [
        [
            r["name"],
            r["agent"],
            r["when"] + ("" if r["timezone"] == "UTC" else f" ({r['timezone']})"),
            cli.fmt_time(r["next_at"]),
            cli.fmt_time(r["last_at"]) if r["last_at"] is not None else "never",
            "" if r["last_task_id"] is None else f"{r['last_task_id']} ({r['last_task_status']})",
        ]
        for r in rows
    ]
    click.echo(cli.table(["schedule", "agent", "when", "next run", "last run", "last task"], table))


def _status(db: Database, task_id: int) -> str | None:
    from agentbus.errors import TaskNotFound
    from agentbus.queue import reads

    try:
        return reads.get_task(db, task_id).status.value
    except TaskNotFound:  # pruned by retention
        return None
