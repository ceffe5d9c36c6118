"""``worker --agent NAME``: run one agent's tasks until stopped."""

from __future__ import annotations

import os
import socket

import click

from agentbus import cli
from agentbus.catalog import NAME_RE
from agentbus.config import LiveConfig, load_config
from agentbus.errors import ConfigError
from agentbus.logging import configure, get_logger

log = get_logger("agentbus.worker")


@click.command(context_settings={"help_option_names": ["-h", "--help"]}, epilog=cli.EXIT_STATUSES)
@click.version_option(package_name="agentbus")
@click.option("--agent", required=True, help="The agent whose tasks this process runs.")
@cli.db_option
@cli.config_option
@click.option("--drain", is_flag=True, help="Exit 0 once nothing is claimable for the agent.")
@click.option("--max-tasks", type=click.IntRange(min=1), help="Exit after this many tasks.")
@click.option(
    "--lease",
    "lease_sec",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="Claim lease, renewed while a task runs [setting lease_sec].",
)
@click.option(
    "--poll",
    "poll_sec",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="Idle wait between claims [setting poll_sec].",
)
@click.option(
    "--grace",
    "grace_sec",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="On SIGTERM, time a running call may finish [setting grace_sec].",
)
@click.option(
    "--batch",
    "claim_batch",
    type=click.IntRange(1, 1000),
    metavar="N",
    help="Claim N tasks at once and acknowledge them together [setting claim_batch, 1].",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 1000),
    metavar="N",
    help="Run up to N tasks at once, each in a thread [setting concurrency, 1].",
)
@cli.budget_options
@click.option("--log-json", is_flag=True, help="Log JSON lines (default: readable lines).")
def worker(
    agent: str,
    db_url: str | None,
    pooler: str | None,
    listen_url: str | None,
    config_file: str | None,
    drain: bool,
    max_tasks: int | None,
    lease_sec: float | None,
    poll_sec: float | None,
    grace_sec: float | None,
    claim_batch: int | None,
    concurrency: int | None,
    client_budget: int | None,
    budget_mode: str | None,
    log_json: bool,
) -> int:
    """Claim and run the tasks of one agent: one at a time, N at once (--concurrency N),
    or N per claim in turn (--batch N)."""
    if not NAME_RE.match(agent):
        raise click.BadParameter(f"invalid agent name {agent!r}", param_hint="--agent")
    started = cli.start_up()
    overrides = {
        **cli.db_overrides(db_url, pooler, listen_url),
        "lease_sec": lease_sec,
        "poll_sec": poll_sec,
        "grace_sec": grace_sec,
        "claim_batch": claim_batch,
        "concurrency": concurrency,
        "client_budget": client_budget,
        "budget_mode": budget_mode,
    }
    config = load_config(config_file, overrides)
    configure(json=log_json, level=config.settings.log_level.upper())
    if config.catalog.agents and agent not in config.catalog.agents:
        raise ConfigError(
            f"unknown agent {agent!r}: {config.path} configures "
            f"{', '.join(sorted(config.catalog.agents))}"
        )
    from agentbus.providers.registry import check_targets

    check_targets(config.catalog)  # python models: their functions import, and take a request
    for provider in config.catalog.providers.values():
        for account in provider.accounts:
            if account.key_env and not os.environ.get(account.key_env):
                log.warning(
                    "credentials_missing",
                    provider=provider.name,
                    account=account.name,
                    variable=account.key_env,
                    effect="its candidates are skipped",
                )
    from agentbus.db import Database
    from agentbus.worker.loop import Options, Worker

    cli.import_driver(config.settings.database_url)
    settings = config.settings
    db = Database.from_settings(
        settings,
        threads=settings.concurrency,
        no_bitmap_scans=True,
        name=f"agentbus-worker:{agent}:{socket.gethostname()}:{os.getpid()}",
        connections=settings.connections(
            connections_for(settings.concurrency),
            2 + settings.concurrency,
            f"a worker with concurrency {settings.concurrency}",
        ),
        service=True,
    )
    try:
        db.require_migrated()
        options = Options(
            agent,
            settings.lease_sec,
            settings.poll_sec,
            settings.grace_sec,
            drain=drain,
            max_tasks=max_tasks,
            batch=settings.claim_batch,
            concurrency=settings.concurrency,
        )
        live = LiveConfig(config, check=lambda new: check_targets(new.catalog))
        runner = Worker(live, db, options)
        cli.on_stop_signals(runner.request_stop)
        started()
        return runner.run()
    finally:
        db.dispose()


def connections_for(concurrency: int) -> int:
    """PostgreSQL connections a worker opens at most: the claims' own two (given back
    when it idles) and one in the pool; with tasks running side by side, one more while
    they settle at once (a task holds one only to read or write, never during its call)."""
    return min(2 + concurrency, 4)


def main() -> None:
    cli.run(worker, "worker")
