"""Schedules: ``[schedules.NAME]`` tables, each a task the sweeper enqueues on a timetable.

A schedule names its agent and text (as an enqueue does: payload, models or role,
priority, max_attempts, expires_in_sec) and either ``cron`` (five fields, read by
APScheduler's cron trigger, in ``timezone``, UTC by default) or ``every`` (``90s``,
``5m``, ``2h``, ``1d`` or seconds; occurrences at whole multiples of it since the
epoch, so every sweeper computes the same ones). ``catch_up`` (default true): after
downtime the latest missed occurrence is enqueued, once; false skips it.

The times are plain functions of the values (``latest``, ``next_after``), with no
I/O: the sweeper (``agentbus.sweeper.schedules``) asks them.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from agentbus.catalog.model import NAME_RE, Catalog
from agentbus.errors import ConfigError

KEYS = {
    "agent",
    "text",
    "cron",
    "every",
    "timezone",
    "catch_up",
    "payload",
    "models",
    "role",
    "priority",
    "max_attempts",
    "expires_in_sec",
}
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_EVERY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
MIN_EVERY_SEC = 1.0
MAX_EVERY_SEC = 366 * 86400.0
#: How far back the latest occurrence is first looked for: a dense timetable has one
#: there; a sparse one is walked from the start, in few steps.
_RECENT_SEC = 3600.0


@dataclass(frozen=True)
class ScheduleConfig:
    name: str
    agent: str
    text: str
    cron: str | None = None
    every_sec: float | None = None
    timezone: str = "UTC"
    catch_up: bool = True
    payload: Mapping[str, Any] = field(default_factory=dict)
    models: tuple[str, ...] | None = None
    role: str | None = None
    priority: int = 0
    max_attempts: int | None = None
    expires_in_sec: float | None = None

    @property
    def when(self) -> str:
        """The timetable as written: the cron expression or ``every N s``."""
        if self.cron is not None:
            return self.cron
        every = self.every_sec or 0.0
        unit = next(u for u in ("d", "h", "m", "s") if every % _UNITS[u] == 0 or u == "s")
        return f"every {every / _UNITS[unit]:g}{unit}"

    def next_after(self, after: float) -> float:
        """The first occurrence strictly after ``after`` (epoch seconds)."""
        if self.every_sec is not None:
            return (math.floor(after / self.every_sec) + 1) * self.every_sec
        trigger = _trigger(self.cron or "", self.timezone)
        start = datetime.fromtimestamp(after, UTC) + timedelta(microseconds=1)
        fire = trigger.get_next_fire_time(None, start)
        return fire.timestamp() if fire is not None else math.inf

    def latest(self, since: float, now: float) -> float | None:
        """The last occurrence in ``(since, now]`` (None: there is none)."""
        if self.every_sec is not None:
            at = math.floor(now / self.every_sec) * self.every_sec
            return at if since < at <= now else None
        for start in (max(since, now - _RECENT_SEC), since):
            found = None
            at = self.next_after(start)
            while at <= now:
                found, at = at, self.next_after(at)
            if found is not None:
                return found
        return None


def parse_schedules(section: list[tuple[str, Any]], catalog: Catalog) -> dict[str, ScheduleConfig]:
    """``[schedules.*]`` as values; ConfigError (one line naming the table and key) for a
    key that is wrong or a task no enqueue would take."""
    return {name: _schedule(name, body, catalog) for name, body in section}


def _schedule(name: str, body: Mapping[str, Any], catalog: Catalog) -> ScheduleConfig:
    where = f"[schedules.{name}]"
    extra = sorted(set(body) - KEYS)
    if extra:
        raise ConfigError(f"{where}: unknown key {extra[0]!r}")
    if ("cron" in body) == ("every" in body):
        raise ConfigError(f"{where}: give either cron or every")
    agent = body.get("agent")
    if not isinstance(agent, str) or not NAME_RE.match(agent):
        raise ConfigError(f"{where}: agent must be an agent's name, got {agent!r}")
    timezone = body.get("timezone", "UTC")
    if not isinstance(timezone, str):
        raise ConfigError(f"{where}: timezone must be a name such as 'Europe/Paris'")
    cron = body.get("cron")
    if cron is not None:
        if not isinstance(cron, str):
            raise ConfigError(f"{where}: cron must be a string of five fields")
        try:
            _trigger(cron, timezone)
        except (ValueError, KeyError, LookupError) as exc:
            why = str(exc).strip() or type(exc).__name__
            raise ConfigError(f"{where}: cron {cron!r} does not read: {why}") from None
    every = _every(body["every"], where) if "every" in body else None
    catch_up = body.get("catch_up", True)
    if not isinstance(catch_up, bool):
        raise ConfigError(f"{where}: catch_up must be true or false")
    models = body.get("models")
    if models is not None:
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise ConfigError(f"{where}: models must be a list of model ids")
        models = tuple(models)
    schedule = ScheduleConfig(
        name,
        agent,
        body.get("text"),  # type: ignore[arg-type]  # checked as a task's below
        cron,
        every,
        timezone,
        catch_up,
        body.get("payload", {}),
        models,
        body.get("role"),
        body.get("priority", 0),
        body.get("max_attempts"),
        body.get("expires_in_sec"),
    )
    _check_task(schedule, catalog, where)
    return schedule


def _every(value: Any, where: str) -> float:
    seconds: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (found := _EVERY.match(value)):
        seconds = float(found.group(1)) * _UNITS[found.group(2)]
    if seconds is None or not MIN_EVERY_SEC <= seconds <= MAX_EVERY_SEC:
        raise ConfigError(
            f"{where}: every must be a time such as '30s', '5m', '2h' or '1d' "
            f"(from 1 s to 366 days), got {value!r}"
        )
    return seconds


def _check_task(schedule: ScheduleConfig, catalog: Catalog, where: str) -> None:
    """The task it enqueues must be one an enqueue takes: its values (``TaskSpec``), and an
    agent, role and models the config knows, with a chain to run on."""
    from agentbus.errors import InvalidTask

    try:
        spec(schedule)
    except InvalidTask as exc:
        raise ConfigError(f"{where}: {exc.message}") from None
    if catalog.agents and schedule.agent not in catalog.agents:
        raise ConfigError(f"{where}: unknown agent {schedule.agent!r} (not in [agents])")
    if schedule.role is not None and schedule.role not in catalog.roles:
        raise ConfigError(f"{where}: unknown role {schedule.role!r}")
    for model in schedule.models or ():
        if not catalog.knows(model):
            raise ConfigError(f"{where}: unknown model {model!r}")
    if (
        schedule.models is None
        and schedule.role is None
        and schedule.agent not in catalog.agents
        and catalog.default_role is None
    ):
        raise ConfigError(f"{where}: no chain: give models or role, or configure the agent")


def spec(schedule: ScheduleConfig, *, at: float | None = None) -> Any:
    """The ``TaskSpec`` a schedule enqueues (``at``: its occurrence, keyed by it, so an
    occurrence is enqueued once however many sweepers run)."""
    from agentbus.queue.tasks import TaskSpec

    return TaskSpec(
        agent=schedule.agent,
        command=schedule.text,
        models=schedule.models,
        role=schedule.role,
        payload=schedule.payload,
        priority=schedule.priority,
        max_attempts=schedule.max_attempts,
        expires_in_sec=schedule.expires_in_sec,
        key=None if at is None else occurrence_key(schedule.name, at),
    )


def occurrence_key(name: str, at: float) -> str:
    """The idempotency key of a schedule's occurrence."""
    return f"schedule:{name}:{datetime.fromtimestamp(at, UTC).isoformat(timespec='seconds')}"


@functools.lru_cache(maxsize=256)
def _trigger(cron: str, timezone: str) -> Any:
    """APScheduler's cron trigger of an expression (imported only where a schedule is)."""
    from apscheduler.triggers.cron import CronTrigger

    return CronTrigger.from_crontab(cron, timezone=timezone)
