"""What admission knows of provider accounts, in the database. Refused credentials:
``account_state``, written only through ``Admission.mark_unusable``: a provider
account whose key was refused is left out, by the key's fingerprint (never the
key), until its key or its config changes. Learnt token windows:
``account_limits``, written only through ``Admission.finish``: the sizes an
account's answers announce, for the windows its config does not set."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus import masking
from agentbus.admission import slots
from agentbus.admission.routing import fingerprint
from agentbus.db import dialect_insert
from agentbus.db.compiled import prepared
from agentbus.schema import account_limits, account_state

if TYPE_CHECKING:
    from agentbus.admission.routing import Candidate
    from agentbus.catalog import Catalog
    from agentbus.db import Database

#: (provider, account, key fingerprint) of a refused credential.
Unusable = tuple[str, str, str]


def refused(catalog: Catalog, environ: Mapping[str, str] | None, c: Candidate) -> Unusable | None:
    """What a refused credential of candidate ``c`` is known by (None: no key to know)."""
    provider = catalog.provider(c.provider)
    account = provider.account(c.account)
    if account is None or environ is None:
        return None
    return (provider.name, account.name, fingerprint(provider, account, environ))


def mark(conn: Connection, unusable: Unusable, reason: str, now: float) -> None:
    """Record ``unusable`` (the latest refusal replaces an earlier one of the account)."""
    provider, account, fingerprint = unusable
    insert: Any = dialect_insert(conn.dialect.name)(account_state)
    stmt = insert.on_conflict_do_update(
        index_elements=[account_state.c.provider, account_state.c.account],
        set_={
            "fingerprint": insert.excluded.fingerprint,
            "reason": insert.excluded.reason,
            "unusable_since": insert.excluded.unusable_since,
        },
    )
    row = {
        "provider": provider,
        "account": account,
        "fingerprint": fingerprint,
        "reason": masking.mask(reason)[:500],
        "unusable_since": now,
    }
    conn.execute(stmt, row)


def unusable(conn: Connection) -> set[Unusable]:
    """Every refused credential."""
    c = account_state.c
    rows = conn.execute(sa.select(c.provider, c.account, c.fingerprint))
    return {(r.provider, r.account, r.fingerprint) for r in rows}


#: (provider, account, model) -> token window -> its size, as the answers announced it
#: (the providers limit tokens per model: the headers are those of the model answering).
Learnt = dict[tuple[str, str, str], dict[str, int]]


def learn(conn: Connection, c: Candidate, sizes: Mapping[str, int], now: float) -> None:
    """Record the token windows an answer through ``c`` announced (window -> tokens per
    window): the size of each window the config does not set, for its model."""
    insert: Any = dialect_insert(conn.dialect.name)(account_limits)
    keys = account_limits.c
    stmt = insert.on_conflict_do_update(
        index_elements=[keys.provider, keys.account, keys.model, keys.gate],
        set_={"size": insert.excluded.size, "observed_at": insert.excluded.observed_at},
    )
    where = {"provider": c.provider, "account": c.account, "model": c.model}
    rows = [
        {**where, "gate": gate, "size": size, "observed_at": now} for gate, size in sizes.items()
    ]
    conn.execute(stmt, rows)


def learnt(conn: Connection) -> Learnt:
    """Every token window the answers announced."""
    c = account_limits.c
    found: Learnt = {}
    for row in conn.execute(sa.select(c.provider, c.account, c.model, c.gate, c.size)):
        found.setdefault((row.provider, row.account, row.model), {})[row.gate] = int(row.size)
    return found


class LearntWindows:
    """The token windows the accounts' answers announced, as this process last read them
    (``known``: replaced, never changed in place, so kept limits see a change)."""

    def __init__(self, *, every: float) -> None:
        self.known: Learnt = {}
        self.every = every
        self._counted_at: dict[tuple[str, str, str], float] = {}  # "remaining" counted then

    def load(self, conn: Connection) -> None:
        fresh = learnt(conn)
        if fresh != self.known:
            self.known = fresh

    def heard(
        self,
        db: Database,
        catalog: Catalog,
        c: Candidate,
        announced: Iterable[tuple[str, int, int | None]],
        now: float,
        window: float,
    ) -> None:
        """An answer through candidate ``c`` announced these windows (window, size,
        remaining) of its model through its account (``window`` seconds long). For each
        the config does not set (for the account or the model): record the size if it
        changed, and, at most once ``every`` seconds, count what the provider says is
        used beyond what the model's window holds, once that is half the window or more
        (``slots.count_elsewhere``: the account's other clients)."""
        config = catalog.provider(c.provider).account(c.account)
        configured = {
            **(config.token_limits if config is not None else {}),
            **catalog.model_token_limits(c.model),
        }
        said = [(gate, size, left) for gate, size, left in announced if gate not in configured]
        key = (c.provider, c.account, c.model)
        known = self.known.get(key, {})
        sizes = {gate: size for gate, size, _ in said if known.get(gate) != size}
        used = {
            gate: size - left
            for gate, size, left in said
            if left is not None and size - left >= size / 2
        }
        if now - self._counted_at.get(key, -math.inf) < self.every:
            used = {}
        if not sizes and not used:
            return
        params = {
            "p_provider": c.provider,
            "p_account": c.account,
            "p_model": c.model,
            "p_now": now,
            "p_tokens_since": now - window,
        }

        def work(conn: Connection) -> None:
            if sizes:
                learn(conn, c, sizes, now)
            for gate, tokens in used.items():
                prepared(conn.dialect, slots.count_elsewhere(gate)).execute(
                    conn, params | {"p_used": tokens}
                )

        db.write(work)
        if used:
            self._counted_at[key] = now
        if sizes:
            self.known = {**self.known, key: {**known, **sizes}}
