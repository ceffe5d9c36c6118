"""``busctl agents``: put a hold on an agent's queue, lift it, and list the holds.

A held agent's tasks stay ``queued`` (not the task state ``paused``): no worker
anywhere claims them until the hold is lifted; calls already running finish.
"""

from __future__ import annotations

import json

import click

from agentbus import cli
from agentbus.admin.context import Context, pass_ctx
from agentbus.admin.control import operator


def _configured(c: Context) -> frozenset[str]:
    return frozenset(c.catalog.agents) if c.catalog is not None else frozenset()


@click.group("agents", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def agents_group(ctx: click.Context, as_json: bool) -> None:
    """Agents whose queue is on hold: since when, by whom and why (`pause`, `resume`)."""
    if ctx.invoked_subcommand is not None:
        return
    from agentbus.queue import holds

    c = ctx.find_object(Context)
    assert c is not None
    held = c.database().read(holds.holds)
    if as_json:
        click.echo(json.dumps([h.as_dict() for h in held], indent=2))
        return
    if not held:
        click.echo("no agent is on hold")
        return
    rows = [[h.agent, cli.fmt_time(h.held_at), h.held_by, h.reason or ""] for h in held]
    click.echo(cli.table(["agent on hold", "since", "by", "reason"], rows))


@agents_group.command("pause")
@click.argument("agent")
@click.option("--reason", help="Why, for the operators who see the hold.")
@pass_ctx
def pause_cmd(c: Context, agent: str, reason: str | None) -> None:
    """Hold AGENT's queue: no worker claims its tasks until `busctl agents resume`.

    Calls already running finish; its tasks stay queued (their status is not
    `paused`). Takes effect at every worker's next claim.
    """
    from agentbus.logging import configure
    from agentbus.queue import holds

    configure(level="WARNING")  # the answer is the line below (and an agent_held event)
    db = c.database()
    if holds.hold(db, agent, reason, operator(), db.clock(), _configured(c)):
        click.echo(f"{agent}: on hold; no worker claims its tasks")
    else:
        click.echo(f"{agent}: on hold already")


@agents_group.command("resume")
@click.argument("agent")
@pass_ctx
def resume_agent_cmd(c: Context, agent: str) -> None:
    """Lift the hold on AGENT's queue: its workers claim its tasks again at once."""
    from agentbus.logging import configure
    from agentbus.queue import holds

    configure(level="WARNING")  # the answer is the line below (and an event)
    db = c.database()
    if holds.lift(db, agent, operator(), db.clock(), _configured(c)):
        click.echo(f"{agent}: hold lifted; its workers claim again")
    else:
        click.echo(f"{agent}: was not on hold")
