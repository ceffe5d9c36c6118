"""busctl: administer an agentbus database (migrate, enqueue, inspect, steer)."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from agentbus import cli
from agentbus.admin import render
from agentbus.admin.agents_cli import agents_group
from agentbus.admin.budget_cli import budget_group
from agentbus.admin.context import Context, pass_ctx
from agentbus.admin.control import cancel_cmd, cooldowns_group, resume_cmd
from agentbus.admin.schedules_cli import schedules_cmd
from agentbus.admin.serve_cli import serve_cmd
from agentbus.config import load_config
from agentbus.errors import BusError, Problem
from agentbus.queue.states import TaskStatus

if TYPE_CHECKING:
    pass

# Each command imports what it uses (SQLAlchemy, the queue, prometheus-client…)
# when it runs, so that `busctl --help` and `busctl enqueue` start quickly.


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=cli.EXIT_STATUSES)
@cli.db_option
@cli.config_option
@click.version_option(package_name="agentbus")
@click.pass_context
def busctl(
    ctx: click.Context,
    db_url: str | None,
    pooler: str | None,
    listen_url: str | None,
    config_file: str | None,
) -> None:
    """Administer an agentbus queue: migrate, enqueue, inspect, steer."""
    ctx.obj = Context.of(load_config(config_file, cli.db_overrides(db_url, pooler, listen_url)))
    ctx.call_on_close(lambda: ctx.obj._db.dispose() if ctx.obj._db else None)


@busctl.command("migrate")
@pass_ctx
def migrate_cmd(c: Context) -> None:
    """Create or upgrade the schema (adopts an older bus_commands table in place)."""
    from agentbus.db import redact
    from agentbus.migrations import migrate

    db = c.database(migrated=False)
    before = db.current_revision()
    migrate(db)
    after = db.current_revision()
    if before == after:
        click.echo(f"{redact(db.url)} is up to date ({after})")
    else:
        click.echo(f"migrated {redact(db.url)} from {before or 'nothing'} to {after}")


@busctl.command("enqueue")
@click.option("--agent", required=True, help="The agent whose worker runs the task.")
@click.option("--models", "models", metavar="M1,M2", help="Explicit model chain, tried in order.")
@click.option("--role", metavar="ROLE", help="A configured role that names the models.")
@click.option(
    "--payload", metavar="JSON|@FILE|-", help="A JSON object handed to the task (a file, stdin)."
)
@click.option("--priority", type=int, default=0, show_default=True, help="Higher runs first.")
@click.option("--run-after", type=float, default=0.0, metavar="SECONDS", help="Delay the task.")
@click.option("--max-attempts", type=int, help="Attempts before failing [default: setting].")
@click.option("--key", metavar="K", help="Idempotency key: enqueueing it again returns the task.")
@click.option(
    "--deadline",
    metavar="ISO-TIME",
    help="Not started by then (e.g. 2026-12-08T09:00:00Z): never started, cancelled.",
)
@click.option("--expires-in", type=float, metavar="SECONDS", help="A deadline this long after now.")
@click.option("--group", metavar="G", help="Its group (a conversation): turns run in order.")
@click.option("--after", metavar="ID,...", help="Run when these tasks are done; their results in.")
@click.option(
    "--after-policy",
    type=click.Choice(["all_done", "any_end"]),
    default="all_done",
    show_default=True,
    help="any_end: run once they have ended, however (else a failed one cancels this).",
)
@click.argument("text")
@pass_ctx
def enqueue_cmd(
    c: Context,
    agent: str,
    models: str | None,
    role: str | None,
    payload: str | None,
    priority: int,
    run_after: float,
    max_attempts: int | None,
    key: str | None,
    deadline: str | None,
    expires_in: float | None,
    group: str | None,
    after: str | None,
    after_policy: str,
    text: str,
) -> None:
    """Put a task on the queue and print its id. TEXT - reads the text from stdin.

    Without --models or --role the agent's chain in the config file applies
    (--config, AGENTBUS_CONFIG or ./agentbus.toml); with a config file, an
    agent, role or model it does not know is refused before anything is written.
    """
    from agentbus.admission.routing import check_task
    from agentbus.queue.dependencies import parse_after
    from agentbus.queue.tasks import TaskSpec, deadline_epoch, parse_models, parse_payload

    if models is not None and role is not None:
        raise click.UsageError("give --models or --role, not both")
    if text == "-" and payload == "-":
        raise click.UsageError("the text and the payload cannot both come from stdin")
    chain = parse_models(models) if models is not None else None
    check_task(c.catalog, agent=agent, models=chain, role=role)
    spec = TaskSpec(
        agent=agent,
        command=_stdin("text") if text == "-" else text,
        models=chain,
        role=role,
        payload=parse_payload(_payload_text(payload)),
        priority=priority,
        delay_sec=run_after,
        max_attempts=max_attempts,
        key=key,
        deadline=None if deadline is None else deadline_epoch(deadline),
        expires_in_sec=expires_in,
        group=group,
        after=() if after is None else parse_after(after),
        after_policy=after_policy,
    )
    result = c.queue().enqueue(spec)
    if not result.created:
        click.echo(f"busctl: key {key!r} already names task {result.id}", err=True)
    click.echo(result.id)


def _payload_text(given: str | None) -> str | None:
    """``--payload``: JSON text, ``@FILE`` or ``-`` (stdin)."""
    if given == "-":
        return _stdin("payload")
    if given is not None and given.startswith("@"):
        path = Path(given[1:])
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise BusError(f"cannot read the payload file {path}: {exc}") from None
    return given


def _stdin(what: str) -> str:
    try:
        return str(sys.stdin.read())
    except UnicodeDecodeError as exc:
        raise BusError(f"cannot read the {what} from stdin: {exc}") from None


@busctl.command("status")
@click.option(
    "--json", "as_json", is_flag=True, help="The full status document (as GET /workspace/status)."
)
@pass_ctx
def status_cmd(c: Context, as_json: bool) -> None:
    """Task counts by status and agent, today's usage, circuits and the client budget."""
    from agentbus.admin import status

    doc = status.snapshot(c.database(), c.settings, catalog=c.catalog)
    if as_json:
        click.echo(json.dumps(doc, indent=2, default=str))
        return
    click.echo(render.status(doc, c.settings))


busctl.add_command(budget_group)
for _command in (cancel_cmd, resume_cmd, cooldowns_group, agents_group, schedules_cmd, serve_cmd):
    busctl.add_command(_command)


@busctl.command("events")
@click.option("--kind", "kinds", multiple=True, metavar="KIND", help="Only this kind (repeatable).")
@click.option("--limit", type=click.IntRange(1, 100_000), default=50, show_default=True)
@click.option("--follow", is_flag=True, help="Keep printing new events (Ctrl-C stops).")
@pass_ctx
def events_cmd(c: Context, kinds: tuple[str, ...], limit: int, follow: bool) -> None:
    """Workspace events: budget warnings, refused batches, circuits, cooldowns, pauses."""
    from agentbus.admission import workspace_events

    db = c.database()
    since: float | None = None
    stop = threading.Event()
    cli.on_stop_signals(lambda *_: stop.set())
    while True:
        for e in workspace_events.recent(db, kinds=kinds, since=since, limit=limit):
            times = workspace_events.TIMES
            detail = " ".join(
                f"{k}={cli.fmt_time(v) if k in times and isinstance(v, float) else v}"
                for k, v in (e["detail"] or {}).items()
            )
            at = cli.fmt_time(e["at"], ago=False)
            click.echo(f"{at}  {e['kind']:<17} {e['scope']:<9} {detail}")
            since = e["at"]
        if not follow or stop.wait(1.0):
            return


@busctl.command("show")
@click.argument("task_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def show_cmd(c: Context, task_id: int, as_json: bool) -> None:
    """One task: its row and its events."""
    from agentbus.queue import events as task_events
    from agentbus.queue import reads
    from agentbus.queue.tasks import TIMES
    from agentbus.schema import WAITING_DUE

    db = c.database()
    task = reads.get_task(db, task_id)
    events = reads.task_events(db, task_id)
    # Why it paused last: each candidate's refusal ({code, name, retry_after_ms, …}).
    pauses = [e for e in events if e["to_status"] == TaskStatus.PAUSED]
    refused = task_events.pause_refusals(pauses[-1]["detail"]) if pauses else {}
    after = c.queue().dependencies_of(task_id) if task.after_policy else []
    if as_json:
        doc = {"task": task.as_dict(), "after": after, "events": events, "refusals": refused}
        click.echo(json.dumps(doc, indent=2))
        return
    times = {"run_after", *TIMES}
    for name, value in task.as_dict().items():
        if name == "problem":
            continue  # said last, when there is one
        shown = cli.fmt_time(value) if name in times and value else value
        if name == "run_after" and value == WAITING_DUE:
            shown = "when the tasks it waits for have ended"
        if isinstance(shown, (dict, list)):
            shown = json.dumps(shown)
        click.echo(f"{name:>16}: {'-' if shown is None else shown}")
    if after:
        click.echo(f"{'waits for':>16}: {', '.join(map(str, after))} ({task.after_policy})")
    if task.problem:
        click.echo(f"{'problem':>16}: {task.problem}")
    if task.result_detail:
        click.echo("")
        click.echo(render.answer(task.result_detail))
    click.echo("")
    rows = [
        [
            cli.fmt_time(e["at"]),
            e["from_status"] or "-",
            e["to_status"],
            e["reason"],
            e["worker"],
            e["claim_token"],
            json.dumps(e["detail"]) if e["detail"] else None,
        ]
        for e in events
    ]
    click.echo(cli.table(["at", "from", "to", "reason", "worker", "token", "detail"], rows))
    if refused:
        click.echo(f"\nrefusals at the last pause ({cli.fmt_time(pauses[-1]['at'])}):")
        click.echo(render.refusals(refused))


@busctl.command("tasks")
@click.option("--status", type=click.Choice([s.value for s in TaskStatus]))
@click.option("--agent")
@click.option("--limit", type=click.IntRange(1, 100_000), default=50, show_default=True)
@click.option(
    "--before",
    type=click.IntRange(1),
    metavar="ID",
    help="Only tasks older than this id: the next page is --before the last id shown.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def tasks_cmd(
    c: Context, status: str | None, agent: str | None, limit: int, before: int | None, as_json: bool
) -> None:
    """The newest tasks, optionally filtered, a page at a time."""
    from agentbus.queue import reads

    db = c.database()
    tasks = reads.list_tasks(db, status=status, agent=agent, limit=limit, before=before)
    if as_json:
        click.echo(json.dumps([t.as_dict() for t in tasks], indent=2))
        return
    rows: list[list[Any]] = [
        [
            t.id,
            t.agent,
            t.status.value,
            t.priority,
            f"{t.attempts}/{t.max_attempts}",
            cli.fmt_time(t.resume_after) if t.resume_after else None,
            cli.fmt_time(t.created_at),
            f"[{t.problem}] {_excerpt(t.command) or ''}" if t.problem else _excerpt(t.command),
        ]
        for t in tasks
    ]
    click.echo(
        cli.table(
            ["id", "agent", "status", "prio", "tries", "resume_after", "created", "text"], rows
        )
    )


@busctl.command("retry")
@click.argument("task_id", type=int)
@pass_ctx
def retry_cmd(c: Context, task_id: int) -> None:
    """Put a failed or errored task back on the queue."""
    c.queue().retry(task_id)
    click.echo(f"task {task_id} re-queued")


@busctl.command("routes")
@click.option("--limit", type=click.IntRange(1, 100_000), default=50, show_default=True)
@click.option("--task", "task_id", type=int, help="Only the decisions for this task.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def routes_cmd(c: Context, limit: int, task_id: int | None, as_json: bool) -> None:
    """Routing history: every candidate a worker considered, and what came of it; then
    the provider accounts' windows now (used of the limit, the agents waiting)."""
    from agentbus.admin import status
    from agentbus.queue import reads

    rows = reads.routes(c.database(), limit=limit, task_id=task_id)
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    click.echo(render.routes(rows))
    if task_id is None:
        click.echo(render.windows(status.windows(c.database(), c.settings, c.catalog)))


@busctl.command("refusals")
@click.option("--limit", type=click.IntRange(1, 100_000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def refusals_cmd(c: Context, limit: int, as_json: bool) -> None:
    """Calls refused by admission, newest first: workers' candidates and governed MCP
    tools (agent mcp:<client>), with the gate, the code and when it admits again."""
    from agentbus.queue import reads

    rows = reads.refusals(c.database(), limit=limit)
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    click.echo(render.refusal_rows(rows))


@busctl.command("kpi")
@click.option("--since", metavar="DURATION", help="Only the last DURATION (90s, 15m, 2h, 7d).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--sql",
    "as_sql",
    is_flag=True,
    help="Print the KPI queries as plain SQL (for sqlite3 or psql) and exit.",
)
@click.pass_context
def kpi_cmd(ctx: click.Context, since: str | None, as_json: bool, as_sql: bool) -> None:
    """The four KPIs of the cooldown design, with their targets and counts.

    Without --since they count every fact kept, reading the whole event log and
    routing history (seconds at tens of millions of rows); --since reads that window
    through the time indexes.

    \b
    busctl kpi --sql | sqlite3 ops_multiagent.db
    busctl kpi --sql | psql "$DATABASE"
    """
    if as_sql:
        click.echo(_shipped("kpi.sql"), nl=False)
        return
    c = ctx.ensure_object(Context)
    from agentbus.admin import kpi

    start = time.time() - kpi.parse_duration(since) if since else None
    kpis = kpi.compute(c.database(), start)
    if as_json:
        click.echo(json.dumps({"since": start, "kpis": [k.as_dict() for k in kpis]}, indent=2))
    else:
        click.echo(kpi.render(kpis))
    failing = [k.name for k in kpis if k.passed is False]
    if failing:  # exit 1: a script can alert on it
        raise Problem(f"below target: {', '.join(failing)}")


@busctl.command("demo")
@click.option("--quick", is_flag=True, help="A shorter run (about 10 s, 15 tasks).")
@click.option("--tasks", type=click.IntRange(3, 2000), help="How many tasks to queue.")
@click.pass_context
def demo_cmd(ctx: click.Context, quick: bool, tasks: int | None) -> int:
    """Watch agentbus work: rate-limited tasks paused, resumed and completed.

    Uses a fresh SQLite file in a temporary folder unless --db is given.
    """
    from agentbus.admin import demo

    workdir = demo.new_workdir()
    explicit = ctx.find_root().params.get("db_url")
    url = explicit or demo.default_url(workdir)
    plan = demo.QUICK if quick else demo.Plan()
    if tasks is not None:
        plan = dataclasses.replace(plan, tasks=tasks)
    return demo.Demo(url, plan, click.echo, workdir).run()


@busctl.command("init")
@click.argument("path", default="agentbus.toml", type=click.Path(dir_okay=False))
@click.option("--force", is_flag=True, help="Overwrite the file if it exists.")
def init_cmd(path: str, force: bool) -> None:
    """Write a commented config file (every setting and table, with examples) to PATH."""
    target = Path(path)
    if target.exists() and not force:
        raise BusError(f"{target} exists: pass --force to overwrite it")
    try:
        target.write_text(_shipped("agentbus.example.toml"))
    except OSError as exc:
        raise BusError(f"cannot write {target}: {exc.strerror}") from None
    click.echo(f"wrote {target}: edit it, then run worker --config {target} (or keep the name")
    click.echo("agentbus.toml in the working directory, where every command finds it)")


def _shipped(name: str) -> str:
    """A text file shipped in the package beside this module."""
    return resources.files("agentbus.admin").joinpath(name).read_text(encoding="utf-8")


def _excerpt(text: str | None, width: int = 48) -> str:
    flat = " ".join((text or "").split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _with_exit_statuses(group: click.Group) -> None:
    for command in group.commands.values():
        command.epilog = command.epilog or cli.EXIT_STATUSES
        if isinstance(command, click.Group):
            _with_exit_statuses(command)


_with_exit_statuses(busctl)


def main() -> None:
    cli.run(busctl, "busctl")
