"""Fair shares of a provider account's windows among the agents waiting for it:
the decision (pure), and admission against the database (SQLite and Postgres, an
injected clock)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from agentbus.admission import shares
from agentbus.admission.admission import Admissible, Admission, Permit
from agentbus.admission.cooldowns import CooldownStore
from agentbus.admission.gates import Code, Refusal
from agentbus.admission.tokens import Tokens
from agentbus.catalog import parse_catalog
from agentbus.config import load_config
from agentbus.db import Database
from agentbus.errors import ConfigError
from agentbus.schema import account_demand
from tests.support import FakeClock


def test_an_agent_gets_its_part_of_the_window_while_others_wait() -> None:
    one_each = {"big": 1.0, "small": 1.0, "tiny": 1.0}
    # Within its part (6 of 18 / 3): yes; beyond it, the rest is kept for the waiting.
    assert shares.fair(18, 1, {"big": 5, "small": 0}, one_each, "big")
    assert not shares.fair(18, 1, {"big": 6, "small": 0, "tiny": 0}, one_each, "big")
    # An agent that is not waiting has no part: two parts of 9.
    assert shares.fair(18, 1, {"big": 8, "tiny": 3}, {"big": 1.0, "small": 1.0}, "big")
    assert not shares.fair(18, 1, {"big": 9, "tiny": 3}, {"big": 1.0, "small": 1.0}, "big")
    # Shares weigh: 2 of 3 parts is 12.
    assert shares.fair(18, 1, {"big": 11, "small": 0}, {"big": 2.0, "small": 1.0}, "big")
    assert not shares.fair(18, 1, {"big": 12, "small": 0}, {"big": 2.0, "small": 1.0}, "big")
    # A call larger than its part (tokens): one at a time, while the window has room.
    two = {"big": 1.0, "small": 1.0}
    assert shares.fair(1000, 600, {"big": 0, "small": 300}, two, "big")
    assert not shares.fair(1000, 600, {"big": 0, "small": 500}, two, "big")
    assert not shares.fair(1000, 600, {"big": 10, "small": 0}, two, "big")


def test_a_share_is_a_positive_number_of_a_configured_agent() -> None:
    catalog = parse_catalog({"agents": {"a": {"models": ["sim/x"], "share": 3}}})
    assert catalog.agents["a"].share == 3.0
    for bad in (-1, 0, "lots", True, 1e9):
        with pytest.raises(ConfigError, match=r"\[agents.a\]: share must be a positive number"):
            parse_catalog({"agents": {"a": {"models": ["sim/x"], "share": bad}}})
    with pytest.raises(ConfigError, match=r"\[agents.ghost\]: give either role or models"):
        parse_catalog({"agents": {"ghost": {"share": 2}}})


CONFIG = """
rpm_window_sec = 60
admission_wait_ms = 0
sweep_peek_sec = 2
poll_sec = 1
admission_recheck_sec = 2
[providers.sim]
kind = "simulated"
rpm = 6
[agents.big]
models = ["sim/m"]
[agents.small]
models = ["sim/m"]
{extra}
"""


def admission(
    db: Database, clock: FakeClock, tmp_path: Path, extra: str = "", *, text: str | None = None
) -> Admission:
    """An admission on CONFIG with ``extra`` keys of the small agent (or on ``text``)."""
    path = tmp_path / "agentbus.toml"
    path.write_text(CONFIG.format(extra=extra) if text is None else text)
    return Admission(
        db,
        load_config(path, environ={}),
        worker="w1",
        cooldowns=CooldownStore(db, clock=clock, cache_sec=1e-9),
        environ={},
        clock=clock,
        cache_sec=1e-9,
    )


def ask(adm: Admission, agent: str) -> Permit | Refusal:
    (c,) = adm.resolve(models=None, role=None, agent=agent).candidates
    answer = adm.admit(c, agent=agent, task_id=1, lease_sec=60)
    if isinstance(answer, Permit):
        answer.__exit__(None, None, None)
    return answer


def waits(db: Database) -> list[tuple[Any, ...]]:
    c = account_demand.c
    return [
        tuple(r)
        for r in db.read(
            lambda conn: conn.execute(sa.select(c.agent, c.share, c.until).order_by(c.agent)).all()
        )
    ]


def test_an_agent_that_waits_gets_its_share_of_the_window_back_first(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    adm = admission(db, clock, tmp_path)
    start = clock.now
    for _ in range(6):  # nobody else waits: the big agent may fill the window
        assert isinstance(ask(adm, "big"), Permit)
        clock.advance(1)
    refused = ask(adm, "small")
    assert isinstance(refused, Refusal) and refused.gate == "rpm"
    # The small agent waits for the account until its task is tried again: when the
    # window frees, plus the sweeper's look, a worker's poll and a recheck (5 s).
    assert waits(db) == [("small", 1.0, pytest.approx(start + 60 + 5))]
    clock.now = start + 60.5  # the first call left: one call fits
    kept = ask(adm, "big")  # 5 of its part of 3 used, and the small one's 3 unused
    assert isinstance(kept, Refusal) and kept.gate == "share"
    assert kept.code is Code.RATE_LIMITED
    # Back within its part when its third-newest call leaves (5 - 3 + 1), unless the
    # small one's wait lapses first.
    assert kept.retry_after == pytest.approx(start + 3 + 60)
    assert kept.detail == (
        "share: agent big has 5 of its 3 of rpm 6 for sim/- while 1 other agent waits"
    )
    assert (
        adm.peek(adm.resolve(models=None, role=None, agent="big").candidates[0], agent="big")
        == kept
    )
    assert isinstance(ask(adm, "small"), Permit)  # the freed call is the small one's
    clock.now = start + 61.5
    assert isinstance(ask(adm, "small"), Permit)  # so is the next
    # Once its wait is over (it did not come back), the window is the big one's again.
    clock.now = start + 65.5
    assert isinstance(ask(adm, "big"), Permit)


def test_shares_weigh_and_a_lone_agent_is_never_held_back(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    adm = admission(db, clock, tmp_path, "share = 2")  # the small agent's share: 2 of 3
    start = clock.now
    for _ in range(6):
        assert isinstance(ask(adm, "big"), Permit)
    clock.advance(1)
    assert isinstance(ask(adm, "small"), Refusal)
    clock.now = start + 60.5  # all six left at once
    assert waits(db)[0][:2] == ("small", 2.0)
    # Big's part is 2 of 6; the small one's 4 are kept for it.
    assert isinstance(ask(adm, "big"), Permit)
    assert isinstance(ask(adm, "big"), Permit)
    third = ask(adm, "big")
    assert isinstance(third, Refusal) and third.gate == "share"
    for _ in range(4):
        assert isinstance(ask(adm, "small"), Permit)
    full = ask(adm, "small")
    assert isinstance(full, Refusal) and full.gate == "rpm"  # the window itself
    (c,) = adm.resolve(models=None, role=None, agent="big").candidates
    assert isinstance(adm.peek(c, agent="big"), Refusal)
    clock.now = start + 200  # every wait over
    assert adm.peek(c, agent="big") == Admissible(room=6)


def test_status_metrics_and_busctl_show_the_windows_and_the_shares(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    from prometheus_client.core import Metric

    from agentbus.admin import render, serve, status

    adm = admission(db, clock, tmp_path, "share = 2")
    for _ in range(6):
        assert isinstance(ask(adm, "big"), Permit)
    assert isinstance(ask(adm, "small"), Refusal)  # the small agent now waits
    doc = status.snapshot(db, adm.settings, clock.now, kpis=False, catalog=adm.catalog)
    assert doc["windows"] == [
        {
            "provider": "sim",
            "account": "",
            "window_sec": 60.0,
            "windows": {"rpm": {"limit": 6, "learnt": False, "used": 6.0}},
            "agents": [
                {"agent": "big", "share": 1.0, "waiting": False, "used": {"rpm": 6.0}},
                {"agent": "small", "share": 2.0, "waiting": True, "used": {"rpm": 0.0}},
            ],
        }
    ]
    text = render.status(doc, adm.settings)
    assert "sim/-    rpm     6 / 6" in text
    assert "sim/-    small *  2      rpm 0" in text
    families: list[Metric] = list(serve._windows(doc["windows"]))
    samples = {
        (m.name, tuple(sorted(s.labels.items()))): s.value for m in families for s in m.samples
    }
    assert (
        samples[("agentbus_window_used", (("account", ""), ("provider", "sim"), ("window", "rpm")))]
        == 6
    )
    assert (
        samples[
            ("agentbus_window_limit", (("account", ""), ("provider", "sim"), ("window", "rpm")))
        ]
        == 6
    )
    assert samples[("agentbus_window_waiting_agents", (("account", ""), ("provider", "sim")))] == 1
    share = (("account", ""), ("agent", "small"), ("provider", "sim"), ("waiting", "true"))
    assert samples[("agentbus_agent_share", share)] == 2
    # Without the config, only what the answers taught: no limit known, nothing shown.
    assert status.windows(db, adm.settings, None, clock.now) == []


def test_the_provider_s_slots_are_shared_out_while_an_agent_waits_for_one(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    slots = CONFIG.format(extra="").replace("rpm = 6", "concurrency = 4")
    adm = admission(db, clock, tmp_path, text=slots)
    (c,) = adm.resolve(models=None, role=None, agent="big").candidates

    def take(agent: str) -> Permit | Refusal:
        return adm.admit(c, agent=agent, task_id=1, lease_sec=600)

    big = [take("big") for _ in range(4)]  # nobody else waits: big may hold every slot
    assert all(isinstance(p, Permit) for p in big)
    refused = take("small")
    assert isinstance(refused, Refusal) and refused.gate == "provider_concurrency"
    # It waits for the provider's slots until its task is tried again (recheck 2 s)
    # plus the sweeper's look, a worker's poll and a recheck (5 s).
    assert waits(db) == [("small", 1.0, pytest.approx(clock.now + 2 + 5))]
    for permit in big[:2]:
        permit.__exit__(None, None, None)
    kept = take("big")  # 2 of its part of 2 held: the freed slots are kept for small
    assert isinstance(kept, Refusal) and kept.gate == "share"
    assert kept.code is Code.CONCURRENCY_FULL  # a slot refusal: waited for, then paused
    assert kept.retry_after == pytest.approx(clock.now + 2)
    assert kept.detail == (
        "share: agent big has 2 of its 2 of the 4 calls in flight for sim while 1 other agent waits"
    )
    small = [take("small"), take("small")]
    assert all(isinstance(p, Permit) for p in small)
    full = take("small")
    assert isinstance(full, Refusal) and full.gate == "provider_concurrency"
    small[0].__exit__(None, None, None)
    assert isinstance(take("big"), Refusal)  # still at its part
    assert isinstance(take("small"), Permit)  # within its part
    from agentbus.admin import render, status

    doc = status.snapshot(db, adm.settings, clock.now, kpis=False, catalog=adm.catalog)
    assert doc["windows"] == [
        {
            "provider": "sim",
            "account": "*",
            "window_sec": 60.0,
            "windows": {"concurrency": {"limit": 4, "learnt": False, "used": 4.0}},
            "agents": [
                # refused its share, big waits too: each keeps its part of the slots
                {"agent": "big", "share": 1.0, "waiting": True, "used": {"concurrency": 2.0}},
                {"agent": "small", "share": 1.0, "waiting": True, "used": {"concurrency": 2.0}},
            ],
        }
    ]
    assert "sim/*    concurrency  4 / 4" in render.status(doc, adm.settings)
    # Once its wait lapses (it did not come back), the slots are big's again.
    big[2].__exit__(None, None, None)
    clock.advance(10)
    assert isinstance(take("big"), Permit)


def test_a_model_s_own_token_window_is_shared_out_too(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    """A provider that limits tokens per model: the agents that call the model share its
    window through the account as they share the account's."""
    model = '[models."sim/m"]\nprovider = "sim"\ntpm = 300\n'
    adm = admission(
        db, clock, tmp_path, text=CONFIG.format(extra="").replace("rpm = 6", "") + model
    )
    (c,) = adm.resolve(models=None, role=None, agent="big").candidates
    start = clock.now

    def call(agent: str) -> Permit | Refusal:
        answer = adm.admit(c, agent=agent, task_id=1, lease_sec=60, request=Tokens(50, 0))
        if isinstance(answer, Permit):
            answer.__exit__(None, None, None)
        return answer

    for _ in range(6):  # nobody else waits: big may fill the model's window
        assert isinstance(call("big"), Permit)
    refused = call("small")
    assert isinstance(refused, Refusal) and refused.gate == "model_tpm"
    assert waits(db)[0][0] == "small"
    clock.now = start + 60.5  # all six left: big may take its half, 150
    for _ in range(3):
        assert isinstance(call("big"), Permit)
    kept = call("big")
    assert isinstance(kept, Refusal) and kept.gate == "share"
    assert kept.detail == (
        "share: agent big has 150 of its 150 of model_tpm 300 for sim/m through sim/- "
        "while 1 other agent waits"
    )
    for _ in range(3):
        assert isinstance(call("small"), Permit)
