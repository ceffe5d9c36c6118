"""``busctl budget show`` and ``busctl budget set``: the workspace's client budget."""

from __future__ import annotations

import json

import click

from agentbus import cli
from agentbus.admin.context import Context, pass_ctx


@click.group("budget")
def budget_group() -> None:
    """The workspace's client budget: its mode and size, shared by every process."""


@budget_group.command("show")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def budget_show_cmd(c: Context, as_json: bool) -> None:
    """The mode and size every worker and busctl serve apply, and what is reserved."""
    from agentbus.admission.budget import WorkspaceBudget

    snap = WorkspaceBudget(c.database(), holder="busctl").snapshot()
    if as_json:
        click.echo(json.dumps(snap, indent=2))
        return
    size = snap["budget"] or 0
    when = (
        f"set {cli.fmt_time(snap['set_at'])} by {snap['set_by']}" if snap["set_at"] else "never set"
    )
    click.echo(f"mode: {snap['mode']}\nsize: {size}\n{when}")
    if snap["mode"] != "off":
        names = ", ".join(snap["reserved"]) or "none"
        click.echo(f"reserved: {snap['count']} ({names})")


@budget_group.command("set")
@click.option("--mode", type=click.Choice(["off", "warn", "enforce"]), help="off, warn or enforce.")
@click.option("--size", type=click.IntRange(min=0), metavar="N", help="Client slots at once.")
@pass_ctx
def budget_set_cmd(c: Context, mode: str | None, size: int | None) -> None:
    """Change the workspace's client budget; running processes apply it within a second."""
    import socket

    from agentbus.admission.budget_setting import write_setting
    from agentbus.logging import configure

    if mode is None and size is None:
        raise click.UsageError("give --mode, --size or both")
    configure(level="WARNING")  # the answer is the line below (and a budget_set event)
    before, after = write_setting(
        c.database(), mode=mode, size=size, by=f"busctl@{socket.gethostname()}"
    )
    click.echo(f"client budget: {after.describe()} (was {before.describe()})")
