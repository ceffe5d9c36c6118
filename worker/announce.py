"""A worker's start-up lines: what it runs with, and what it ignores or doubts."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from agentbus.admission.budget import WorkspaceBudget
from agentbus.admission.budget_setting import disagreement
from agentbus.clock import CLOCK_WARN_SEC, offset_of

if TYPE_CHECKING:
    from agentbus.worker.loop import Worker


def announce(worker: Worker) -> None:
    """The start-up lines: what the worker runs with, and what it ignores or doubts."""
    budget, clock = worker.budget, worker.queue.clock
    worker.log.info(
        "worker_started",
        agent=worker.options.agent,
        pid=os.getpid(),
        concurrency=worker.options.concurrency,
        client_budget=budget.mode,
        client_budget_size=budget.budget,
        client_budget_scope=budget.scope,
    )
    if isinstance(budget, WorkspaceBudget):
        ignored = disagreement(worker.config.settings, budget.setting)
        if ignored is not None:
            worker.log.warning("client_budget_flags_ignored", detail=ignored)
    clock()  # measured: the first heartbeat carries it
    if abs(offset_of(clock)) > CLOCK_WARN_SEC:
        worker.log.warning(
            "clock_off",
            offset_sec=round(offset_of(clock), 3),
            effect="this host's clock disagrees with the database's; the database's is used",
        )
