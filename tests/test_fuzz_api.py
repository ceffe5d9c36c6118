"""The producer API fed anything (hypothesis): every method of ``AgentBus`` and
``AsyncAgentBus``, one parameter at a time given an arbitrary value, answers with a
result or a ``BusError`` whose one-line message names that parameter, never another
exception; and a refused call writes nothing."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st

from agentbus import AgentBus, AsyncAgentBus
from agentbus.errors import BusError
from agentbus.schema import bus_commands, task_events
from tests.fuzzing import FUZZ

# Anything a careless or hostile caller may hand over.
anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**63, -(2**63) - 1, 10**400]),
    st.floats(),  # nan and both infinities among them
    st.binary(max_size=20),
    st.text(st.characters(), max_size=30),  # lone surrogates, NULs, any plane
    st.sampled_from(["x" * 2_000_000, "\x00", "\ud800", ""]),
    st.datetimes(),
    st.datetimes(timezones=st.just(UTC)),
    st.recursive(
        st.none() | st.integers() | st.text(max_size=5) | st.floats(),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
        max_leaves=8,
    ),
    st.integers(1, 3).map(lambda k: tuple(f"m{i}" for i in range(10_000 * k))),  # long chains
    st.just(object()),
)

#: enqueue's parameters, each with a value that works; the fuzz changes one at a time.
GOOD = {
    "agent": "codex",
    "text": "Summarise the news",
    "models": ["sim/a", "sim/b"],
    "role": None,
    "payload": {"n": 1},
    "priority": 0,
    "delay_sec": 0.0,
    "run_at": None,
    "max_attempts": 3,
    "key": None,
}
#: The words a refusal of each parameter says (its name, or how the message spells it).
NAMED = {
    "agent": ("agent",),
    "text": ("text",),
    "models": ("model",),
    "role": ("role",),
    "payload": ("payload",),
    "priority": ("priority",),
    "delay_sec": ("delay_sec", "run-after"),
    "run_at": ("run_at", "run-after"),
    "max_attempts": ("max_attempts", "max-attempts"),
    "key": ("key",),
    "task_id": ("task",),
    "task_ids": ("task",),
    "timeout": ("timeout",),
    "status": ("status",),
    "limit": ("limit",),
    "model": ("model",),
    "tokens": ("tokens",),
    "items": ("item", "task"),
}


def written(bus: AgentBus) -> tuple[int, int]:
    def count(conn: sa.Connection) -> tuple[int, int]:
        tasks = conn.execute(sa.select(sa.func.count()).select_from(bus_commands)).scalar_one()
        events = conn.execute(sa.select(sa.func.count()).select_from(task_events)).scalar_one()
        return tasks, events

    return bus.db.read(count)


def refused_well(exc: BusError, parameter: str) -> None:
    message = str(exc)
    assert message and "\n" not in message, message
    assert any(word in message for word in NAMED[parameter]), (parameter, message)


def answer(call: Callable[[], Any], bus: AgentBus, parameter: str) -> Any:
    """The call's result, or None after checking its refusal: a ``BusError`` naming
    ``parameter`` that wrote nothing. Any other exception fails the test."""
    before = written(bus)
    try:
        return call()
    except BusError as exc:
        refused_well(exc, parameter)
        assert written(bus) == before
        return None


def test_enqueue_takes_anything_in_any_parameter(db_url: str) -> None:
    with AgentBus(db_url) as bus:

        @FUZZ
        @given(st.sampled_from(sorted(GOOD)), anything)
        def check(parameter: str, value: Any) -> None:
            fields = {**GOOD, parameter: value}
            agent, text = fields.pop("agent"), fields.pop("text")
            task_id = answer(lambda: bus.enqueue(agent, text, **fields), bus, parameter)
            assert task_id is None or isinstance(task_id, int)

        check()


def test_enqueue_many_takes_anything_as_items(db_url: str) -> None:
    item = st.dictionaries(st.sampled_from([*GOOD, "bogus"]), anything, max_size=4).map(
        lambda d: {**GOOD, **d}
    )
    with AgentBus(db_url) as bus:

        @FUZZ
        @given(st.one_of(anything, st.lists(item | anything, max_size=3)))
        def check(items: Any) -> None:
            before = written(bus)
            try:
                ids = bus.enqueue_many(items)
            except BusError as exc:
                assert str(exc) and "\n" not in str(exc)
                assert written(bus) == before
            else:
                assert all(isinstance(i, int) for i in ids)

        check()


def test_reads_and_steering_take_anything(db_url: str) -> None:
    """get, list, cancel, resume, retry, ended_among, and wait on a database whose every
    task has ended (so no wait can last longer than its first look)."""
    with AgentBus(db_url) as bus:
        ended = bus.enqueue("codex", "x", models=["sim/a"])
        bus.cancel(ended)
        ids = st.one_of(anything, st.just(ended), st.integers(-3, ended + 3))
        calls: dict[str, Callable[[Any], Any]] = {
            "get": lambda v: bus.get(v),
            "list status": lambda v: bus.list(status=v),
            "list agent": lambda v: bus.list(agent=v),
            "list limit": lambda v: bus.list(limit=v),
            "cancel": lambda v: bus.cancel(v, ended),
            "resume": lambda v: bus.resume(v),
            "retry": lambda v: bus.retry(v),
            "ended_among": lambda v: bus.ended_among(v),
            "wait": lambda v: bus.wait(v, timeout=5),
            "wait timeout": lambda v: bus.wait(ended, timeout=v),
            "wait_many": lambda v: bus.wait_many(v, timeout=5),
        }
        parameter = {
            "list status": "status",
            "list agent": "agent",
            "list limit": "limit",
            "wait timeout": "timeout",
            "ended_among": "task_ids",
            "wait_many": "task_ids",
        }

        @FUZZ
        @given(st.sampled_from(sorted(calls)), ids)
        def check(name: str, value: Any) -> None:
            if name == "retry" and value == ended:  # a retry queues it: not what is fuzzed
                return
            answer(lambda: calls[name](value), bus, parameter.get(name, "task_id"))

        check()


def test_permit_takes_anything(db_url: str) -> None:
    with AgentBus(db_url) as bus:

        @FUZZ
        @given(st.sampled_from(["model", "agent", "tokens"]), anything)
        def check(parameter: str, value: Any) -> None:
            args = {"model": "sim/a", "agent": "codex", "tokens": 10, parameter: value}

            def call() -> None:
                with bus.permit(args["model"], agent=args["agent"], tokens=args["tokens"]):
                    pass

            answer(call, bus, parameter)

        check()


def test_the_async_bus_takes_anything(db_url: str) -> None:
    counter = itertools.count()

    async def main(bus: AsyncAgentBus, parameter: str, value: Any) -> None:
        sync = bus.sync
        before = written(sync)
        try:
            if parameter in GOOD:
                fields = {**GOOD, parameter: value, "key": f"k{next(counter)}"}
                agent, text = fields.pop("agent"), fields.pop("text")
                await bus.enqueue(agent, text, **fields)
            elif parameter == "timeout":
                await bus.wait(ended, timeout=value)
            elif parameter == "task_ids":
                await bus.wait_many(value, timeout=5)
            else:
                await bus.get(value)
        except BusError as exc:
            refused_well(exc, parameter)
            assert written(sync) == before

    loop = asyncio.new_event_loop()
    bus = AsyncAgentBus(db_url)
    ended = bus.sync.enqueue("codex", "x", models=["sim/a"])
    bus.sync.cancel(ended)
    try:

        @FUZZ
        @given(st.sampled_from([*GOOD, "timeout", "task_ids", "task_id"]), anything)
        def check(parameter: str, value: Any) -> None:
            loop.run_until_complete(main(bus, parameter, value))

        check()
    finally:
        loop.run_until_complete(bus.close())
        loop.close()


@pytest.mark.parametrize(
    ("fields", "parameter"),
    [
        ({"payload": [1, 2]}, "payload"),
        ({"priority": "high"}, "priority"),
        ({"text": b"Summarise"}, "text"),
        ({"models": [f"m{i}" for i in range(10_000)]}, "models"),
        ({"delay_sec": "soon"}, "delay_sec"),
        ({"run_at": datetime(2026, 1, 1)}, "run_at"),
        ({"run_at": datetime.now(timezone(timedelta(hours=14))) + timedelta(days=10**5)}, "run_at"),
        ({"max_attempts": math.inf}, "max_attempts"),
        ({"key": 5}, "key"),
    ],
)
def test_the_cases_once_found(db_url: str, fields: dict[str, Any], parameter: str) -> None:
    """Type confusion that used to raise TypeError or ValueError, or was let in."""
    with AgentBus(db_url) as bus:
        args = {**GOOD, **fields}
        agent, text = args.pop("agent"), args.pop("text")
        with pytest.raises(BusError) as refused:
            bus.enqueue(agent, text, **args)
        refused_well(refused.value, parameter)
        assert written(bus) == (0, 0)
