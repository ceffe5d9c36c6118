"""``sweeper``: the service that resumes pauses, rescues orphans and keeps tables tidy."""

from __future__ import annotations

import click

from agentbus import cli
from agentbus.config import LiveConfig, load_config
from agentbus.logging import configure


@click.command(context_settings={"help_option_names": ["-h", "--help"]}, epilog=cli.EXIT_STATUSES)
@click.version_option(package_name="agentbus")
@cli.db_option
@cli.config_option
@click.option(
    "--interval",
    "interval_sec",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="Seconds between full passes [setting sweep_interval_sec, 60].",
)
@click.option("--once", is_flag=True, help="Run every job one time and exit.")
@click.option("--log-json", is_flag=True, help="Log JSON lines (default: readable lines).")
def sweeper(
    db_url: str | None,
    pooler: str | None,
    listen_url: str | None,
    config_file: str | None,
    interval_sec: float | None,
    once: bool,
    log_json: bool,
) -> int:
    """Resume due pauses, rescue expired claims, demote 48 h pauses, purge cooldowns."""
    started = cli.start_up()
    overrides = {**cli.db_overrides(db_url, pooler, listen_url), "sweep_interval_sec": interval_sec}
    config = load_config(config_file, overrides)
    configure(json=log_json, level=config.settings.log_level.upper())
    from agentbus.db import Database
    from agentbus.sweeper import jobs
    from agentbus.sweeper.service import SweeperService, run_once

    cli.import_driver(config.settings.database_url)
    # PostgreSQL: one connection, kept for its passes (one job runs at a time, and the
    # fleet clock is read again between transactions); db_connections 2 allows a second.
    db = Database.from_settings(
        config.settings,
        name="agentbus-sweeper",
        connections=config.settings.connections(1, 2, "the sweeper"),
        service=True,
    )
    try:
        db.require_migrated()
        sweep = jobs.Sweep(db, LiveConfig(config))
        started()
        if once:
            return 1 if run_once(sweep)["failed_jobs"] else 0
        service = SweeperService(
            sweep, interval=config.settings.sweep_interval_sec, peek=config.settings.sweep_peek_sec
        )
        cli.on_stop_signals(lambda _name: service.stop())
        service.run()
        return 0
    finally:
        db.dispose()


def main() -> None:
    cli.run(sweeper, "sweeper")
