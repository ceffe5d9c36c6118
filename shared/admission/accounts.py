"""Refused credentials in the database: ``account_state``, written only through
``Admission.mark_unusable``. A provider account whose key was refused is left out,
by the key's fingerprint (never the key), until its key or its config changes."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus import masking
from agentbus.db import dialect_insert
from agentbus.schema import account_state

#: (provider, account, key fingerprint) of a refused credential.
Unusable = tuple[str, str, str]


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
