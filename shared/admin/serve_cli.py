"""``busctl serve``: the status document, metrics, health and the dashboard over HTTP."""

from __future__ import annotations

import os
import time
from typing import Any

import click

from agentbus import cli
from agentbus.admin import control
from agentbus.admin.context import Context, pass_ctx
from agentbus.errors import BusError


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True)
@click.option(
    "--allow-host",
    "allow_hosts",
    multiple=True,
    metavar="NAME",
    help="Also answer requests for this Host name (repeatable); others get 403.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(1, 10_000),
    default=32,
    show_default=True,
    help="Connections served at once; more are closed at once.",
)
@click.option(
    "--timeout",
    "timeout_sec",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    metavar="SECONDS",
    help="A connection silent this long is closed.",
)
@click.option(
    "--admin-token-env",
    metavar="VAR",
    help="Allow retry, cancel and resume from the dashboard to requests carrying the "
    "token in environment variable VAR (Authorization: Bearer); without it, read-only.",
)
@cli.budget_options
@pass_ctx
def serve_cmd(
    c: Context,
    host: str,
    port: int,
    allow_hosts: tuple[str, ...],
    max_connections: int,
    timeout_sec: float,
    admin_token_env: str | None,
    client_budget: int | None,
    budget_mode: str | None,
) -> None:
    """Serve the status document, Prometheus metrics, /healthz and a dashboard page.

    Requests must name this server (the bound address, localhost or an
    --allow-host name): a web page elsewhere cannot read it through DNS
    rebinding. Reading needs no authentication: bind loopback, or put it behind
    a proxy that authenticates. Writes (retry, cancel, resume) need the operator
    token of --admin-token-env.
    """
    from agentbus.admin import kpi, serve, status
    from agentbus.admission import budget_setting as budget
    from agentbus.logging import configure

    changes = {"client_budget": client_budget, "budget_mode": budget_mode}
    settings = c.settings.replace(**{k: v for k, v in changes.items() if v is not None})
    configure(level=settings.log_level.upper())
    db = c.database(serve=True)
    ignored = budget.disagreement(settings, budget.read_setting(db))
    if ignored is not None:
        click.echo(f"busctl: warning: {ignored}", err=True)

    def snapshot(kpis: bool) -> dict[str, Any]:
        return status.snapshot(db, settings, kpis=kpis, catalog=c.catalog)

    def task(task_id: int) -> dict[str, Any] | None:
        from agentbus.errors import TaskNotFound
        from agentbus.queue import reads

        try:
            found = reads.get_task(db, task_id)
        except TaskNotFound:
            return None
        routes = reads.routes(db, task_id=task_id, limit=200)
        return {"task": found.as_dict(), "events": reads.task_events(db, task_id), "routes": routes}

    def act(action: str, task_id: int) -> bool:
        """Retry, cancel or resume one task (serve.ACTIONS); whether it moved."""
        queue, by = c.queue(), f"dashboard:{control.operator().split(':', 1)[1]}"
        if action == "retry":
            queue.retry(task_id, by=by)  # raises when the task is not retryable
            return True
        if action == "cancel":
            return bool(queue.cancel([task_id], by=by))
        return bool(queue.resume([task_id], by=by))

    token = _admin_token(admin_token_env)

    def health() -> str | None:
        """None when the database answers and its schema is at head; else why not."""
        try:
            db.require_migrated()
        except BusError as exc:
            return exc.message
        except Exception as exc:  # the database went away: the server keeps serving
            return f"database unavailable: {type(exc).__name__}"
        return None

    try:
        server = serve.make_server(
            host,
            port,
            snapshot,
            health=health,
            task=task,
            kpis=lambda: [k.as_dict() for k in kpi.compute(db, time.time() - 3600)],
            act=act if token is not None else None,
            token=token,
            allowed_hosts=allow_hosts,
            timeout=timeout_sec,
            max_connections=max_connections,
        )
    except OSError as exc:
        raise BusError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    bound = server.server_address[1]
    # Before saying it serves: whoever reads that line may stop it at once.
    cli.on_stop_signals(lambda _signal: server.shutdown())
    if not serve.is_loopback(host):
        click.echo(
            f"busctl: warning: serving on {host}, beyond this machine, without authentication: "
            "anyone who can reach it reads the workspace status",
            err=True,
        )
    click.echo(
        f"busctl: serving http://{host}:{bound}/ (status: /workspace/status, metrics: /metrics,"
        " health: /healthz)",
        err=True,
    )
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()


def _admin_token(variable: str | None) -> str | None:
    """The operator token ``busctl serve`` accepts for writes, from the environment."""
    if variable is None:
        return None
    token = os.environ.get(variable, "")
    if len(token) < 16:
        raise BusError(f"--admin-token-env {variable}: set it to a token of 16 characters or more")
    return token
