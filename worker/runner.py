"""Run one claimed task through its model chain and decide what becomes of it.

Cooling models are skipped without a call. A rate-limited, overloaded or
timed-out answer cools the model down for every process (``model_cooldown``)
and the next candidate is tried. A refused credential skips that model. A
retryable error is retried in the call a few times (tenacity) before the
attempt counts as spent. The result is a ``policy.Decision``; this module
changes no task — the loop settles it through ``shared.queue``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import tenacity

from shared.catalog import Catalog
from shared.config import Settings
from shared.cooldowns import CooldownStore
from shared.errors import ConfigError
from shared.logging import get_logger
from shared.outcomes import AuthFailed, Failed, Outcome, RateLimited, Succeeded, TimedOut
from shared.providers import CallRequest, Provider, Providers
from shared.tasks import InvalidTask, Task
from worker import policy

log = get_logger("agentbus.worker")


@dataclass
class Run:
    """The decision for one task, with what the worker saw on the way (for the event log)."""

    decision: policy.Decision
    skipped: dict[str, float] = field(default_factory=dict)  # cooling when looked at
    cooled: dict[str, float] = field(default_factory=dict)  # put in cooldown by this run
    calls: int = 0
    routes: list[dict[str, Any]] = field(default_factory=list)  # rows of route_log

    def detail(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.skipped:
            out["skipped"] = self.skipped
        if self.cooled:
            out["cooled"] = self.cooled
        return out


class Runner:
    def __init__(
        self,
        *,
        settings: Settings,
        catalog: Catalog,
        cooldowns: CooldownStore,
        providers: Providers,
        worker_id: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.cooldowns = cooldowns
        self.providers = providers
        self.worker_id = worker_id
        self.clock = clock

    def run(self, task: Task) -> Run:
        if task.problem is not None:
            return Run(policy.Fail(task.problem))
        try:
            chain = self.catalog.chain_for(models=task.models, role=task.role, agent=task.agent)
            self.providers.check(task.payload, chain)
        except (ConfigError, InvalidTask) as exc:
            return Run(policy.Fail(exc.message))
        cooling = self.cooldowns.cooling(chain)
        run = Run(policy.Fail("unreachable"), skipped=dict(cooling))
        refused: list[str] = []
        for model in chain:
            started = self.clock()
            if model in cooling:
                log.info(
                    "model_skipped",
                    task_id=task.id,
                    model=model,
                    cooldown_left=round(cooling[model] - started, 1),
                )
                run.routes.append(self._route(task, model, "skip", None, cooling[model], started))
                continue
            try:
                outcome = self._call(task, model)
            except InvalidTask as exc:
                run.decision = policy.Fail(exc.message)
                return run
            run.calls += 1
            route = self._route(task, model, "call", outcome_name(outcome), None, started)
            run.routes.append(route)
            match outcome:
                case Succeeded(text=text, usage=usage):
                    log.debug("call_ok", task_id=task.id, model=model)
                    run.decision = policy.Complete(text, model, usage)
                    return run
                case RateLimited() | TimedOut():
                    until = self.cooldowns.set(
                        model,
                        policy.cooldown_until(outcome, self.clock(), self.settings),
                        reason=type(outcome).__name__,
                        source=self.worker_id,
                    )
                    cooling[model] = run.cooled[model] = route["cooldown_until"] = until
                    log.info(
                        "model_cooldown_set",
                        task_id=task.id,
                        model=model,
                        until=round(until, 3),
                        detail=outcome.detail,
                    )
                case AuthFailed(detail=detail):
                    log.warning("credential_refused", task_id=task.id, model=model, detail=detail)
                    refused.append(f"{model}: {detail}")
                case Failed():
                    log.info(
                        "call_failed",
                        task_id=task.id,
                        model=model,
                        retryable=outcome.retryable,
                        detail=outcome.detail,
                    )
                    run.decision = policy.after_failure(
                        outcome, task.attempts, task.max_attempts, self.clock(), self.settings
                    )
                    return run
        run.decision = policy.when_no_candidate_left(cooling, refused)
        return run

    def _route(
        self,
        task: Task,
        model: str,
        decision: str,
        outcome: str | None,
        until: float | None,
        at: float,
    ) -> dict[str, Any]:
        return {
            "task_id": task.id,
            "claim_token": task.claim_token,
            "agent": task.agent,
            "worker": self.worker_id,
            "model": model,
            "decision": decision,
            "outcome": outcome,
            "cooldown_until": until,
            "at": at,
        }

    def _call(self, task: Task, model: str) -> Outcome:
        provider, upstream = self.providers.for_model(model)
        request = CallRequest(
            task_id=task.id,
            model=model,
            upstream=upstream,
            prompt=task.command or "",
            worker=self.worker_id,
            timeout_sec=self.settings.call_timeout_sec,
            created_at=task.created_at,
            payload=task.payload,
        )
        outcome = provider.call(request)
        if (
            not (isinstance(outcome, Failed) and outcome.retryable)
            or not self.settings.call_retries
        ):
            return outcome
        # A retryable error: a few more tries in the call, waiting 1x, 2x, 4x … the base.
        wait = self.settings.call_retry_wait_sec
        time.sleep(wait)
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_result(lambda o: isinstance(o, Failed) and o.retryable),
            stop=tenacity.stop_after_attempt(self.settings.call_retries),
            wait=tenacity.wait_exponential(multiplier=2 * wait),
            retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
        )
        retried: Outcome = retrying(_call_once, provider, request)
        return retried


def outcome_name(outcome: Outcome) -> str:
    """How route_log names an outcome."""
    match outcome:
        case Succeeded():
            return "ok"
        case RateLimited(overloaded=True):
            return "overloaded"
        case RateLimited():
            return "rate_limited"
        case TimedOut():
            return "timeout"
        case AuthFailed():
            return "auth"
        case Failed(retryable=True):
            return "error"
        case _:
            return "fatal"


def _call_once(provider: Provider, request: CallRequest) -> Outcome:
    return provider.call(request)
