"""model_cooldown shared by processes: never shortened, cached at most 1 s, slow-read rule."""

from __future__ import annotations

from agentbus.admission.cooldowns import CooldownStore
from agentbus.db import Database
from tests.support import FakeClock


def test_upsert_extends_and_never_shortens(db: Database, clock: FakeClock) -> None:
    store = CooldownStore(db, clock=clock)
    assert store.set("m", clock.now + 180, reason="429") == clock.now + 180
    assert store.set("m", clock.now + 60, reason="shorter") == clock.now + 180
    assert store.set("m", clock.now + 400, reason="Retry-After") == clock.now + 400
    fresh = CooldownStore(db, clock=clock)  # another process, or a restarted one
    assert fresh.cooling(["m", "other"]) == {"m": clock.now + 400}


def test_reads_are_cached_for_the_ttl(db: Database, clock: FakeClock) -> None:
    reader = CooldownStore(db, clock=clock, cache_sec=1.0)
    writer = CooldownStore(db, clock=clock)
    assert reader.cooling(["m"]) == {}
    writer.set("m", clock.now + 180, reason="429")
    clock.advance(0.5)
    assert reader.cooling(["m"]) == {}  # still the cached read
    clock.advance(0.5)
    assert reader.cooling(["m"]) == {"m": clock.now + 179}


def test_expired_cooldowns_are_not_active_and_are_purged(db: Database, clock: FakeClock) -> None:
    store = CooldownStore(db, clock=clock, cache_sec=1.0)
    store.set("a", clock.now + 10, reason="429")
    store.set("b", clock.now + 100, reason="429")
    clock.advance(10)
    assert store.active() == {"b": clock.now + 90}
    assert store.purge_expired() == 1
    assert CooldownStore(db, clock=clock).active() == {"b": clock.now + 90}


def test_slow_read_switches_to_the_long_ttl_and_back(db: Database, clock: FakeClock) -> None:
    ticks = iter([0.0, 0.150, 1.0, 1.010])  # the first read takes 150 ms, the next 10 ms
    store = CooldownStore(
        db,
        clock=clock,
        timer=lambda: next(ticks),
        cache_sec=1.0,
        slow_read_ms=100,
        slow_cache_sec=10.0,
    )
    store.active()
    assert store.ttl == 10.0
    clock.advance(5)
    store.active()  # within the long TTL: no read
    clock.advance(5)
    store.active()
    assert store.ttl == 1.0
