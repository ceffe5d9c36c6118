"""The producer API: what an orchestrator written in Python uses.

    from agentbus import AgentBus

    with AgentBus("sqlite:///ops_multiagent.db") as bus:
        task_id = bus.enqueue("codex", "Summarise the macro news", models=["sim/a", "sim/b"])
        task = bus.wait(task_id, timeout=600)      # done, failed, error or cancelled
        print(task.status, task.result)

The URL defaults to $AGENTBUS_DATABASE_URL, then sqlite:///ops_multiagent.db.
With a config file (AGENTBUS_CONFIG or ./agentbus.toml), a task naming an
agent, role or model the config does not know is refused before anything is
written, and a task without models or role takes its agent's chain. Errors a
caller can act on are ``agentbus.errors.BusError`` subclasses.

``wait`` and ``wait_many`` return as soon as the tasks settle: on PostgreSQL a
``LISTEN agentbus_settled`` connection (opened at the first wait; while it is
open, settles notify) wakes them,
on SQLite they look again after 5 ms, doubling up to 50 ms.
``AsyncAgentBus`` offers the same methods to asyncio code.
"""

from __future__ import annotations

import builtins
import itertools
import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.admission.routing import check_task
from agentbus.catalog import Catalog
from agentbus.catalog.model import NAME_RE
from agentbus.config import Config, LiveConfig, Settings, load_config
from agentbus.db import Database
from agentbus.errors import ConfigError, InvalidTask, TaskNotFound, WaitTimeout
from agentbus.queue import TaskQueue, reads, wakeups
from agentbus.queue.states import TERMINAL, TaskStatus
from agentbus.queue.tasks import Task, TaskSpec, deadline_epoch
from agentbus.schema import bus_commands

if TYPE_CHECKING:
    from agentbus.admission.permits import CallPermit, Permits

FIRST_LOOK_SEC = 0.005
SQLITE_LOOK_MAX_SEC = 0.05
LISTENING_LOOK_MAX_SEC = 2.0  # with LISTEN a look is only the fallback
ITEM_KEYS = frozenset(
    {
        "agent",
        "text",
        "models",
        "role",
        "payload",
        "priority",
        "delay_sec",
        "run_at",
        "max_attempts",
        "key",
        "deadline",
        "expires_in_sec",
        "group",
        "after",
        "after_policy",
    }
)


def time_left(
    task_ids: Sequence[int], done: Mapping[int, Task], deadline: float | None
) -> float | None:
    """Seconds a wait may go on (None: no deadline); WaitTimeout once they are spent."""
    left = None if deadline is None else deadline - time.monotonic()
    if left is not None and left <= 0:
        waiting = [i for i in task_ids if i not in done]
        raise WaitTimeout(f"tasks still running: {', '.join(map(str, waiting))}")
    return left


MAX_TASK_ID = 2**63 - 1  # the largest id either database stores
MAX_IDS = 10_000  # task ids one call takes
MAX_LIMIT = 100_000  # tasks one list returns (busctl tasks --limit: the same)


def checked_id(value: object) -> int:
    """A task id as given: an integer (TaskNotFound when no task can have it)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTask(f"a task id must be an integer, not {type(value).__name__}")
    if not 1 <= value <= MAX_TASK_ID:
        raise TaskNotFound(f"task {value} does not exist")
    return value


def checked_ids(values: object) -> builtins.list[int]:
    """Task ids as given: a list (or tuple) of at most MAX_IDS integers."""
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise InvalidTask(f"task ids must be a list of integers, not {type(values).__name__}")
    given = builtins.list(itertools.islice(values, MAX_IDS + 1))
    if len(given) > MAX_IDS:
        raise InvalidTask(f"at most {MAX_IDS} task ids at a time")
    return [checked_id(value) for value in given]


def existing(values: Sequence[object]) -> builtins.list[int]:
    """The ids among ``values`` a task can have (integers; others raise InvalidTask)."""
    ids = []
    for value in values:
        try:
            ids.append(checked_id(value))
        except TaskNotFound:
            continue  # out of range: no task to move
    return ids


def checked_timeout(value: object) -> float | None:
    """A wait's timeout: None (no end) or seconds, 0 or more."""
    if value is None:
        return None
    if not _is_number(value) or value != value or value < 0:  # type: ignore[operator]
        raise InvalidTask(
            f"timeout must be None or a number of seconds of 0 or more, not {value!r}"
        )
    try:
        return float(value)  # type: ignore[arg-type]
    except OverflowError:  # an integer past any float: no end in practice
        return math.inf


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def seconds_until(run_at: object) -> float:
    """How far off an aware datetime is (0 if past); InvalidTask for anything else."""
    if not isinstance(run_at, datetime) or run_at.tzinfo is None:
        raise InvalidTask("run_at must be a timezone-aware datetime")
    try:
        return max(0.0, run_at.timestamp() - time.time())
    except (OverflowError, ValueError, OSError):
        raise InvalidTask(f"run_at is out of range: {run_at!r}") from None


class AgentBus:
    """Enqueue tasks, read and steer them, and wait for their results."""

    def __init__(
        self, url: str | None = None, *, settings: Settings | None = None, by: str = "api"
    ) -> None:
        config: Config | None = None if settings is not None else load_config()
        base = settings if settings is not None else config.settings  # type: ignore[union-attr]
        self.settings = base if url is None else base.replace(database_url=url)
        self.catalog: Catalog | None = (
            config.catalog if config is not None and config.path is not None else None
        )
        self.by = by  # who this producer is, in the events of what it cancels or resumes
        self._config = config if config is not None else Config(self.settings, Catalog(), None)
        self._permits: Permits | None = None
        # Two connections at most, none held until the first call: a web app's every
        # process may make one at start.
        connections = self.settings.connections(2, 3, "the producer API")
        self.db = Database.from_settings(self.settings, connections=connections)
        try:
            self.db.require_migrated()
        except BaseException:
            self.db.dispose()
            raise
        self.db.engine.dispose()  # the check's connection closes: opened again when used
        self.queue = TaskQueue(self.db, **self.settings.queue_options())
        self._ended = threading.Condition()
        self._generation = 0  # notifications of ended tasks heard so far
        self._listener: wakeups.Listener | None = None
        self._subscribers: list[Any] = []  # the async waiters' wake-ups

    # -- calls of the caller's own ----------------------------------------------

    def permit(
        self, model: str, *, agent: str, tokens: int | None = None
    ) -> AbstractContextManager[CallPermit]:
        """Leave for one call of ``model`` that the caller makes itself (an SDK's), under
        the admission every worker's call passes; ``agentbus.errors.Refused`` when it is
        refused now. What the block raises, or reports (``p.report(status=…,
        headers=…, usage=…)``), teaches admission as a worker's call would: a 429
        cools the model for every process. ``tokens``: what the call will use, counted
        by the daily token budget unless the block reports its usage. See
        ``agentbus.admission.permits``."""
        if self._permits is None:  # admission is loaded only by a producer that asks
            from agentbus.admission.permits import Permits

            self._permits = Permits.open(
                self.db, LiveConfig(self._config), holder=f"{self.by}-permit"
            )
        return self._permits.permit(model, agent=agent, tokens=tokens)

    # -- producing -------------------------------------------------------------

    def enqueue(
        self,
        agent: str,
        text: str,
        *,
        models: Sequence[str] | None = None,
        role: str | None = None,
        payload: Mapping[str, Any] | None = None,
        priority: int = 0,
        delay_sec: float = 0.0,
        run_at: datetime | None = None,
        max_attempts: int | None = None,
        key: str | None = None,
        deadline: datetime | None = None,
        expires_in_sec: float | None = None,
        group: str | None = None,
        after: Sequence[int] = (),
        after_policy: str = "all_done",
        connection: Connection | None = None,
    ) -> int:
        """Queue a task and return its id (an existing task's id for a known ``key``).

        ``run_at`` (an aware datetime) or ``delay_sec`` put it off. A task not
        started by ``deadline`` (an aware datetime), or ``expires_in_sec`` after
        now, is never started: it ends ``cancelled``, the reason ``deadline``. Tasks
        of one ``group`` (a conversation) run at most the agent's ``group_concurrency``
        at once, in enqueue order. A task enqueued ``after`` tasks (their ids) waits
        until every one is done (``after_policy="any_end"``: ended, however) and gets
        their results as ``payload["inputs"]``; when one fails, errs or is cancelled
        it is cancelled too (reason ``dependency``). With
        ``connection`` the task is written through that SQLAlchemy connection in
        its transaction: it exists if and when the caller commits.
        """
        item = {
            "agent": agent,
            "text": text,
            "models": models,
            "role": role,
            "payload": payload,
            "priority": priority,
            "delay_sec": delay_sec,
            "run_at": run_at,
            "max_attempts": max_attempts,
            "key": key,
            "deadline": deadline,
            "expires_in_sec": expires_in_sec,
            "group": group,
            "after": after,
            "after_policy": after_policy,
        }
        return self.enqueue_many([item], connection=connection)[0]

    def enqueue_many(
        self, items: Iterable[Mapping[str, Any]], *, connection: Connection | None = None
    ) -> builtins.list[int]:
        """Queue many tasks in one transaction; returns their ids in order. Each item
        takes the keyword names of ``enqueue`` (``agent`` and ``text`` required)."""
        if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Iterable):
            raise InvalidTask(f"items must be a list of task mappings, not {type(items).__name__}")
        specs = [self._spec(item) for item in items]
        if connection is not None:
            return [e.id for e in self.queue.enqueue_on(connection, specs)]
        return self.queue.enqueue_many(specs)

    def _spec(self, item: Mapping[str, Any]) -> TaskSpec:
        """One item as a checked ``TaskSpec``: every value is taken as given (no
        coercion), so a wrong type is refused by name, never converted or crashed on."""
        if not isinstance(item, Mapping):
            raise InvalidTask(f"a task item must be a mapping, not {type(item).__name__}")
        unknown = sorted(repr(k) for k in item if k not in ITEM_KEYS)
        if unknown:
            raise InvalidTask(f"unknown task field {', '.join(unknown)}")
        for required in ("agent", "text"):
            if item.get(required) is None:
                raise InvalidTask(f"a task needs {required!r}")
        delay = item.get("delay_sec")
        run_at = item.get("run_at")
        if run_at is not None:
            if delay is not None and not (_is_number(delay) and delay == 0):
                raise InvalidTask("give run_at or delay_sec, not both")
            delay = seconds_until(run_at)
        models = item.get("models")
        if models is not None and (
            isinstance(models, (str, bytes)) or not isinstance(models, Sequence)
        ):
            raise InvalidTask(f"models must be a list of model ids, not {type(models).__name__}")
        after = item.get("after")
        if after is not None and (
            isinstance(after, (str, bytes)) or not isinstance(after, Sequence)
        ):
            raise InvalidTask(f"after must be a list of task ids, not {type(after).__name__}")
        payload = item.get("payload")
        if payload is not None and not isinstance(payload, Mapping):
            raise InvalidTask(f"the payload must be a JSON object, not {type(payload).__name__}")
        spec = TaskSpec(
            agent=item["agent"],
            command=item["text"],
            models=tuple(models) if models is not None else None,
            role=item.get("role"),
            payload=dict(payload) if payload is not None else {},
            priority=0 if item.get("priority") is None else item["priority"],
            delay_sec=0.0 if delay is None else delay,
            max_attempts=item.get("max_attempts"),
            key=item.get("key"),
            deadline=None if item.get("deadline") is None else deadline_epoch(item["deadline"]),
            expires_in_sec=item.get("expires_in_sec"),
            group=item.get("group"),
            after=tuple(after) if after is not None else (),
            after_policy="all_done" if item.get("after_policy") is None else item["after_policy"],
        )
        try:
            check_task(self.catalog, agent=spec.agent, models=spec.models, role=spec.role)
        except ConfigError as exc:  # the task does not fit the config: bad input
            raise InvalidTask(exc.message) from None
        return spec

    # -- reading and steering --------------------------------------------------

    def get(self, task_id: int) -> Task:
        return self.queue.get(checked_id(task_id))

    def list(
        self, *, status: TaskStatus | str | None = None, agent: str | None = None, limit: int = 50
    ) -> builtins.list[Task]:
        """The newest tasks, optionally of one status and/or agent."""
        value = None
        if status is not None:
            try:
                value = TaskStatus(status).value
            except (ValueError, TypeError):
                names = ", ".join(s.value for s in TaskStatus)
                raise InvalidTask(f"unknown status {status!r}: one of {names}") from None
        if agent is not None and (not isinstance(agent, str) or not NAME_RE.match(agent)):
            raise InvalidTask(f"invalid agent name {agent!r}")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise InvalidTask(f"limit must be an integer from 1 to {MAX_LIMIT}, not {limit!r}")
        return reads.list_tasks(self.db, status=value, agent=agent, limit=limit)

    def cancel(self, *task_ids: int) -> builtins.list[int]:
        """Cancel queued, paused or claimed tasks; returns the ids that were cancelled."""
        return self.queue.cancel(existing(task_ids), by=self.by)

    def resume(self, *task_ids: int) -> builtins.list[int]:
        """Paused tasks back to the queue now; returns the ids that were paused."""
        return self.queue.resume(existing(task_ids), by=self.by)

    def retry(self, task_id: int) -> None:
        """A failed, errored or cancelled task back to the queue with fresh attempts."""
        self.queue.retry(checked_id(task_id), by=self.by)

    # -- steering agents ---------------------------------------------------------

    def pause_agent(self, agent: str, *, reason: str | None = None) -> bool:
        """Put a hold on ``agent``'s queue: no worker anywhere claims its tasks until
        ``resume_agent`` (calls already running finish; its tasks stay queued, which is
        not the task state ``paused``). False: it was held already. UnknownAgent when
        neither the config nor a task or worker names it."""
        from agentbus.queue import holds

        return holds.hold(self.db, agent, reason, self.by, self.queue.clock(), self._agents())

    def resume_agent(self, agent: str) -> bool:
        """Lift the hold on ``agent``'s queue; its idle workers claim at once. False: it
        was not held."""
        from agentbus.queue import holds

        return holds.lift(self.db, agent, self.by, self.queue.clock(), self._agents())

    def _agents(self) -> frozenset[str]:
        return frozenset(self.catalog.agents) if self.catalog is not None else frozenset()

    # -- waiting ---------------------------------------------------------------

    def wait(self, task_id: int, *, timeout: float | None = None) -> Task:
        """Block until the task is done, failed, error or cancelled (a paused task
        keeps waiting); WaitTimeout after ``timeout`` seconds."""
        return self.wait_many([task_id], timeout=timeout)[0]

    def wait_many(
        self, task_ids: Sequence[int], *, timeout: float | None = None
    ) -> builtins.list[Task]:
        """Block until every task has ended; returns them in the order asked."""
        task_ids, timeout = checked_ids(task_ids), checked_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        self._listen()
        done: dict[int, Task] = {}
        look = FIRST_LOOK_SEC
        while True:
            generation = self._generation
            done.update(self.ended_among([i for i in task_ids if i not in done]))
            if len(done) == len(set(task_ids)):
                return [done[i] for i in task_ids]
            left = time_left(task_ids, done, deadline)
            pause = look if left is None else min(look, left)
            with self._ended:
                if self._generation == generation:  # nothing heard since the look
                    self._ended.wait(pause)
            look = min(look * 2, self._look_max())

    def ended_among(self, task_ids: Sequence[int]) -> dict[int, Task]:
        """Those of ``task_ids`` that have ended (one read; unknown ids raise)."""
        task_ids = checked_ids(task_ids)
        if not task_ids:
            return {}
        ends = [s.value for s in TERMINAL]
        query = sa.select(bus_commands).where(bus_commands.c.id.in_(list(task_ids)))
        rows = self.db.read(lambda conn: conn.execute(query).all())
        tasks = {int(r.id): Task.from_row(r._mapping) for r in rows}
        missing = sorted(set(task_ids) - set(tasks))
        if missing:
            raise TaskNotFound(f"task {missing[0]} does not exist")
        return {i: task for i, task in tasks.items() if task.status.value in ends}

    def _look_max(self) -> float:
        heard = self._listener is not None and self._listener.listening.is_set()
        return LISTENING_LOOK_MAX_SEC if heard else SQLITE_LOOK_MAX_SEC

    def _listen(self) -> None:
        """PostgreSQL: hear ended tasks from the first wait on (one connection)."""
        if self._listener is not None or self.db.listen_conninfo is None:
            return
        self._listener = wakeups.Listener(
            self.db.listen_conninfo,
            self._heard,
            channel=wakeups.ENDED,
            register=True,
            application_name=self.db.application_name,
        ).start()

    def _heard(self) -> None:
        with self._ended:
            self._generation += 1
            self._ended.notify_all()
        for wake in list(self._subscribers):
            wake()

    # -- closing ---------------------------------------------------------------

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close(wait=2.0)  # its connection closed before we return
        self.db.dispose()

    def __enter__(self) -> AgentBus:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
