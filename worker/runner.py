"""Run one claimed task through its model chain and decide what becomes of it.

The candidates come from admission (``agentbus.admission``): each is asked for
a permit right before its call, and one that is cooling or refused by a gate
is skipped. The call's outcome goes back to admission, which cools the model
down for every process on a rate-limited, overloaded or timed-out answer and
leaves a refused credential out; the next candidate is then tried. A
retryable error is retried in the call a few times (tenacity) before the
attempt counts as spent. The result is a ``Decision``; this module changes no
task — the loop settles it through ``agentbus.queue``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentbus.admission import tokens
from agentbus.admission.admission import Admission
from agentbus.admission.gates import Code, Refusal
from agentbus.admission.permits import Permits
from agentbus.admission.routing import Candidate, Route
from agentbus.config import Settings
from agentbus.errors import ConfigError, InvalidTask, Refused
from agentbus.logging import get_logger, when
from agentbus.process_metrics import Observations
from agentbus.providers import CallRequest, Provider, Providers, chat, outcomes
from agentbus.providers.base import HandlerCrashed
from agentbus.providers.outcomes import Outcome
from agentbus.queue.decisions import Crash, Decision, Fail, Settlement
from agentbus.queue.states import TaskStatus
from agentbus.queue.tasks import Task
from agentbus.worker import policy

log = get_logger("agentbus.worker")

#: A run's outcome, as the task-run histogram labels it: the status it leads to, or
#: "retry" for a task queued again after a spent attempt.
OUTCOMES = {
    policy.Complete: TaskStatus.DONE.value,
    policy.Pause: TaskStatus.PAUSED.value,
    policy.Requeue: "retry",
    Fail: TaskStatus.FAILED.value,
    policy.Expire: TaskStatus.CANCELLED.value,
}


@dataclass
class Run:
    """The decision for one task, with what the worker saw on the way (for the event log)."""

    decision: Decision
    skipped: dict[str, float] = field(default_factory=dict)  # cooling when looked at
    cooled: dict[str, float] = field(default_factory=dict)  # put in cooldown by this run
    calls: int = 0
    routes: list[Route] = field(default_factory=list)
    # candidate -> why it could not be used now ({code, name, retry_after_ms, …})
    refusals: dict[str, dict[str, Any]] = field(default_factory=dict)

    def settlement(self, task: Task) -> Settlement:
        """What the queue is handed to settle the task's claim."""
        detail: dict[str, Any] = {}
        if self.skipped:
            detail["skipped"] = self.skipped
        if self.cooled:
            detail["cooled"] = self.cooled
        if self.refusals and isinstance(self.decision, policy.Pause):
            detail["refusals"] = self.refusals
        return Settlement(task.id, task.claim_token, self.decision, self.routes, detail or None)


class Runner:
    def __init__(
        self,
        *,
        admission: Admission,
        providers: Providers,
        worker_id: str,
        clock: Callable[[], float] = time.time,
        observed: Observations | None = None,
    ) -> None:
        self.admission = admission
        self.permits = Permits(admission)  # for the inner calls of python models
        self.providers = providers
        self.worker_id = worker_id
        # Bound once, as the worker's own logger is: a line names its worker, and a
        # line per call does not assemble a logger (structlog's proxy does, each time).
        self.log = log.bind(worker=worker_id)
        self.clock = clock
        self.observed = observed or Observations()

    @property
    def settings(self) -> Settings:
        return self.admission.settings  # the live settings: a reload applies to the next task

    def run(self, task: Task, gone: Callable[[], bool] = lambda: False) -> Run:
        """``gone()`` says the claim was lost (the task was cancelled or rescued): no
        further candidate is tried, and the worker discards the run. Its time is
        observed by outcome (an exception: ``error``)."""
        began, outcome = time.monotonic(), TaskStatus.ERROR.value
        try:
            run = self._run(task, gone)
            outcome = OUTCOMES.get(type(run.decision), "other")
            return run
        finally:
            labels = {"agent": task.agent, "outcome": outcome}
            self.observed.observe("agentbus_task_run_seconds", labels, time.monotonic() - began)

    def _run(self, task: Task, gone: Callable[[], bool]) -> Run:
        if task.problem is not None:
            return Run(Fail(task.problem))
        too_late = policy.expired(task.expires_at, self.clock())
        if too_late is not None:
            return Run(too_late)
        try:
            found = self.admission.resolve(models=task.models, role=task.role, agent=task.agent)
            self.providers.check(
                task.payload, tuple(dict.fromkeys(c.model for c in found.candidates))
            )
        except (ConfigError, InvalidTask) as exc:
            return Run(Fail(exc.message))
        with self.admission.walk():
            run = self._walk(task, found.candidates, list(found.left_out), gone)
        run.decision = policy.by_deadline(run.decision, task.expires_at)
        return run

    def _walk(
        self,
        task: Task,
        candidates: tuple[Candidate, ...],
        refused: list[str],
        gone: Callable[[], bool],
    ) -> Run:
        run = Run(Fail("unreachable"))
        blocked: dict[str, float] = {}
        request = tokens.Request(task.command or "", task.payload)
        for candidate in candidates:
            if gone():
                run.decision = Fail("the claim was lost")
                return run
            started = self.clock()
            answer = self.admission.admit(
                candidate, agent=task.agent, task_id=task.id, request=request
            )
            if isinstance(answer, Refusal):
                cooling = answer.code is Code.COOLDOWN
                self._refused(run, task, candidate, answer, started, blocked, cooling=cooling)
                if answer.code is Code.TOO_LARGE:  # never admitted: as a refused credential
                    refused.append(f"{candidate.key}: {answer.detail}")
                continue
            with answer as permit:
                began = time.monotonic()
                try:
                    outcome = self._call(task, candidate)
                except InvalidTask as exc:
                    run.decision = Fail(exc.message)
                    return run
                except HandlerCrashed as exc:  # the user's own code, called as a model
                    run.decision = Crash(f"{candidate.key}: {exc.message}")
                    return run
                except Refused as exc:  # a permit of the handler's own was refused
                    # A gate of another model's: this candidate is not cooling.
                    at = started + exc.retry_after_ms / 1000
                    why = f"an inner permit: {exc.reason}"
                    refusal = Refusal(Code(exc.name), at, why, "permit")
                    self._refused(run, task, candidate, refusal, started, blocked, cooling=False)
                    continue
                labels = {
                    "agent": task.agent,
                    "model": candidate.model,
                    "outcome": outcomes.name_of(outcome).value,
                }
                self.observed.observe("agentbus_call_seconds", labels, time.monotonic() - began)
                cooled = self.admission.finish(permit, outcome)
            run.calls += 1
            run.routes.append(
                self._route(
                    task,
                    candidate,
                    "call",
                    started,
                    outcome=outcome,
                    gates=permit.gates,
                    cooldown_until=cooled.until if cooled is not None else None,
                )
            )
            if cooled is not None and isinstance(outcome, outcomes.Succeeded):
                # Answered, and its headers said the account has nothing left until then.
                run.cooled[cooled.key] = cooled.until
                self.log.info(
                    "model_cooldown_set",
                    task_id=task.id,
                    model=cooled.key,
                    until=when(cooled.until),
                    detail="the answer's rate-limit headers say nothing is left",
                )
            match outcome:
                case outcomes.Succeeded(text=text, usage=usage):
                    self.log.debug("call_ok", task_id=task.id, candidate=candidate.key)
                    detail = outcome.detail(candidate.model)
                    run.decision = policy.Complete(text, candidate.model, usage, detail)
                    return run
                case outcomes.RateLimited() | outcomes.TimedOut():
                    assert cooled is not None
                    blocked[candidate.key] = run.cooled[cooled.key] = cooled.until
                    answered = outcomes.name_of(outcome).value
                    why = f"{cooled.key} cools down: the call answered {answered}"
                    cooldown = Refusal(Code.COOLDOWN, cooled.until, why, "cooldown")
                    run.refusals[candidate.key] = cooldown.as_dict(self.clock())
                    self.log.info(
                        "model_cooldown_set",
                        task_id=task.id,
                        model=cooled.key,
                        until=when(cooled.until),
                        detail=outcome.detail,
                    )
                case outcomes.AuthFailed(detail=detail):
                    self.log.warning(
                        "credential_refused",
                        task_id=task.id,
                        candidate=candidate.key,
                        detail=detail,
                    )
                    refused.append(f"{candidate.key}: {detail}")
                case outcomes.Failed():
                    self.log.info(
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
        codes = {key: refusal["name"] for key, refusal in run.refusals.items()}
        run.decision = policy.when_no_candidate_left(blocked, refused, codes)
        return run

    def _refused(
        self,
        run: Run,
        task: Task,
        candidate: Candidate,
        refusal: Refusal,
        at: float,
        blocked: dict[str, float],
        *,
        cooling: bool,
    ) -> None:
        """A candidate not usable now: skipped while it cools, refused by a gate else (and
        for good when the call is too large for it: nothing to wait for)."""
        if refusal.code is not Code.TOO_LARGE:
            blocked[candidate.key] = refusal.retry_after
        run.refusals[candidate.key] = refusal.as_dict(at)
        if cooling:
            run.skipped[candidate.key] = refusal.retry_after
        self.log.info(
            "model_skipped" if cooling else "candidate_refused",
            task_id=task.id,
            candidate=candidate.key,
            code=refusal.code.value,
            retry_after_ms=refusal.retry_after_ms(at),
            detail=refusal.detail,
        )
        decision = "skip" if cooling else "refuse"
        run.routes.append(self._route(task, candidate, decision, at, refusal=refusal))

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
        cooldown_until: float | None = None,
    ) -> Route:
        usage = outcome.usage if isinstance(outcome, outcomes.Succeeded) else None
        if refusal is not None and refusal.code is Code.COOLDOWN:
            cooldown_until = refusal.retry_after
        return Route(
            task.id,
            task.claim_token,
            task.agent,
            c.model,
            decision,
            at,
            worker=self.worker_id,
            outcome=outcomes.name_of(outcome).value if outcome is not None else None,
            cooldown_until=cooldown_until,
            role=c.role,
            fallback_from=c.fallback_from,
            provider=c.provider,
            account=c.account or None,
            code=refusal.code.value if refusal is not None else None,
            retry_after=refusal.retry_after if refusal is not None else None,
            gates=refusal.gates if refusal is not None else gates,
            refusal=refusal.as_dict(at) if refusal is not None else None,
            prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=usage.completion_tokens if usage else None,
            cost=self.admission.cost(c, usage) if usage else None,
        )

    def _call(self, task: Task, candidate: Candidate) -> Outcome:
        provider, model = self.providers.for_model(candidate.model)
        request = CallRequest(
            task_id=task.id,
            model=candidate.model,
            upstream=model.upstream,
            prompt=task.command or "",
            worker=self.worker_id,
            timeout_sec=self.settings.call_timeout_sec,
            created_at=task.created_at,
            payload=task.payload,
            params=chat.params_for(model.params, task.payload),
            account=candidate.account,
            permit=functools.partial(self.permits.permit, agent=task.agent),
        )
        outcome = provider.call(request)
        if (
            not (isinstance(outcome, outcomes.Failed) and outcome.retryable)
            or not self.settings.call_retries
        ):
            return outcome
        # A retryable error: a few more tries in the call, waiting 1x, 2x, 4x … the base.
        wait = self.settings.call_retry_wait_sec
        time.sleep(wait)
        import tenacity  # only after a retryable failure

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_result(
                lambda o: isinstance(o, outcomes.Failed) and o.retryable
            ),
            stop=tenacity.stop_after_attempt(self.settings.call_retries),
            wait=tenacity.wait_exponential(multiplier=2 * wait),
            retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
        )
        retried: Outcome = retrying(_call_once, provider, request)
        return retried


def _call_once(provider: Provider, request: CallRequest) -> Outcome:
    return provider.call(request)
