"""The circuit breakers in the database: the only writer of ``circuits`` and
``circuit_calls``. Decisions are ``gates.circuit_admits`` / ``gates.after_call``;
this module reads and writes their state, inside the caller's admission or
release transaction (which holds the admission lock)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.admission import workspace_events
from agentbus.admission.gates import Circuit, CircuitRules, after_call
from agentbus.catalog import ProviderConfig
from agentbus.config import Settings
from agentbus.db.compiled import prepared
from agentbus.logging import get_logger
from agentbus.schema import circuit_calls as calls
from agentbus.schema import circuits

log = get_logger("agentbus.admission")


def circuit_rules(s: Settings) -> CircuitRules:
    return CircuitRules(
        s.circuit_window_sec,
        s.circuit_failure_rate,
        s.circuit_min_calls,
        s.circuit_consecutive_failures,
        s.circuit_open_sec,
    )


class CircuitStore:
    def __init__(self, worker: str, settings: Callable[[], Settings]) -> None:
        self.worker = worker
        self._settings = settings  # the live settings: a reload changes the rules
        self._cache: dict[str, tuple[str, Circuit]] = {}  # provider -> (endpoint, state)

    @property
    def rules(self) -> CircuitRules:
        return circuit_rules(self._settings())

    # -- reading -------------------------------------------------------------

    def load(self, conn: Connection) -> None:
        """Read every circuit into the cache (the admission cache refresh)."""
        rows = conn.execute(sa.select(circuits)).all()
        self._cache = {r.provider: (r.endpoint, _state(r)) for r in rows}

    def cached(self, provider: ProviderConfig) -> Circuit | None:
        """The provider's circuit as last read (None: it has no circuit breaker)."""
        if not provider.circuit:
            return None
        endpoint, state = self._cache.get(provider.name, (provider.endpoint, Circuit()))
        return state if endpoint == provider.endpoint else Circuit()  # an edited endpoint

    def current(self, conn: Connection, provider: ProviderConfig) -> Circuit:
        row = conn.execute(sa.select(circuits).where(circuits.c.provider == provider.name)).first()
        if row is None or row.endpoint != provider.endpoint:
            return Circuit()
        return _state(row)

    # -- writing -------------------------------------------------------------

    def take_probe(
        self, conn: Connection, provider: ProviderConfig, now: float, lease: float
    ) -> bool:
        """Become the one half-open probe: a compare-and-set that only one caller wins."""
        c = circuits.c
        due = sa.or_(
            sa.and_(c.state == "open", c.open_until <= now),
            sa.and_(c.state == "half_open", sa.or_(c.probe_until.is_(None), c.probe_until <= now)),
        )
        won = conn.execute(
            sa.update(circuits)
            .where(c.provider == provider.name, c.endpoint == provider.endpoint, due)
            .values(
                state="half_open", probe_owner=self.worker, probe_until=now + lease, updated_at=now
            )
        ).rowcount
        if won:
            log.info("circuit_probe", provider=provider.name, worker=self.worker)
            workspace_events.emit(
                conn,
                "circuit_half_open",
                now,
                source=self.worker,
                detail={"provider": provider.name},
            )
        return bool(won)

    def counts_success_alone(self, provider: ProviderConfig) -> bool:
        """Whether a success (not a probe) can be counted by ``count_success``: this process
        has seen the provider's circuit row, for its current endpoint."""
        seen = self._cache.get(provider.name)
        return seen is not None and seen[0] == provider.endpoint

    def count_success(self, conn: Connection, provider: ProviderConfig, now: float) -> None:
        """Count a successful call (not a probe) without the circuit's lock.

        A success moves no circuit (``after_call``: only a failure opens one, only
        the probe closes one); it only ends a run of consecutive failures. So it is
        one insert into the window and one guarded update that resets the run where
        another process counted failures (usually it matches no row, and writes
        nothing). Calls that left the window are deleted by the next failure's count
        and by the sweeper's purge."""
        params = {"p_provider": provider.name, "p_endpoint": provider.endpoint, "p_now": now}
        prepared(conn.dialect, COUNT_SUCCESS).execute(conn, params)
        prepared(conn.dialect, END_RUN).execute(conn, params)

    def count(
        self, conn: Connection, provider: ProviderConfig, *, failed: bool, probe: bool, now: float
    ) -> None:
        """Count a finished call in the provider's window and move its circuit."""
        name, endpoint = provider.name, provider.endpoint
        row = conn.execute(sa.select(circuits).where(circuits.c.provider == name)).first()
        if row is None or row.endpoint != endpoint:  # a new endpoint starts afresh
            conn.execute(sa.delete(circuits).where(circuits.c.provider == name))
            conn.execute(sa.delete(calls).where(calls.c.provider == name))
            conn.execute(
                sa.insert(circuits).values(provider=name, endpoint=endpoint, updated_at=now)
            )
            row, before = None, Circuit()
        else:
            before = _state(row)
        conn.execute(sa.insert(calls).values(provider=name, at=now, failed=failed))
        since = now - self.rules.window_sec
        conn.execute(sa.delete(calls).where(calls.c.provider == name, calls.c.at <= since))
        n, failures = conn.execute(
            sa.select(
                sa.func.count(),
                sa.func.coalesce(sa.func.sum(sa.case((calls.c.failed, 1), else_=0)), 0),
            ).where(calls.c.provider == name, calls.c.at > since)
        ).one()
        after = after_call(
            before,
            failed=failed,
            probe=probe and before.probe_owner == self.worker,
            window_calls=int(n),
            window_failures=int(failures),
            now=now,
            rules=self.rules,
        )
        opened_at = None
        if after.state != "closed":
            opened_at = now if before.state == "closed" else getattr(row, "opened_at", None)
        conn.execute(
            sa.update(circuits)
            .where(circuits.c.provider == name)
            .values(
                state=after.state,
                consecutive_failures=after.consecutive_failures,
                opened_at=opened_at,
                open_until=after.open_until,
                probe_owner=after.probe_owner,
                probe_until=after.probe_until,
                updated_at=now,
            )
        )
        if after.state == "closed" and before.state != "closed":
            conn.execute(sa.delete(calls).where(calls.c.provider == name))
        if after.state != before.state:
            detail = {
                "provider": name,
                "consecutive_failures": after.consecutive_failures,
                "window": f"{failures}/{n} failed",
                "open_until": after.open_until,
            }
            workspace_events.emit(
                conn, f"circuit_{after.state}", now, source=self.worker, detail=detail
            )
        self._cache[name] = (endpoint, after)

    def purge(self, conn: Connection, now: float) -> None:
        """Delete counted calls that have left every window."""
        conn.execute(sa.delete(calls).where(calls.c.at < now - self.rules.window_sec))


# A success counted without the lock (``count_success``); parameters p_provider,
# p_endpoint, p_now. Public: admission runs them with a slot's release in one
# statement on PostgreSQL.
_P_PROVIDER = sa.bindparam("p_provider", type_=sa.Text)
_P_NOW = sa.bindparam("p_now", type_=sa.Float)
COUNT_SUCCESS = sa.insert(calls).values(provider=_P_PROVIDER, at=_P_NOW, failed=False)
END_RUN = (
    sa.update(circuits)
    .where(
        circuits.c.provider == _P_PROVIDER,
        circuits.c.endpoint == sa.bindparam("p_endpoint", type_=sa.Text),
        circuits.c.consecutive_failures > 0,
    )
    .values(consecutive_failures=0, updated_at=_P_NOW)
)


def _state(row: Any) -> Circuit:
    return Circuit(
        row.state, row.consecutive_failures, row.open_until, row.probe_owner, row.probe_until
    )
