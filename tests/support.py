"""Helpers shared by the tests: an injected clock and a poll-until helper."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class FakeClock:
    """A clock the test moves by hand: time passes only when the test says so."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def wait_until(predicate: Callable[[], T], *, timeout: float = 30.0, every: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy (for process tests)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(every)
