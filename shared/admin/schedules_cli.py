"""``busctl schedules``: the configured schedules, when each runs next, and what ran last."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

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
    from agentbus.admin.status import schedules_of

    db = c.database()
    rows = schedules_of(db, c.catalog, db.clock())
    for row in rows:
        last = row["last_task_id"]
        row["last_task_status"] = _status(db, last) if last is not None else None
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
