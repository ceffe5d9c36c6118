"""``AsyncAgentBus``: the producer API for asyncio code, with ``AgentBus``'s methods.

Each call runs ``AgentBus``'s in a worker thread (``asyncio.to_thread``): one
implementation of every statement, guarantee and error, and a call that lasts
a database round trip holds a thread no longer than that. Waiting does not
hold a thread: a wait reads the tasks in a thread, then sleeps on the event
loop until the PostgreSQL listener hears a task settle (or its next look).

    async with AsyncAgentBus("postgresql+psycopg://…/agentbus") as bus:
        task_id = await bus.enqueue("codex", "Summarise", models=["sim/a"])
        task = await bus.wait(task_id, timeout=600)
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from agentbus.client import FIRST_LOOK_SEC, AgentBus, checked_ids, checked_timeout, time_left
from agentbus.config import Settings
from agentbus.queue.states import TaskStatus
from agentbus.queue.tasks import Task

if TYPE_CHECKING:
    from agentbus.admission.permits import CallPermit


class AsyncAgentBus:
    def __init__(
        self, url: str | None = None, *, settings: Settings | None = None, by: str = "api"
    ) -> None:
        self.sync = AgentBus(url, settings=settings, by=by)

    @contextlib.asynccontextmanager
    async def permit(
        self, model: str, *, agent: str, tokens: int | None = None
    ) -> AsyncIterator[CallPermit]:
        """As ``AgentBus.permit``: ``async with bus.permit("gpt-4o", agent="codex") as p``."""
        held = self.sync.permit(model, agent=agent, tokens=tokens)
        call = await asyncio.to_thread(held.__enter__)
        try:
            yield call
        except BaseException as exc:
            if not await asyncio.to_thread(held.__exit__, type(exc), exc, exc.__traceback__):
                raise
        else:
            await asyncio.to_thread(held.__exit__, None, None, None)

    async def enqueue(self, agent: str, text: str, **fields: Any) -> int:
        """As ``AgentBus.enqueue`` (``connection=`` takes a synchronous connection)."""
        return await asyncio.to_thread(self.sync.enqueue, agent, text, **fields)

    async def enqueue_many(self, items: Iterable[Mapping[str, Any]]) -> builtins.list[int]:
        return await asyncio.to_thread(self.sync.enqueue_many, list(items))

    async def get(self, task_id: int) -> Task:
        return await asyncio.to_thread(self.sync.get, task_id)

    async def list(
        self, *, status: TaskStatus | str | None = None, agent: str | None = None, limit: int = 50
    ) -> builtins.list[Task]:
        return await asyncio.to_thread(self.sync.list, status=status, agent=agent, limit=limit)

    async def cancel(self, *task_ids: int) -> builtins.list[int]:
        return await asyncio.to_thread(self.sync.cancel, *task_ids)

    async def resume(self, *task_ids: int) -> builtins.list[int]:
        return await asyncio.to_thread(self.sync.resume, *task_ids)

    async def retry(self, task_id: int) -> None:
        await asyncio.to_thread(self.sync.retry, task_id)

    async def pause_agent(self, agent: str, *, reason: str | None = None) -> bool:
        return await asyncio.to_thread(self.sync.pause_agent, agent, reason=reason)

    async def resume_agent(self, agent: str) -> bool:
        return await asyncio.to_thread(self.sync.resume_agent, agent)

    async def wait(self, task_id: int, *, timeout: float | None = None) -> Task:
        return (await self.wait_many([task_id], timeout=timeout))[0]

    async def wait_many(
        self, task_ids: Sequence[int], *, timeout: float | None = None
    ) -> builtins.list[Task]:
        bus = self.sync
        task_ids, timeout = checked_ids(task_ids), checked_timeout(timeout)
        loop = asyncio.get_running_loop()
        heard = asyncio.Event()

        def wake() -> None:  # from the listener's thread
            loop.call_soon_threadsafe(heard.set)

        deadline = None if timeout is None else time.monotonic() + timeout
        await asyncio.to_thread(bus._listen)
        bus._subscribers.append(wake)
        try:
            done: dict[int, Task] = {}
            look = FIRST_LOOK_SEC
            while True:
                heard.clear()
                pending = [i for i in task_ids if i not in done]
                done.update(await asyncio.to_thread(bus.ended_among, pending))
                if len(done) == len(set(task_ids)):
                    return [done[i] for i in task_ids]
                left = time_left(task_ids, done, deadline)
                with contextlib.suppress(TimeoutError):  # a look anyway
                    await asyncio.wait_for(heard.wait(), look if left is None else min(look, left))
                look = min(look * 2, bus._look_max())
        finally:
            bus._subscribers.remove(wake)

    async def close(self) -> None:
        await asyncio.to_thread(self.sync.close)

    async def __aenter__(self) -> AsyncAgentBus:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
