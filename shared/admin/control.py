"""busctl's steering commands: cancel, resume and retry tasks, and clear cooldowns.

Each change names the operator (``busctl:user@host``) in the event it writes.
Ids that name no task are refused before anything changes (exit 4); a task
that is not in a state the command moves is reported, the others are moved,
and the exit status is 1.
"""

from __future__ import annotations

import getpass
import json
import socket
from collections.abc import Sequence

import click

from agentbus import cli
from agentbus.admin.context import Context, pass_ctx
from agentbus.errors import NotFound, Problem
from agentbus.queue.states import TRANSITIONS, TaskStatus

CANCELLABLE = sorted(s.value for s in TRANSITIONS["cancel"][0])


def operator() -> str:
    """Who is at the keyboard, for the event log."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"busctl:{user}@{socket.gethostname()}"


def _known(c: Context, task_ids: Sequence[int]) -> None:
    missing = sorted(set(task_ids) - c.queue().existing(task_ids))
    if missing:
        raise NotFound(f"no task {', '.join(map(str, missing))}: nothing changed")


def _unmoved(c: Context, asked: Sequence[int], moved: list[int], verb: str) -> None:
    """Report the asked-for tasks that did not move (exit 1)."""
    left = [i for i in asked if i not in set(moved)]
    if not left:
        return
    statuses = {i: c.queue().get(i).status.value for i in left}
    shown = ", ".join(f"{i} ({status})" for i, status in statuses.items())
    raise Problem(f"not {verb}: {shown}")


@click.command("cancel")
@click.argument("task_ids", nargs=-1, type=int)
@click.option("--agent", help="Every cancellable task of this agent.")
@click.option(
    "--status",
    type=click.Choice(CANCELLABLE),
    help="Only tasks in this status (with --agent; default: queued, paused and claimed).",
)
@pass_ctx
def cancel_cmd(
    c: Context, task_ids: tuple[int, ...], agent: str | None, status: str | None
) -> None:
    """Cancel tasks: queued, paused or claimed -> cancelled (never run again).

    A claimed task's worker finds its claim gone and abandons the call before its
    next candidate; its result, if any, is discarded.
    """
    if not task_ids and agent is None:
        raise click.UsageError("give task ids, or --agent (with --status)")
    if status is not None and agent is None:
        raise click.UsageError("--status goes with --agent")
    _known(c, task_ids)
    queue = c.queue()
    wanted = list(task_ids)
    if agent is not None:
        statuses = [TaskStatus(status)] if status else [TaskStatus(s) for s in CANCELLABLE]
        for each in statuses:
            wanted += queue.matching(agent=agent, status=each)
    moved = queue.cancel(list(dict.fromkeys(wanted)), by=operator())
    click.echo(f"cancelled {len(moved)} task{'s' if len(moved) != 1 else ''}")
    _unmoved(c, task_ids, moved, "cancelled")


@click.command("resume")
@click.argument("task_ids", nargs=-1, type=int, required=True)
@pass_ctx
def resume_cmd(c: Context, task_ids: tuple[int, ...]) -> None:
    """Paused tasks -> queued now (say, after raising a limit), as the sweeper would."""
    _known(c, task_ids)
    moved = c.queue().resume(list(task_ids), by=operator())
    click.echo(f"resumed {len(moved)} task{'s' if len(moved) != 1 else ''}")
    _unmoved(c, task_ids, moved, "paused, not resumed")


@click.group("cooldowns", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def cooldowns_group(ctx: click.Context, as_json: bool) -> None:
    """Models cooling down now: until when, why, and who set it (`clear` ends one)."""
    if ctx.invoked_subcommand is not None:
        return
    from agentbus.admission.cooldowns import CooldownStore

    c = ctx.find_object(Context)
    assert c is not None
    now = c.database().clock()
    rows = CooldownStore(c.database(), cache_sec=1e-9).details()
    if as_json:
        click.echo(
            json.dumps([{**r, "seconds_left": r["cooldown_until"] - now} for r in rows], indent=2)
        )
        return
    click.echo(
        cli.table(
            ["model", "until", "left", "reason", "set by"],
            [
                [
                    r["model_id"],
                    cli.fmt_time(r["cooldown_until"]),
                    f"{r['cooldown_until'] - now:.0f}s",
                    r["reason"],
                    r["source"],
                ]
                for r in rows
            ],
        )
    )


@cooldowns_group.command("clear")
@click.argument("model", metavar="MODEL[@ACCOUNT]")
@pass_ctx
def clear_cmd(c: Context, model: str) -> None:
    """End a cooldown now: MODEL's (and its accounts'), or one MODEL@ACCOUNT's.

    Workers see it within a second; a new 429 cools the model again.
    """
    from agentbus.admission.cooldowns import CooldownStore
    from agentbus.logging import configure

    configure(level="WARNING")  # the answer is the line below (and a cooldown_cleared event)
    cleared = CooldownStore(c.database()).clear(model, by=operator())
    if not cleared:
        raise NotFound(f"{model} is not cooling down")
    click.echo(f"cleared {', '.join(cleared)}")
