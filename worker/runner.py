"""Run one claimed task through its model chain and decide what becomes of it.

The candidates come from admission (``agentbus.admission``): each is asked for
a permit right before its call, and one that is cooling or refused by a gate
is skipped. A rate-limited, overloaded or timed-out answer cools the model
(or, for a 429 through one of several accounts, that account's use of it)
down for every process (``model_cooldown``) and the next candidate is tried.
A refused credential makes the account unusable and the next one is tried. A
retryable error is retried in the call a few times (tenacity) before the
attempt counts as spent. The result is a ``policy.Decision``; this module
changes no task — the loop settles it through ``agentbus.queue``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import tenacity

from agentbus.admission.admission import Admission, Permit
from agentbus.admission.budget import ClientBudget, Reserve
from agentbus.admission.cooldowns import CooldownStore
from agentbus.admission.gates import Code, Refusal
from agentbus.admission.routing import Candidate
from agentbus.config import Settings
from agentbus.errors import ConfigError
from agentbus.logging import get_logger
from agentbus.providers import CallRequest, Provider, Providers
from agentbus.providers.outcomes import (
    AuthFailed,
    Failed,
    Outcome,
    RateLimited,
    Succeeded,
    TimedOut,
    name_of,
)
from agentbus.queue.tasks import InvalidTask, Task
from agentbus.worker import policy

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
        admission: Admission,
        cooldowns: CooldownStore,
        providers: Providers,
        worker_id: str,
        budget: ClientBudget | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.admission = admission
        self.budget = budget
        self.cooldowns = cooldowns
        self.providers = providers
        self.worker_id = worker_id
        self.clock = clock

    def run(self, task: Task) -> Run:
        if task.problem is not None:
            return Run(policy.Fail(task.problem))
        try:
            found = self.admission.resolve(models=task.models, role=task.role, agent=task.agent)
            self.providers.check(
                task.payload, tuple(dict.fromkeys(c.model for c in found.candidates))
            )
        except (ConfigError, InvalidTask) as exc:
            return Run(policy.Fail(exc.message))
        if self.budget is None:
            return self._walk(task, found.candidates, list(found.left_out))
        with self.budget.bulk_pass():  # one refused_batch for the whole candidate list
            return self._walk(task, found.candidates, list(found.left_out))

    def _admit(self, task: Task, candidate: Candidate) -> Permit | Refusal:
        """Admission, after a client-budget slot for the candidate's provider (if any)."""
        lease = self._lease(candidate)
        budget = self.budget
        if budget is not None and budget.try_reserve(candidate.provider, lease_sec=lease) is (
            Reserve.REFUSED
        ):
            return Refusal(
                Code.CLIENT_BUDGET,
                self.clock() + self.settings.admission_recheck_sec,
                f"the client budget ({budget.budget}) is full",
            )
        answer = self.admission.admit(candidate, agent=task.agent, task_id=task.id, lease_sec=lease)
        if isinstance(answer, Refusal) and self.budget is not None:
            self.budget.release(candidate.provider)
        return answer

    def _walk(self, task: Task, candidates: tuple[Candidate, ...], refused: list[str]) -> Run:
        run = Run(policy.Fail("unreachable"))
        blocked: dict[str, float] = {}
        codes: dict[str, str] = {}
        for candidate in candidates:
            started = self.clock()
            answer = self._admit(task, candidate)
            if isinstance(answer, Refusal):
                blocked[candidate.key] = answer.retry_after
                codes[candidate.key] = answer.code.value
                cooling = answer.code is Code.COOLDOWN
                if cooling:
                    run.skipped[candidate.key] = answer.retry_after
                log.info(
                    "model_skipped" if cooling else "candidate_refused",
                    task_id=task.id,
                    candidate=candidate.key,
                    code=answer.code.value,
                    retry_after_ms=answer.retry_after_ms(started),
                    detail=answer.detail,
                )
                run.routes.append(
                    self._route(
                        task, candidate, "skip" if cooling else "refuse", started, refusal=answer
                    )
                )
                continue
            with answer as permit:
                try:
                    outcome = self._call(task, candidate)
                except InvalidTask as exc:
                    run.decision = policy.Fail(exc.message)
                    return run
                finally:
                    if self.budget is not None:
                        self.budget.release(candidate.provider)
                self.admission.finish(permit, outcome)
            run.calls += 1
            route = self._route(
                task, candidate, "call", started, outcome=outcome, gates=permit.gates
            )
            run.routes.append(route)
            match outcome:
                case Succeeded(text=text, usage=usage):
                    log.debug("call_ok", task_id=task.id, candidate=candidate.key)
                    run.decision = policy.Complete(text, candidate.model, usage)
                    return run
                case RateLimited() | TimedOut():
                    accounts = len(self.admission.catalog.provider(candidate.provider).accounts)
                    key = policy.cooldown_key(outcome, candidate.model, candidate.key, accounts)
                    until = self.cooldowns.set(
                        key,
                        policy.cooldown_until(outcome, self.clock(), self.settings),
                        reason=type(outcome).__name__,
                        source=self.worker_id,
                    )
                    blocked[candidate.key] = run.cooled[key] = route["cooldown_until"] = until
                    log.info(
                        "model_cooldown_set",
                        task_id=task.id,
                        model=key,
                        until=round(until, 3),
                        detail=outcome.detail,
                    )
                case AuthFailed(detail=detail):
                    log.warning(
                        "credential_refused",
                        task_id=task.id,
                        candidate=candidate.key,
                        detail=detail,
                    )
                    self.admission.mark_unusable(candidate, detail)
                    refused.append(f"{candidate.key}: {detail}")
                case Failed():
                    log.info(
                        "call_failed",
                        task_id=task.id,
                        candidate=candidate.key,
                        retryable=outcome.retryable,
                        detail=outcome.detail,
                    )
                    run.decision = policy.after_failure(
                        outcome, task.attempts, task.max_attempts, self.clock(), self.settings
                    )
                    return run
        run.decision = policy.when_no_candidate_left(blocked, refused, codes)
        return run

    def _lease(self, candidate: Candidate) -> float:
        """How long a permit's slot is held at most: every try of the call, with margin."""
        timeout = self.admission.catalog.provider(candidate.provider).timeout_sec
        tries = self.settings.call_retries + 1
        waits = self.settings.call_retry_wait_sec * 2**tries
        return float((timeout or self.settings.call_timeout_sec) * tries + waits + 60.0)

    def _route(
        self,
        task: Task,
        c: Candidate,
        decision: str,
        at: float,
        *,
        refusal: Refusal | None = None,
        outcome: Outcome | None = None,
        gates: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        usage = outcome.usage if isinstance(outcome, Succeeded) else None
        model = self.admission.catalog.model(c.model) if usage is not None else None
        return {
            "task_id": task.id,
            "claim_token": task.claim_token,
            "agent": task.agent,
            "worker": self.worker_id,
            "model": c.model,
            "decision": decision,
            "outcome": name_of(outcome).value if outcome is not None else None,
            "cooldown_until": refusal.retry_after
            if refusal is not None and refusal.code is Code.COOLDOWN
            else None,
            "at": at,
            "role": c.role,
            "fallback_from": c.fallback_from,
            "provider": c.provider,
            "account": c.account or None,
            "code": refusal.code.value if refusal is not None else None,
            "retry_after": refusal.retry_after if refusal is not None else None,
            "gates": refusal.gates if refusal is not None else gates,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None,
            "cost": policy.cost(usage, model.input_cost_per_1k, model.output_cost_per_1k)
            if usage and model
            else None,
        }

    def _call(self, task: Task, candidate: Candidate) -> Outcome:
        provider, upstream = self.providers.for_model(candidate.model)
        request = CallRequest(
            task_id=task.id,
            model=candidate.model,
            upstream=upstream,
            prompt=task.command or "",
            worker=self.worker_id,
            timeout_sec=self.settings.call_timeout_sec,
            created_at=task.created_at,
            payload=task.payload,
            account=candidate.account,
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


def _call_once(provider: Provider, request: CallRequest) -> Outcome:
    return provider.call(request)
