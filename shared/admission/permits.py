"""Permits for the calls agentbus does not make: an agent's own SDK calls, its sub-calls,
a judge model, under the admission every worker's call passes.

    with bus.permit("gpt-4o", agent="codex") as p:
        reply = client.chat.completions.create(...)
        p.report(usage={"prompt_tokens": 812, "completion_tokens": 96})

``Permits.permit`` asks admission for the model (each of its provider's accounts in
turn): cooldowns, rate windows, slots, bulkheads, circuits and budgets, shared with
every process through the database. A refusal raises ``agentbus.errors.Refused``.
What the block raises (an SDK's 429 with its ``retry-after``, a timeout), or what it
reports (``status``, ``headers``, ``usage``), teaches admission as a worker's own call
would: a 429 inside a permit cools the model for everyone. Leaving the block releases
the slot; a process that dies releases it by lease expiry.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from agentbus.admission import usage as ledger
from agentbus.admission.admission import Admission, Permit
from agentbus.admission.cooldowns import CooldownStore
from agentbus.admission.gates import Refusal
from agentbus.admission.routing import Candidate, Route
from agentbus.admission.tokens import Tokens
from agentbus.catalog.model import NAME_RE
from agentbus.config import Config, LiveConfig
from agentbus.db import Database
from agentbus.errors import ConfigError, InvalidTask, Refused
from agentbus.providers.outcomes import Outcome, Succeeded, Usage


class CallPermit:
    """Leave to make one call (what ``permit`` yields): ``model``, ``account``, and
    ``report`` to say what the call came to when it did not raise."""

    def __init__(self, admission: Admission, permit: Permit, tokens: int | None = None) -> None:
        self._admission = admission
        self._permit = permit
        self.tokens = tokens  # what the caller said the call uses, counted unless reported
        self.model = permit.candidate.model
        self.upstream = permit.candidate.upstream  # the name its provider knows it by
        self.account = permit.candidate.account
        self.outcome: Outcome | None = None

    def report(
        self,
        *,
        status: int = 200,
        headers: Mapping[str, str] | None = None,
        usage: Mapping[str, int] | None = None,
    ) -> None:
        """What the call answered: its HTTP ``status`` and ``headers`` (a 429's
        ``retry-after``, the rate-limit headers of a 200) and its token ``usage``
        (``prompt_tokens``, ``completion_tokens``, for the daily budgets)."""
        from agentbus.providers.http import learnt_from, status_outcome

        lowered = {str(k).lower(): str(v) for k, v in (headers or {}).items()}
        if status == 200:
            counted = (
                Usage(int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)))
                if usage is not None
                else Usage(self.tokens or 0)
            )
            self.outcome = learnt_from(Succeeded("", counted), lowered)
        else:
            detail = f"{self._permit.candidate.provider}: HTTP {status}"
            self.outcome = status_outcome(status, lowered, detail)


#: The most tokens one permit may say its call uses (a hundred million: past any model's
#: context and answer together).
MAX_PERMIT_TOKENS = 100_000_000


class Permits:
    """The admission of one producer process (``AgentBus.permit``)."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission  # a worker's own, for its python models' inner calls

    @classmethod
    def open(cls, db: Database, config: Config | LiveConfig, *, holder: str = "") -> Permits:
        """The permits of a process that has no admission of its own (a producer)."""
        settings = config.settings
        cooldowns = CooldownStore.configured(db, settings)
        admission = Admission(
            db,
            config,
            worker=holder or f"permit:{socket.gethostname()}:{os.getpid()}",
            cooldowns=cooldowns,
            environ=os.environ,
            cache_sec=settings.cooldown_cache_sec,
        )
        return cls(admission)

    @contextmanager
    def permit(self, model: str, *, agent: str, tokens: int | None = None) -> Iterator[CallPermit]:
        """``tokens``: what the call will use (its prompt and answer), held in the account's
        token windows and counted in the usage ledger, and so by the daily token budget,
        unless the block reports usage."""
        if tokens is not None and (
            isinstance(tokens, bool)
            or not isinstance(tokens, int)
            or not 0 <= tokens <= MAX_PERMIT_TOKENS
        ):
            raise InvalidTask(
                f"tokens must be a whole number from 0 to {MAX_PERMIT_TOKENS:,}, got {tokens!r}"
            )
        for label, name in (("model", model), ("agent", agent)):
            if not isinstance(name, str) or not NAME_RE.match(name):
                raise InvalidTask(f"invalid {label} name {name!r}")
        admission = self.admission
        catalog = admission.catalog
        if not catalog.knows(model):
            raise ConfigError(f"unknown model {model!r}: the config does not list it")
        if catalog.agents and agent not in catalog.agents:
            raise ConfigError(f"unknown agent {agent!r}: the config does not list it")
        resolved = admission.resolve(models=(model,), role=None, agent=agent)
        if not resolved.candidates:
            left_out = "; ".join(resolved.left_out) or "no account of its provider is usable"
            raise ConfigError(f"no permit for {model!r}: {left_out}")
        refusals: list[Refusal] = []
        need = Tokens(tokens, 0) if tokens is not None else None  # held in the token windows
        for candidate in resolved.candidates:  # each account of the model's provider
            answer = admission.admit(candidate, agent=agent, task_id=None, request=need)
            if isinstance(answer, Refusal):
                refusals.append(answer)
                continue
            call = CallPermit(admission, answer, tokens)
            with answer:  # the slot goes back whatever happens in the block
                try:
                    yield call
                except BaseException as exc:
                    said = call.outcome or _outcome_of(exc, candidate.provider)
                    admission.finish(answer, said)
                    self._count(agent, candidate, said)
                    raise
                said = call.outcome or Succeeded("", Usage(tokens or 0))
                admission.finish(answer, said)
                self._count(agent, candidate, said)
            return
        first = min(refusals, key=lambda r: r.retry_after)
        raise refused(first, admission.clock())

    def _count(self, agent: str, candidate: Candidate, outcome: Outcome | None) -> None:
        """The call in the usage ledger (its tokens and cost, counted by the daily
        budgets), as a worker's calls are; nothing for a block that made none."""
        if outcome is None:
            return
        usage = outcome.usage if isinstance(outcome, Succeeded) else Usage()
        admission = self.admission
        call = Route(
            0,
            0,
            agent,
            candidate.model,
            "call",
            admission.clock(),
            worker=admission.worker,
            provider=candidate.provider,
            account=candidate.account,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cost=admission.cost(candidate, usage),
        )

        db = admission.db
        if db.dialect == "postgresql":  # one statement in autocommit: no BEGIN, no COMMIT
            db.write_one(lambda conn: ledger.record(conn, [call]))
        else:  # its commit need not wait for the disk (a crash of the machine: the count)
            db.write(lambda conn: ledger.record(conn, [call]), durable=False)


def refused(refusal: Refusal, now: float) -> Refused:
    said = refusal.as_dict(now)
    return Refused(
        f"{refusal.code.value}: {refusal.detail} (retry in {said['retry_after_ms']} ms)",
        code=said["code"],
        name=refusal.code.value,
        reason=refusal.detail,
        retry_after_ms=said["retry_after_ms"],
        suggested_action=said["suggested_action"],
    )


def _outcome_of(exc: BaseException, provider: str) -> Outcome | None:
    """What the block's exception says of the call: an SDK's error as its HTTP answer,
    a timeout, a lost connection. Anything else (a bug of the caller's, a refusal of
    an inner permit) says nothing of the model: the slot goes back, nothing is learnt."""
    from agentbus.providers.python import outcome_of

    return None if isinstance(exc, Refused) else outcome_of(exc, provider)
