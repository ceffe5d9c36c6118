"""Admission gates against the database (SQLite and Postgres), with an injected clock."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from agentbus.admission import usage
from agentbus.admission.admission import Admissible, Admission, Permit
from agentbus.admission.cooldowns import CooldownStore
from agentbus.admission.gates import Code, Refusal
from agentbus.admission.routing import Candidate, Route
from agentbus.config import Config, LiveConfig, load_config
from agentbus.db import Database
from agentbus.providers.outcomes import Failed, RateLimited, Succeeded
from agentbus.schema import call_slots, model_cooldown
from tests.support import FakeClock

CONFIG = """
global_concurrency = {global_concurrency}
daily_token_budget = {tokens}
rpm_window_sec = 60
admission_wait_ms = 0
admission_recheck_sec = 2
circuit_consecutive_failures = 3
circuit_min_calls = 4
circuit_window_sec = 10
circuit_open_sec = 30

[bulkheads]
heavy = 1

[providers.sim]
kind = "simulated"
rpm = {rpm}
concurrency = {concurrency}
[providers.sim.accounts.a]
key_env = "SIM_KEY_A"
[providers.sim.accounts.b]
key_env = "SIM_KEY_B"

[providers.edge]
kind = "openai"
base_url = "{endpoint}"
api_key_env = "EDGE_KEY"

[models."sim/big"]
provider = "sim"
bulkhead = "heavy"

[models."edge-1"]
provider = "edge"

[agents.codex]
models = ["sim/a"]
rate = {agent_rate}
rate_window_sec = 1
"""
ENV = {"SIM_KEY_A": "ka", "SIM_KEY_B": "kb", "EDGE_KEY": "ke"}


def config(tmp_path: Path, **values: Any) -> Config:
    fields = {
        "global_concurrency": 0,
        "tokens": 0,
        "rpm": 1000,
        "concurrency": 1000,
        "agent_rate": 1000,
        "endpoint": "http://127.0.0.1:9/v1",
        **values,
    }
    path = tmp_path / "agentbus.toml"
    path.write_text(CONFIG.format(**fields))
    return load_config(path, environ=ENV)


def admission(db: Database, clock: FakeClock, cfg: Config, worker: str = "w1") -> Admission:
    cooldowns = CooldownStore(db, clock=clock, cache_sec=1e-9)
    return Admission(
        db, cfg, worker=worker, cooldowns=cooldowns, environ=ENV, clock=clock, cache_sec=1e-9
    )


def candidate(adm: Admission, model: str = "sim/a", account: str = "a") -> Candidate:
    found = adm.resolve(models=(model,), role=None, agent="codex")
    return next(c for c in found.candidates if c.account == account)


def admit(adm: Admission, c: Candidate, agent: str = "codex") -> Permit | Refusal:
    return adm.admit(c, agent=agent, task_id=1, lease_sec=60)


def test_rpm_is_a_sliding_window_that_says_when_it_frees(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    adm = admission(db, clock, config(tmp_path, rpm=3))
    a = candidate(adm)
    first = clock.now
    for _ in range(3):
        permit = admit(adm, a)
        assert isinstance(permit, Permit)
        permit.__exit__(None, None, None)
        clock.advance(10)
    refusal = admit(adm, a)
    assert isinstance(refusal, Refusal) and refusal.code is Code.RATE_LIMITED
    assert refusal.retry_after == pytest.approx(first + 60)  # the oldest call leaves the window
    assert refusal.as_dict(clock.now) == {
        "code": -32000,
        "name": "rate_limited",
        "retry_after_ms": 30_000,
        "suggested_action": "DO_NOT_RETRY_IMMEDIATELY",
        "gate": "rpm",
        "detail": "rpm: 3 calls per 60s for sim/a",
    }
    assert isinstance(admit(adm, candidate(adm, account="b")), Permit)  # per account
    assert adm.peek(a, agent="codex") == refusal
    clock.now = first + 60.001
    assert adm.peek(a, agent="codex") == Admissible(room=1)  # one call left the window
    assert isinstance(admit(adm, a), Permit)
    assert adm.peek(a, agent="codex") == refusal.__class__(
        Code.RATE_LIMITED, first + 10 + 60, refusal.detail, "rpm"
    )


def test_windows_admit_exactly_as_a_sliding_log_would_over_a_long_run(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    """Hundreds of calls at uneven intervals, old calls purged on the way: every answer
    of the rpm window (5 per 60 s, numbered calls) is the one a plain list of admission
    times gives, refusals saying exactly when the window frees."""
    adm = admission(db, clock, config(tmp_path, rpm=5))
    a = candidate(adm)
    admitted: list[float] = []
    steps = [0.5, 3.0, 7.0, 11.0, 0.25, 19.0, 2.0, 29.0]
    for n in range(400):
        clock.advance(steps[n % len(steps)] + n % 3)
        in_window = [at for at in admitted if at > clock.now - 60]
        answer = admit(adm, a)
        if len(in_window) < 5:
            assert isinstance(answer, Permit), (n, answer)
            answer.__exit__(None, None, None)
            admitted.append(clock.now)
        else:
            assert isinstance(answer, Refusal) and answer.gate == "rpm", (n, answer)
            assert answer.retry_after == pytest.approx(in_window[-5] + 60)
        if n % 50 == 49:
            adm.purge()
    assert 100 < len(admitted) < 400  # the window both admitted and refused along the way


def test_a_clock_behind_a_window_stamps_its_call_with_the_windows_newest_time(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    """A process whose clock reads behind the newest call of a window (another host's
    clock ahead of its own; on PostgreSQL, the clock is read before the gates' locks
    are granted): its call is stamped with that newest time, so a window's times keep
    their calls' order, which its count by number relies on."""
    adm = admission(db, clock, config(tmp_path, rpm=3, agent_rate=3))
    a = candidate(adm)
    first = clock.now
    for at in (first, first + 30, first + 10):  # the third reads 20 s behind
        clock.now = at
        permit = admit(adm, a)
        assert isinstance(permit, Permit)
        permit.__exit__(None, None, None)
    stamped = db.read(
        lambda conn: (
            conn.execute(sa.select(call_slots.c.admitted_at).order_by(call_slots.c.id))
            .scalars()
            .all()
        )
    )
    assert stamped == [first, first + 30, first + 30]
    clock.now = first + 60.5  # the first call has left the window: one more fits
    assert isinstance(admit(adm, a), Permit)
    refusal = admit(adm, a)  # the window now holds the second, the third and the fourth
    assert isinstance(refusal, Refusal) and refusal.retry_after == pytest.approx(first + 90)


def test_agent_rate_is_shared_by_all_its_workers(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    cfg = config(tmp_path, agent_rate=2)
    one, two = admission(db, clock, cfg, "w1"), admission(db, clock, cfg, "w2")
    assert isinstance(admit(one, candidate(one)), Permit)
    clock.advance(0.25)
    assert isinstance(admit(two, candidate(two, account="b")), Permit)
    refusal = admit(one, candidate(one))
    assert isinstance(refusal, Refusal) and refusal.code is Code.RATE_LIMITED
    assert refusal.retry_after == pytest.approx(clock.now - 0.25 + 1)
    assert isinstance(admit(one, candidate(one), agent="other"), Permit)


def test_concurrency_slots_are_leased_and_released(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    adm = admission(db, clock, config(tmp_path, concurrency=2))
    a, b = candidate(adm), candidate(adm, account="b")
    held = admit(adm, a)
    assert isinstance(held, Permit)
    permit = admit(adm, b)
    assert isinstance(permit, Permit)
    with pytest.raises(RuntimeError), permit:
        raise RuntimeError("the call blew up")  # the slot still comes back
    second = admit(adm, b)
    assert isinstance(second, Permit)
    refusal = admit(adm, a)  # provider limit 2, shared by both accounts
    assert isinstance(refusal, Refusal) and refusal.code is Code.CONCURRENCY_FULL
    assert refusal.retry_after == pytest.approx(clock.now + 2)  # unknown: look again soon
    with held:
        pass
    assert isinstance(admit(adm, a), Permit)
    # A process that died never releases: its lease (60 s) gives the slot back.
    clock.advance(61)
    assert isinstance(admit(adm, a), Permit)


def test_global_concurrency_and_bulkheads(db: Database, clock: FakeClock, tmp_path: Path) -> None:
    adm = admission(db, clock, config(tmp_path, global_concurrency=2))
    big = candidate(adm, "sim/big")
    assert isinstance(admit(adm, big), Permit)
    refusal = admit(adm, candidate(adm, "sim/big", "b"))
    assert isinstance(refusal, Refusal) and refusal.code is Code.BULKHEAD_FULL
    shown = refusal.as_dict(clock.now)
    assert (shown["code"], shown["name"], shown["gate"]) == (-32002, "bulkhead_full", "bulkhead")
    assert shown["suggested_action"] == "RETRY_WHEN_A_SLOT_FREES"
    assert isinstance(admit(adm, candidate(adm)), Permit)
    refusal = admit(adm, candidate(adm, account="b"))
    assert isinstance(refusal, Refusal) and refusal.code is Code.CONCURRENCY_FULL


def test_daily_budget_refuses_until_the_utc_day_ends(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    adm = admission(db, clock, config(tmp_path, tokens=100))
    a = candidate(adm)
    assert isinstance(admit(adm, a), Permit)  # in flight: may cross the threshold
    settled = Route(
        1, 1, "codex", "sim/a", "call", clock.now, worker="w1", provider="sim", account="a"
    )
    settled = dataclasses.replace(settled, prompt_tokens=90, completion_tokens=15, cost=0.5)
    db.write(lambda conn: usage.record(conn, [settled]))
    refusal = admit(adm, a)
    assert isinstance(refusal, Refusal) and refusal.code is Code.BUDGET_EXHAUSTED
    assert refusal.retry_after == (clock.now // 86400 + 1) * 86400
    clock.now = refusal.retry_after
    assert isinstance(admit(adm, a), Permit)


def test_a_routes_row_is_its_fields_and_nothing_it_shares() -> None:
    gates, refusal = {"cooldown": "ok"}, {"code": -32001}
    route = Route(7, 2, "codex", "sim/a", "refuse", 5.0, worker="w1", gates=gates, refusal=refusal)
    row = route.row()
    assert list(row) == [f.name for f in dataclasses.fields(Route)]  # route_log's columns
    assert row == {f.name: getattr(route, f.name) for f in dataclasses.fields(Route)}
    row["gates"]["cooldown"], row["refusal"]["code"], row["day"] = "x", 0, 1.0
    assert (gates, refusal) == ({"cooldown": "ok"}, {"code": -32001})
    assert list(route.row()) == [f.name for f in dataclasses.fields(Route)]


def test_cooldowns_of_a_model_and_of_one_account(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    adm = admission(db, clock, config(tmp_path))
    a, b = candidate(adm), candidate(adm, account="b")
    adm.cooldowns.set("sim/a@a", clock.now + 50, reason="RateLimited")
    refusal = admit(adm, a)
    assert isinstance(refusal, Refusal) and refusal.code is Code.COOLDOWN
    assert refusal.retry_after == clock.now + 50
    assert isinstance(admit(adm, b), Permit)
    adm.cooldowns.set("sim/a", clock.now + 70, reason="RateLimited")
    assert admit(adm, b) == Refusal(
        Code.COOLDOWN, clock.now + 70, "sim/a@b is cooling down", "cooldown"
    )
    assert isinstance(admit(adm, a), Refusal) and admit(adm, a).retry_after == clock.now + 70


def finish(adm: Admission, c: Candidate, ok: bool) -> Permit | Refusal:
    permit = admit(adm, c)
    if isinstance(permit, Permit):
        adm.finish(permit, Succeeded("x") if ok else Failed("HTTP 502", retryable=True))
    return permit


def test_circuit_opens_sends_one_probe_and_closes(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    cfg = config(tmp_path)
    adms = [admission(db, clock, cfg, f"w{i}") for i in range(4)]
    edge = candidate(adms[0], "edge-1", "default")
    for adm in adms[:3]:
        finish(adm, edge, ok=False)  # 3 consecutive failures
    refusal = admit(adms[3], edge)
    assert isinstance(refusal, Refusal) and refusal.code is Code.CIRCUIT_OPEN
    assert refusal.retry_after == pytest.approx(clock.now + 30)
    shown = refusal.as_dict(clock.now)
    assert (shown["code"], shown["name"], shown["gate"]) == (-32001, "circuit_open", "circuit")
    assert (shown["retry_after_ms"], shown["suggested_action"]) == (
        30_000,
        "WAIT_FOR_CIRCUIT_PROBE",
    )
    clock.advance(30)
    answers = [admit(adm, edge) for adm in adms]  # four processes race: one probe
    probes = [a for a in answers if isinstance(a, Permit)]
    assert len(probes) == 1 and probes[0].probe
    assert all(isinstance(a, Refusal) and a.code is Code.CIRCUIT_OPEN for a in answers[1:])
    probes[0].admission.finish(probes[0], Failed("HTTP 502", retryable=True))  # re-opens
    assert isinstance(admit(adms[1], edge), Refusal)
    clock.advance(30)
    probe = admit(adms[2], edge)
    assert isinstance(probe, Permit) and probe.probe
    adms[2].finish(probe, Succeeded("ok"))  # closes
    assert all(isinstance(admit(adm, edge), Permit) for adm in adms)


def test_circuit_opens_on_the_failure_share_of_its_window(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    adm = admission(db, clock, config(tmp_path))
    edge = candidate(adm, "edge-1", "default")
    for ok in (True, False, True, False):  # 2 of 4 failed, never 3 in a row
        finish(adm, edge, ok)
        clock.advance(1)
    assert isinstance(admit(adm, edge), Refusal)
    # A 429 says nothing about the endpoint: it does not count.
    adm2 = admission(db, clock, config(tmp_path, endpoint="http://127.0.0.1:8/v1"))
    assert isinstance(admit(adm2, edge), Permit)  # an edited endpoint starts afresh
    for _ in range(5):
        permit = admit(adm2, edge)
        assert isinstance(permit, Permit)  # the circuit is still closed
        cooled = adm2.finish(permit, RateLimited("429"))
        assert cooled is not None and cooled.key == "edge-1"  # the 429 cools the model down
        db.write(lambda conn: conn.execute(sa.delete(model_cooldown)))  # (not what we test)
        adm2.cooldowns.refresh()


def test_a_success_ends_a_run_of_failures_another_process_counted(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    """A success is counted without the circuit's lock, but still ends the run of
    consecutive failures, whoever counted them; and it stays in the failure window
    (with a slot to give back: on PostgreSQL both go in one statement)."""
    cfg = config(tmp_path, global_concurrency=10)
    ok_side, failing = admission(db, clock, cfg, "w1"), admission(db, clock, cfg, "w2")
    edge = candidate(ok_side, "edge-1", "default")
    finish(ok_side, edge, ok=True)  # this process has seen the circuit row now
    for _ in range(2):
        finish(failing, edge, ok=False)
    finish(ok_side, edge, ok=True)  # counted alone: the run of 2 ends
    runs = db.read(lambda conn: conn.execute(sa.text("SELECT consecutive_failures FROM circuits")))
    assert [row[0] for row in runs] == [0]
    held = "SELECT count(*) FROM call_slots WHERE released_at IS NULL"
    assert db.read(lambda conn: conn.execute(sa.text(held)).scalar()) == 0
    finish(failing, edge, ok=False)  # 3 failures, never 3 in a row: 3 of 5 failed
    clock.advance(1)
    refused = admit(ok_side, edge)
    assert isinstance(refused, Refusal) and refused.code is Code.CIRCUIT_OPEN


def test_a_refused_credential_leaves_the_account_out_until_it_changes(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    cfg = config(tmp_path)
    adm = admission(db, clock, cfg)
    adm.mark_unusable(candidate(adm), "HTTP 401")
    other = admission(db, clock, cfg, "w2")  # another process reads it from the database
    found = other.resolve(models=("sim/a",), role=None, agent="codex")
    assert [c.key for c in found.candidates] == ["sim/a@b"]
    assert found.left_out == (
        "sim/a@a: credential refused (unusable until the account's config changes)",
    )
    rotated = Admission(
        db,
        cfg,
        worker="w3",
        cooldowns=adm.cooldowns,
        environ={**ENV, "SIM_KEY_A": "a-new-key"},
        clock=clock,
        cache_sec=1e-9,
    )
    found = rotated.resolve(models=("sim/a",), role=None, agent="codex")
    assert [c.key for c in found.candidates] == ["sim/a@a", "sim/a@b"]


def test_a_kept_resolution_follows_credentials_refusals_and_a_reloaded_config(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    """A worker keeps what its chains resolve to (the refused credentials are read again
    only every ``cache_sec``); a key set or rotated in the environment, a credential
    refused and a reloaded config each apply to the next resolution all the same."""
    environ = {**ENV, "SIM_KEY_B": ""}
    live = LiveConfig(config(tmp_path), watch=False)
    cooldowns = CooldownStore(db, clock=clock, cache_sec=1e-9)
    adm = Admission(
        db, live, worker="w1", cooldowns=cooldowns, environ=environ, clock=clock, cache_sec=3600
    )

    def keys(models: tuple[str, ...] | None = ("sim/a",)) -> list[str]:
        return [c.key for c in adm.resolve(models=models, role=None, agent="codex").candidates]

    assert keys() == keys() == ["sim/a@a"]
    environ["SIM_KEY_B"] = "kb"
    assert keys() == ["sim/a@a", "sim/a@b"]
    adm.mark_unusable(candidate(adm), "HTTP 401")
    assert keys() == ["sim/a@b"]
    environ["SIM_KEY_A"] = "a-rotated-key"
    assert keys() == ["sim/a@a", "sim/a@b"]
    assert keys(None) == ["sim/a@a", "sim/a@b"]  # the agent's chain
    other = tmp_path / "other"
    other.mkdir()
    reloaded = config(other)
    reloaded_text = reloaded.path.read_text().replace('models = ["sim/a"]', 'models = ["sim/big"]')
    reloaded.path.write_text(reloaded_text)
    live.config = load_config(reloaded.path, environ=ENV)
    assert keys(None) == ["sim/big@a", "sim/big@b"]
