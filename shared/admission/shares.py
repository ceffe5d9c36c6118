"""Fair shares of a provider account's windows (rpm, tpm, itpm, otpm, and a model's
own token windows through it), and of its provider's slots in flight
(``concurrency``), among the agents that contend for them.

An agent refused by an account's window waits for it: ``Demand.note`` writes it
to ``account_demand`` with its share (``[agents.X] share``, default 1) until a
little after the refusal said it may come back (when its paused task is tried
again). While other agents wait for the account, an admission through it is
decided by ``fair`` as well as by the windows: an agent may use its part of
each window (the window's limit times its share over the shares of itself and
the agents waiting), the rest being kept for the waiting agents; a call larger
than its part goes one at a time. So every agent with work gets its part at
least, and an agent with none (no refusal waiting, or a wait that lapsed
because it did not come back) leaves its part to the others: a part is kept
for an agent only while it waits.

Reservations per agent, not a rotation: the windows already say, in the
database, what each agent has used over the last minute, so the decision needs
no turn-taking state shared between processes, holds across every process and
host at once, and is the same for a window whose agents each hold a worker or a
hundred. No agent waiting (the common case): one ``EXISTS`` in the admission's
statement, nothing more.

The slots are shared out alike: an agent refused a slot (``provider_concurrency``)
waits for the provider's slots (account ``SLOTS``), and while it does no other
agent holds more than its part of them in flight (one, if its part is less).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.admission.gates import Code, Refusal
from agentbus.admission.tokens import TOKENS_OF
from agentbus.db import dialect_insert
from agentbus.schema import account_demand, call_slots

if TYPE_CHECKING:
    from agentbus.admission.limits import Limits
    from agentbus.admission.routing import Candidate
    from agentbus.admission.tokens import Tokens
    from agentbus.catalog import Catalog
    from agentbus.config import Configured
    from agentbus.db import Database

#: The gates whose refusal says an agent waits for its account's windows or its
#: provider's slots in flight.
GATES = frozenset(
    {"rpm", "tpm", "itpm", "otpm", "model_tpm", "model_itpm", "model_otpm"}
    | {"share", "provider_concurrency"}
)
#: The ``account`` of a wait for a provider's slots in flight (its ``concurrency``, which
#: its accounts share): no account is named so.
SLOTS = "*"

_D = account_demand.c


def others_waiting(now: Any) -> Any:
    """SQL: whether another agent waits for the account or its provider's slots
    (``p_provider``, ``p_account``; not ``p_agent``) at ``now``."""
    return sa.exists().where(
        _D.provider == sa.bindparam("p_provider", type_=sa.Text),
        sa.or_(_D.account == sa.bindparam("p_account", type_=sa.Text), _D.account == SLOTS),
        _D.agent != sa.bindparam("p_agent", type_=sa.Text),
        _D.until > now,
    )


def fair(
    limit: float, need: float, used: Mapping[str, float], shares: Mapping[str, float], agent: str
) -> bool:
    """Whether ``agent`` may take ``need`` more of a window of ``limit`` whose agents
    have ``used`` so much of it, ``shares`` being the shares of ``agent`` and of every
    agent waiting: within its part (the rest is kept for the waiting agents), or, for
    a call larger than its part, one at a time while the window has room."""
    mine = used.get(agent, 0)
    if mine + need <= limit * shares[agent] / sum(shares.values()):
        return True
    return mine == 0 and sum(used.values()) + need <= limit


def check(
    conn: Connection,
    limits: Limits,
    c: Candidate,
    agent: str,
    need: Tokens,
    now: float,
    recheck: float,
) -> Refusal | None:
    """The refusal of the fair share of ``c``'s account, or of its provider's slots, for
    ``agent`` (None: it may go on), when other agents wait for them. Run under the
    account's and the provider's locks; ``recheck``: when a slot may have freed."""
    rows = list(
        conn.execute(
            sa.select(_D.agent, _D.account, _D.share, _D.until).where(
                _D.provider == c.provider,
                sa.or_(_D.account == c.account, _D.account == SLOTS),
                _D.agent != agent,
                _D.until > now,
            )
        )
    )
    windows = [row for row in rows if row.account != SLOTS]
    refusal = _windows(conn, limits, c, agent, need, now, windows) if windows else None
    slot_rows = [row for row in rows if row.account == SLOTS]
    if refusal is None and slot_rows and limits.provider_concurrency:
        refusal = _slots(conn, limits, c, agent, now, recheck, slot_rows)
    return refusal


def _slots(
    conn: Connection,
    limits: Limits,
    c: Candidate,
    agent: str,
    now: float,
    recheck: float,
    rows: list[Any],
) -> Refusal | None:
    """The fair share of the provider's slots in flight (its ``concurrency``) while the
    agents of ``rows`` wait for them: no agent holds more than its part (one, if its
    part is less) while another waits. When one of its calls ends is unknown: it asks
    again at ``recheck``, or when a wait lapses."""
    limit, share = limits.provider_concurrency or 0, limits.share
    waiting = {row.agent: float(row.share) for row in rows}
    shares = {**waiting, agent: share}
    slots = call_slots.c
    held = {
        row.agent: float(row.held)
        for row in conn.execute(
            sa.select(slots.agent, sa.func.count().label("held"))
            .where(slots.provider == c.provider, slots.released_at.is_(None))
            .where(slots.lease_until > now)
            .group_by(slots.agent)
        )
    }
    if fair(limit, 1, held, shares, agent):
        return None
    part = limit * share / sum(shares.values())
    retry = min(recheck, min(float(row.until) for row in rows))
    detail = (
        f"share: agent {agent} has {held.get(agent, 0):g} of its {part:g} of the {limit} "
        f"calls in flight for {c.provider} while {_others(waiting)}"
    )
    return Refusal(Code.CONCURRENCY_FULL, retry, detail, "share")


def _others(waiting: Mapping[str, float]) -> str:
    n = len(waiting)
    return f"{n} other agent{'s wait' if n != 1 else ' waits'}"


def _windows(
    conn: Connection,
    limits: Limits,
    c: Candidate,
    agent: str,
    need: Tokens,
    now: float,
    rows: list[Any],
) -> Refusal | None:
    """The fair share of the account's windows while the agents of ``rows`` wait."""
    share = limits.share
    waiting = {row.agent: float(row.share) for row in rows}
    lapse = min(float(row.until) for row in rows)  # a wait ends unless its agent comes back
    shares = {**waiting, agent: share}
    window = limits.token_window  # the rpm window, which the token windows share
    since = now - window
    slots = call_slots.c
    mine = slots.agent == agent
    of_model = slots.model == c.model  # a model's own windows count its calls alone
    used: dict[str, dict[str, float]] = {}
    for row in conn.execute(
        sa.select(
            slots.agent,
            sa.func.count(slots.account_seq),
            sa.func.coalesce(sa.func.sum(slots.tokens_in), 0),
            sa.func.coalesce(sa.func.sum(slots.tokens_out), 0),
            sa.func.coalesce(sa.func.sum(sa.case((of_model, slots.tokens_in))), 0),
            sa.func.coalesce(sa.func.sum(sa.case((of_model, slots.tokens_out))), 0),
        )
        .where(slots.provider == c.provider, slots.account == c.account, slots.admitted_at > since)
        .group_by(slots.agent)
    ):
        model = _by_gate(0, row[4], row[5])
        used[row.agent] = _by_gate(row[1], row[2], row[3]) | {
            f"model_{gate}": n for gate, n in model.items() if gate != "rpm"
        }
    windows = [("rpm", limits.rpm[0], 1)] if limits.rpm else []
    windows += [(gate, limit, need.of(gate)) for gate, limit in limits.token_limits]
    for gate, limit, wanted in windows:
        counts = {name: by_gate[gate] for name, by_gate in used.items()}
        if fair(limit, wanted, counts, shares, agent):
            continue
        part = limit * share / sum(shares.values())
        # A call counts once in rpm when numbered there; its tokens (NULL where no token
        # window held it, which a sum passes over) in the others.
        cost = sa.case((slots.account_seq.is_not(None), 1)) if gate == "rpm" else TOKENS_OF[gate]
        newer = sa.func.sum(cost).over(order_by=(slots.admitted_at.desc(), slots.id.desc()))
        own = (
            sa.select(slots.admitted_at.label("at"), newer.label("newer"))
            .where(slots.provider == c.provider, slots.account == c.account, mine)
            .where(slots.admitted_at > since, of_model if gate.startswith("model_") else sa.true())
            .subquery()
        )
        # Its own calls leaving the window bring it back within its part …
        leaves = conn.execute(
            sa.select(sa.func.max(own.c.at)).where(own.c.newer > part - wanted)
        ).scalar()
        # … or a waiting agent's part lapses, when it has not come back for it.
        retry = lapse if leaves is None else min(leaves + window, lapse)
        mine_used = counts.get(agent, 0)
        whose = f"{c.model} through " if gate.startswith("model_") else ""
        detail = (
            f"share: agent {agent} has {mine_used:g} of its {part:g} of {gate} {limit:,} for "
            f"{whose}{c.provider}/{c.account or '-'} while {_others(waiting)}"
        )
        return Refusal(Code.RATE_LIMITED, retry, detail, "share")
    return None


class Demand:
    """The waits this process wrote to ``account_demand``: one write per wait, not one
    per refusal while a wait it already wrote covers it."""

    def __init__(self) -> None:
        self._noted: dict[tuple[str, str, str], float] = {}

    def refused(
        self, db: Database, config: Configured, c: Candidate, agent: str, answer: object
    ) -> None:
        """If ``answer`` is a refusal by a window of ``c``'s account (or by its provider's
        slots), ``agent`` waits for the account (the slots) until a little after the
        refusal said: when its paused task is tried again (the sweeper's look, a
        worker's poll and a recheck later)."""
        if not isinstance(answer, Refusal) or answer.gate not in GATES:
            return
        if answer.code is Code.TOO_LARGE:  # never admitted: nothing to wait for
            return
        s, agents = config.settings, config.catalog.agents
        margin = s.sweep_peek_sec + s.poll_sec + s.admission_recheck_sec
        share = agents[agent].share if agent in agents else 1.0
        # A slot refusal (its own gate, or the share of the slots) waits for the slots.
        account = SLOTS if answer.code is Code.CONCURRENCY_FULL else c.account
        self.note(db, c.provider, account, agent, share, answer, margin)

    def note(
        self,
        db: Database,
        provider: str,
        account: str,
        agent: str,
        share: float,
        refusal: Refusal,
        margin: float,
    ) -> None:
        """``agent`` was refused by a window of ``provider``'s ``account`` (``SLOTS``: by
        its slots): it waits for them until ``margin`` seconds after the refusal said."""
        key = (provider, account, agent)
        until = refusal.retry_after + margin
        if self._noted.get(key, -math.inf) >= until - margin / 2:
            return
        row = {"provider": provider, "account": account, "agent": agent, "share": share}

        def work(conn: Connection) -> None:
            insert: Any = dialect_insert(conn.dialect.name)(account_demand)
            later = sa.case(
                (insert.excluded.until > account_demand.c.until, insert.excluded.until),
                else_=account_demand.c.until,
            )
            conn.execute(
                insert.on_conflict_do_update(
                    index_elements=[_D.provider, _D.account, _D.agent],
                    set_={"share": insert.excluded.share, "until": later},
                ),
                {**row, "until": until},
            )

        db.write(work)
        self._noted[key] = until


def purge(conn: Connection, now: float) -> None:
    """Forget the waits that are over."""
    conn.execute(sa.delete(account_demand).where(_D.until < now))


def standing(
    conn: Connection,
    catalog: Catalog | None,
    learnt: Mapping[tuple[str, str, str], Mapping[str, int]],
    window: float,
    now: float,
) -> list[dict[str, Any]]:
    """Each provider account's windows as they stand (status, /metrics, the dashboard):
    per window its limit (configured, else ``learnt`` from the answers) and what the
    calls of the last ``window`` seconds used of it; per agent that used or waits for
    the account, its share, whether it waits, and what it used. A model's own token
    window is named after the window and the model (``tpm gpt-4o``); a provider's slots
    show as its account ``SLOTS``, window ``concurrency``: its calls in flight now."""
    slots = call_slots.c
    # (provider, account) -> (model, agent) -> window -> used
    used: dict[tuple[str, str], dict[tuple[str, str], dict[str, float]]] = {}
    for row in conn.execute(
        sa.select(
            slots.provider,
            slots.account,
            slots.model,
            slots.agent,
            sa.func.count(slots.account_seq),
            sa.func.coalesce(sa.func.sum(slots.tokens_in), 0),
            sa.func.coalesce(sa.func.sum(slots.tokens_out), 0),
        )
        .where(slots.admitted_at > now - window)
        .group_by(slots.provider, slots.account, slots.model, slots.agent)
    ):
        key = (row.provider, row.account)
        used.setdefault(key, {})[(row.model, row.agent)] = _by_gate(row[4], row[5], row[6])
    waiting: dict[tuple[str, str], dict[str, float]] = {}
    for row in conn.execute(sa.select(_D.provider, _D.account, _D.agent, _D.share, _D.until)):
        if row.until > now:
            waiting.setdefault((row.provider, row.account), {})[row.agent] = float(row.share)
    # A provider's slots show as its account SLOTS, window "concurrency": calls in flight.
    for row in conn.execute(
        sa.select(slots.provider, slots.agent, sa.func.count())
        .where(slots.released_at.is_(None), slots.lease_until > now)
        .group_by(slots.provider, slots.agent)
    ):
        calls = used.setdefault((row.provider, SLOTS), {})
        calls[("", row.agent)] = {"concurrency": float(row[2])}
    # (provider, account) -> (window, model or None) -> (limit, learnt)
    limits: dict[tuple[str, str], dict[tuple[str, str | None], tuple[int, bool]]] = {}
    models = list(catalog.models.values()) if catalog else []
    for provider in catalog.providers.values() if catalog else ():
        if provider.concurrency:
            limits[(provider.name, SLOTS)] = {("concurrency", None): (provider.concurrency, False)}
        for account in provider.accounts:
            mine = limits.setdefault((provider.name, account.name), {})
            for gate, limit in {"rpm": account.rpm, **account.token_limits}.items():
                if limit:
                    mine[(gate, None)] = (limit, False)
            for model in models:
                if model.provider == provider.name:
                    mine |= {(g, model.id): (n, False) for g, n in model.token_limits.items()}
    for (provider_name, account_name, model_id), sizes in learnt.items():
        mine = limits.setdefault((provider_name, account_name), {})
        for gate, size in sizes.items():
            if (gate, None) not in mine and (gate, model_id) not in mine:
                mine[(gate, model_id)] = (size, True)
    agents = catalog.agents if catalog else {}
    found = []
    for key in sorted(k for k, v in limits.items() if v):
        calls = used.get(key, {})
        waits = waiting.get(key, {})
        names = sorted(({agent for _, agent in calls} | set(waits)) - {""})  # "": elsewhere
        shown = sorted(limits[key].items(), key=lambda item: (item[0][1] or "", item[0][0]))
        named = {
            (gate, model): gate if model is None else f"{gate} {model}"
            for (gate, model), _ in shown
        }
        found.append(
            {
                "provider": key[0],
                "account": key[1],
                "window_sec": window,
                "windows": {
                    named[g]: {"limit": limit, "learnt": was_learnt, "used": _sum(calls, *g)}
                    for g, (limit, was_learnt) in shown
                },
                "agents": [
                    {
                        "agent": name,
                        "share": agents[name].share if name in agents else waits.get(name, 1.0),
                        "waiting": name in waits,
                        "used": {named[g]: _sum(calls, *g, name) for g, _ in shown},
                    }
                    for name in names
                ],
            }
        )
    return found


def _by_gate(calls: Any, tokens_in: Any, tokens_out: Any) -> dict[str, float]:
    """What calls of an account used of each of its windows, from their counts."""
    tin, tout = float(tokens_in), float(tokens_out)
    return {"rpm": float(calls), "tpm": tin + tout, "itpm": tin, "otpm": tout}


def _sum(
    calls: Mapping[tuple[str, str], Mapping[str, float]],
    gate: str,
    model: str | None,
    agent: str | None = None,
) -> float:
    """What the calls (by model and agent) used of window ``gate``: the account's (no
    ``model``) or one model's, all agents' or one's."""
    return sum(
        n[gate]
        for (m, a), n in calls.items()
        if (model is None or m == model) and (agent is None or a == agent)
    )
