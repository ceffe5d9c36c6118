"""Token windows (tpm, itpm, otpm per provider account): the estimate of a call, the
window that admits it against the database (SQLite and Postgres, an injected clock),
the answer's usage replacing the estimate, and a call too large to ever be admitted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from agentbus.admission import tokens
from agentbus.admission.admission import Admission, Permit
from agentbus.admission.cooldowns import CooldownStore
from agentbus.admission.gates import Code, Refusal
from agentbus.admission.permits import Permits
from agentbus.admission.routing import Candidate
from agentbus.admission.tokens import Request, Tokens
from agentbus.catalog import parse_catalog
from agentbus.config import load_config
from agentbus.db import Database
from agentbus.errors import ConfigError, Refused
from agentbus.providers.outcomes import Failed, RateLimited, Succeeded, Usage
from agentbus.schema import account_demand, account_limits, call_slots
from tests.support import FakeClock

# -- the estimate -------------------------------------------------------------


def test_the_input_estimate_is_characters_over_four_plus_framing_per_message() -> None:
    text = "x" * 400
    assert tokens.estimate(text, {}, {}, 1024) == Tokens(100 + 4 * 2, 1024)
    payload = {
        "system": "s" * 40,
        "messages": [
            {"role": "user", "content": "u" * 41},
            {"role": "assistant", "content": [{"type": "text", "text": "a" * 40}]},
        ],
    }
    # system 40 + 41 + 40 + the task text as the last user turn (400): 521 chars -> 131
    assert tokens.estimate(text, payload, {}, 1024).input == 131 + 4 * 4
    # Digits and punctuation make short tokens: each counts twice.
    assert tokens.estimate("12, 34" * 100, {}, {}, 1).input == (600 + 500) // 4 + 4 * 2


def test_the_output_estimate_is_what_the_call_may_answer_at_most() -> None:
    assert tokens.estimate("hi", {}, {"max_tokens": 300}, 1024).output == 300
    assert tokens.estimate("hi", {}, {"max_completion_tokens": 70, "n": 3}, 1024).output == 210
    assert tokens.estimate("hi", {}, {}, 555).output == 555


def test_tools_and_payloads_that_are_not_a_conversation_count_by_their_json() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    plain = tokens.estimate("hi", {}, {}, 1).input
    assert tokens.estimate("hi", {}, {"tools": tools}, 1).input > plain
    odd = {"messages": "not a list", "blob": "z" * 4000}  # a command provider's own shape
    assert tokens.estimate("hi", odd, {}, 1).input >= 1000


# -- the catalog --------------------------------------------------------------


def test_token_limits_are_set_per_provider_and_overridden_per_account() -> None:
    catalog = parse_catalog(
        {
            "providers": {
                "sim": {
                    "kind": "simulated",
                    "rpm": 60,
                    "tpm": 1000,
                    "otpm": 300,
                    "accounts": {"a": {}, "b": {"tpm": 5000, "itpm": 4000}},
                }
            }
        }
    )
    a, b = catalog.provider("sim").accounts
    assert (a.rpm, a.token_limits) == (60, {"tpm": 1000, "otpm": 300})
    assert (b.rpm, b.token_limits) == (60, {"tpm": 5000, "itpm": 4000, "otpm": 300})


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tpm": -5}, r"\[providers.sim\] tpm must be a whole number of at least 1, got -5"),
        ({"itpm": "lots"}, "itpm must be a whole number of at least 1, got 'lots'"),
        ({"otpm": 2.5}, "otpm must be a whole number"),
        ({"tpm": True}, "tpm must be a whole number"),
        ({"accounts": {"a": {"tpm": 0}}}, "account 'a' tpm must be a whole number"),
        ({"accounts": {"a": {"tokens": 9}}}, "account 'a'"),
    ],
)
def test_bad_token_limits_are_one_clear_error(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_catalog({"providers": {"sim": {"kind": "simulated", **body}}})


def test_an_output_estimate_out_of_range_is_refused_at_load(tmp_path: Path) -> None:
    path = tmp_path / "agentbus.toml"
    path.write_text("output_token_estimate = 0\n")
    with pytest.raises(ConfigError, match="output_token_estimate must be a whole number"):
        load_config(path, environ={})
    model = '[providers.sim]\nkind = "simulated"\n[models."sim/x"]\nprovider = "sim"\n'
    path.write_text(model + "params = { max_tokens = 9e99 }\n")
    with pytest.raises(ConfigError, match="max_tokens must be a whole number"):
        load_config(path, environ={})
    path.write_text(model + "params = { max_tokens = 3000000000 }\n")
    with pytest.raises(ConfigError, match="max_tokens must be a whole number from 1 to"):
        load_config(path, environ={})


# -- the windows --------------------------------------------------------------

CONFIG = """
rpm_window_sec = 60
admission_wait_ms = 0
[providers.sim]
kind = "simulated"
{limits}
[providers.sim.accounts.a]
[providers.sim.accounts.b]
"""


def admissions(
    db: Database, clock: FakeClock, tmp_path: Path, limits: str, n: int = 2
) -> list[Admission]:
    """``n`` admissions (as ``n`` workers) sharing the database, on one config."""
    path = tmp_path / "agentbus.toml"
    path.write_text(CONFIG.format(limits=limits))
    config = load_config(path, environ={})
    return [
        Admission(
            db,
            config,
            worker=f"w{i}",
            cooldowns=CooldownStore(db, clock=clock, cache_sec=1e-9),
            environ={},
            clock=clock,
            cache_sec=1e-9,
        )
        for i in range(n)
    ]


def account(adm: Admission, name: str = "a", model: str = "sim/m") -> Candidate:
    found = adm.resolve(models=(model,), role=None, agent="codex")
    return next(c for c in found.candidates if c.account == name)


def call(chars: int, max_tokens: int) -> Request:
    """A call of ``chars`` characters of task text: ``chars / 4 + 8`` input tokens."""
    return Request("x" * chars, {"params": {"max_tokens": max_tokens}})


def ask(
    adm: Admission, request: Request | None, name: str = "a", model: str = "sim/m"
) -> Permit | Refusal:
    c = account(adm, name, model)
    return adm.admit(c, agent="codex", task_id=1, lease_sec=60, request=request)


def reserved(db: Database) -> list[tuple[Any, ...]]:
    return [
        tuple(row)
        for row in db.read(
            lambda conn: conn.execute(
                sa.select(call_slots.c.tokens_in, call_slots.c.tokens_out).order_by(call_slots.c.id)
            ).all()
        )
    ]


def test_tpm_admits_while_the_estimate_fits_and_says_exactly_when_it_will(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    one, two = admissions(db, clock, tmp_path, "tpm = 1000")
    start = clock.now
    for i in range(4):  # 108 in + 100 out each: 832 of 1000, from two workers in turn
        permit = ask((one, two)[i % 2], call(400, 100))
        assert isinstance(permit, Permit), permit
        permit.__exit__(None, None, None)  # no answer: the estimate stays
        clock.advance(10)
    assert reserved(db) == [(108, 100)] * 4
    refusal = ask(one, call(400, 100))  # 832 + 208 > 1000: the oldest call must leave
    assert isinstance(refusal, Refusal) and refusal.code is Code.RATE_LIMITED
    assert refusal.retry_after == pytest.approx(start + 60)
    assert refusal.as_dict(clock.now) == {
        "code": -32000,
        "name": "rate_limited",
        "retry_after_ms": 20_000,
        "suggested_action": "DO_NOT_RETRY_IMMEDIATELY",
        "gate": "tpm",
        "detail": "tpm: 1,000 tokens per 60s for sim/a",
    }
    larger = ask(two, call(1600, 100))  # 408 + 100: two calls must leave first
    assert isinstance(larger, Refusal) and larger.retry_after == pytest.approx(start + 70)
    assert isinstance(ask(one, call(400, 100), "b"), Permit)  # per account
    # 9 + 160 tokens would make 1,001; 9 + 159 fill the window exactly.
    assert isinstance(ask(one, Request("x", {"params": {"max_tokens": 160}})), Refusal)
    assert isinstance(ask(one, Request("x", {"params": {"max_tokens": 159}})), Permit)
    clock.now = start + 60.001
    assert isinstance(ask(two, call(400, 100)), Permit)  # the oldest left
    assert len(reserved(db)) == 7  # nothing reserved by a refusal


def test_the_answer_s_usage_replaces_the_estimate(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    (adm,) = admissions(db, clock, tmp_path, "tpm = 1000", n=1)
    for _ in range(4):
        permit = ask(adm, call(400, 100))
        assert isinstance(permit, Permit)
        adm.finish(permit, Succeeded("ok", Usage(prompt_tokens=90, completion_tokens=10)))
    assert reserved(db) == [(90, 10)] * 4
    # 400 used, where the estimates held 832: the window has room for two more.
    # An answer that reports nothing leaves the estimate; so does one that failed.
    silent, failed = ask(adm, call(400, 100)), ask(adm, call(400, 100))
    assert isinstance(silent, Permit) and isinstance(failed, Permit)
    adm.finish(silent, Succeeded("ok"))
    adm.finish(failed, Failed("boom", retryable=True))
    assert reserved(db)[-2:] == [(108, 100), (108, 100)]
    assert isinstance(ask(adm, call(400, 100)), Refusal)  # 816 + 208 > 1000


def test_input_and_output_windows_count_their_own_side(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    (adm,) = admissions(db, clock, tmp_path, "itpm = 500\notpm = 250", n=1)
    assert isinstance(ask(adm, call(400, 100)), Permit)
    assert isinstance(ask(adm, call(400, 100)), Permit)
    refusal = ask(adm, call(40, 100))  # 18 input tokens fit; 300 output do not
    assert isinstance(refusal, Refusal) and refusal.gate == "otpm"
    assert refusal.gates is not None and refusal.gates["itpm"] == "ok"
    refusal = ask(adm, call(1200, 10))  # 308 input do not
    assert isinstance(refusal, Refusal) and refusal.gate == "itpm"
    assert isinstance(ask(adm, call(40, 10)), Permit)


def test_a_call_larger_than_the_window_is_refused_for_good(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    (adm,) = admissions(db, clock, tmp_path, "tpm = 1000", n=1)
    refusal = ask(adm, call(400, 2000))
    assert isinstance(refusal, Refusal) and refusal.code is Code.TOO_LARGE
    assert refusal.gate == "tpm" and refusal.as_dict(clock.now)["suggested_action"] == (
        "DO_NOT_RETRY"
    )
    assert refusal.detail == (
        "tpm: the call needs ~2,108 tokens, more than the 1,000 per 60s sim/a ever admits"
    )
    assert reserved(db) == []
    waits = db.read(
        lambda conn: conn.execute(sa.select(sa.func.count()).select_from(account_demand)).scalar()
    )
    assert waits == 0  # nothing to wait for


def test_a_call_of_unknown_size_is_admitted_while_the_window_has_room(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    """An inner permit (an agent's own SDK call) says nothing of its size before: it
    reserves nothing, and counts what it reports after."""
    (adm,) = admissions(db, clock, tmp_path, "tpm = 1000", n=1)
    permit = ask(adm, None)
    assert isinstance(permit, Permit)
    adm.finish(permit, Succeeded("ok", Usage(prompt_tokens=900, completion_tokens=150)))
    assert reserved(db) == [(900, 150)]
    refusal = ask(adm, None)  # the window is over its limit
    assert isinstance(refusal, Refusal) and refusal.gate == "tpm"
    peeked = adm.peek(account(adm), agent="codex")
    assert isinstance(peeked, Refusal) and peeked.retry_after == refusal.retry_after


def test_a_model_without_a_configured_window_learns_the_one_its_answers_announce(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    one, two = admissions(db, clock, tmp_path, "otpm = 5000")
    said = Succeeded("ok", Usage(108, 100), announced=(("tpm", 500, 292), ("otpm", 99, 0)))
    permit = ask(one, call(400, 100))  # no token window yet but otpm
    assert isinstance(permit, Permit)
    one.finish(permit, said)
    learnt = account_limits.c
    rows = db.read(
        lambda conn: conn.execute(
            sa.select(learnt.gate, learnt.size, learnt.account, learnt.model)
        ).all()
    )
    assert [tuple(r) for r in rows] == [("tpm", 500, "a", "sim/m")]  # configured otpm wins
    # Every process takes it up at its next read: the model's window has 208 of 500 used.
    assert isinstance(ask(two, call(400, 100)), Permit)  # 416
    refusal = ask(two, call(400, 100))  # 624 > 500
    assert isinstance(refusal, Refusal) and refusal.gate == "model_tpm"
    assert refusal.detail == "model_tpm: 500 tokens per 60s for sim/m through sim/a"
    assert isinstance(ask(two, call(400, 100), "b"), Permit)  # account b learnt nothing
    # The headers are the answering model's: another model has its own window.
    other = ask(one, call(400, 100), model="sim/n")
    assert isinstance(other, Permit)
    one.finish(other, Succeeded("ok", Usage(108, 100), announced=(("tpm", 800, None),)))
    assert isinstance(ask(two, call(400, 100), model="sim/n"), Permit)  # 416 of 800
    assert isinstance(ask(two, call(400, 100)), Refusal)  # sim/m: still 500
    # A later announcement replaces it; the same one again writes nothing.
    for size in (500, 5000, 5000):
        permit = ask(one, None, "b")
        assert isinstance(permit, Permit)
        one.finish(permit, Succeeded("ok", Usage(1, 1), announced=(("tpm", size, None),)))
        clock.advance(1)
    rows = db.read(
        lambda conn: conn.execute(
            sa.select(account_limits.c.size, account_limits.c.observed_at).where(
                account_limits.c.account == "b"
            )
        ).all()
    )
    assert [tuple(r) for r in rows] == [(5000, clock.now - 2)]
    assert isinstance(ask(two, call(400, 100)), Refusal)  # account a: still 500
    assert isinstance(ask(two, call(400, 100), "b"), Permit)  # b: 5000


def test_what_an_announced_window_has_left_counts_the_account_s_other_clients(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    (adm,) = admissions(db, clock, tmp_path, "", n=1)
    permit = ask(adm, call(400, 100))  # no window known yet: nothing is reserved
    assert isinstance(permit, Permit) and permit.slot_id is None
    start = clock.now
    adm.finish(permit, Succeeded("ok", Usage(108, 100), announced=(("tpm", 1000, 200),)))
    # 800 used by the provider's count, none by the window's: 800 from elsewhere.
    assert reserved(db) == [(800, 0)]
    clock.advance(5)
    refusal = ask(adm, call(400, 100))  # 800 + 208 > 1000
    assert isinstance(refusal, Refusal) and refusal.gate == "model_tpm"
    assert refusal.retry_after == pytest.approx(start + 60)
    small = ask(adm, Request("x", {"params": {"max_tokens": 150}}))  # 159: fits
    assert isinstance(small, Permit)
    # Said again with as much used: the window holds it already, nothing is added; less
    # than half the window used is not counted at all.
    adm.finish(small, Succeeded("ok", Usage(9, 150), announced=(("tpm", 1000, 41),)))
    unknown = ask(adm, None)
    assert isinstance(unknown, Permit)
    adm.finish(unknown, Succeeded("ok", Usage(0, 0), announced=(("tpm", 1000, 600),)))
    assert reserved(db) == [(800, 0), (9, 150), (0, 0)]


def test_a_429_teaches_the_window_it_announces_and_that_it_is_spent(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    """The first a fleet hears of a token limit is often its refusal: the 429's headers
    set the window's size, and its "nothing remains" fills the window until it drains."""
    one, two = admissions(db, clock, tmp_path, "")
    permit = ask(one, call(400, 100))
    assert isinstance(permit, Permit)
    refused = RateLimited("HTTP 429", retry_after_sec=7.0, announced=(("tpm", 1000, 0),))
    one.finish(permit, refused)
    learnt = sa.select(account_limits.c.account, account_limits.c.gate, account_limits.c.size)
    rows = db.read(lambda conn: conn.execute(learnt).all())
    assert [tuple(r) for r in rows] == [("a", "tpm", 1000)]
    assert reserved(db) == [(1000, 0)]  # the provider's count: the whole window, elsewhere
    # The model cools (the 429), and every process's window for it is full besides.
    refusal = ask(two, call(40, 10))
    assert isinstance(refusal, Refusal) and refusal.gate == "cooldown"
    assert refusal.gates["model_tpm"] == "refused"
    assert isinstance(ask(two, call(40, 10), "b"), Permit)  # account b heard nothing


def test_an_inner_permit_holds_the_tokens_it_says_it_uses(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    (adm,) = admissions(db, clock, tmp_path, "tpm = 1000", n=1)
    permits = Permits(adm)
    with permits.permit("sim/m", agent="codex", tokens=900) as first:
        assert first.account == "a"
        with permits.permit("sim/m", agent="codex", tokens=200) as second:
            assert second.account == "b"  # a holds 900: 1,100 would not fit
            second.report(usage={"prompt_tokens": 150, "completion_tokens": 40})
    assert reserved(db) == [(900, 0), (150, 40)]
    with pytest.raises(Refused) as refused, permits.permit("sim/m", agent="codex", tokens=1001):
        pass
    assert refused.value.name == "too_large"


def test_a_model_s_own_window_counts_its_calls_and_the_account_s_counts_all(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    limits = 'tpm = 1000\n[models."sim/m"]\nprovider = "sim"\ntpm = 500'
    (adm,) = admissions(db, clock, tmp_path, limits, n=1)
    assert isinstance(ask(adm, call(400, 100)), Permit)
    assert isinstance(ask(adm, call(400, 100)), Permit)  # sim/m: 416 of its 500
    refusal = ask(adm, call(400, 100))
    assert isinstance(refusal, Refusal) and refusal.gate == "model_tpm"
    assert refusal.gates is not None and refusal.gates["tpm"] == "ok"
    assert isinstance(ask(adm, call(400, 100), model="sim/n"), Permit)  # account: 624
    assert isinstance(ask(adm, call(400, 100), model="sim/n"), Permit)  # 832
    refusal = ask(adm, call(400, 100), model="sim/n")  # 1,040 of the account's 1,000
    assert isinstance(refusal, Refusal) and refusal.gate == "tpm"
    too_large = ask(adm, call(400, 450))  # 558 > the model's 500
    assert isinstance(too_large, Refusal) and too_large.code is Code.TOO_LARGE
    assert too_large.detail.startswith("model_tpm: the call needs ~558 tokens")


def test_params_that_are_not_whole_numbers_count_as_not_given() -> None:
    """A row written by hand can carry anything: the estimate never raises on it."""
    odd = {"max_tokens": "lots", "n": 2.5}
    assert tokens.estimate("hi", {}, odd, 777).output == 777
    assert tokens.estimate("hi", {}, {"max_tokens": True, "n": 0}, 5).output == 5


# -- the sweeper's look before it resumes -------------------------------------


def test_the_sweeper_resumes_only_the_paused_calls_that_fit_the_window(
    db: Database, clock: FakeClock, tmp_path: Path
) -> None:
    """A resume that the window cannot take would only pause again: each due task's
    estimate is spent from the tokens the window has left, in resume order."""
    from agentbus.config import LiveConfig
    from agentbus.queue.tasks import TaskSpec
    from agentbus.sweeper import jobs

    (adm,) = admissions(db, clock, tmp_path, "tpm = 1000", n=1)
    s = jobs.Sweep(db, LiveConfig(load_config(tmp_path / "agentbus.toml", environ={})), clock=clock)
    start = clock.now
    for name in ("a", "b"):  # both accounts' windows: 800 of 1000 used
        held = ask(adm, None, name)
        assert isinstance(held, Permit)
        adm.finish(held, Succeeded("ok", Usage(prompt_tokens=800, completion_tokens=0)))

    def paused(chars: int) -> int:  # chars / 4 + 8 + 10 tokens
        spec = TaskSpec(
            agent="codex",
            command="x" * chars,
            models=("sim/m",),
            payload={"params": {"max_tokens": 10}},
        )
        task_id = s.queue.enqueue(spec).id
        (task,) = s.queue.claim("codex", "w", 30)
        s.queue.pause(task.id, task.claim_token, clock.now, "tpm", model="sim/m")
        return task_id

    small, large, medium = paused(40), paused(800), paused(100)  # 28, 218 and 43 tokens
    clock.advance(1)
    assert jobs.resume(s) == {"resumed": 2, "postponed": 1, "held": 0}
    assert [s.queue.get(t).status for t in (small, large, medium)] == ["queued", "paused", "queued"]
    recheck = s.settings.admission_recheck_sec
    assert s.queue.get(large).resume_after == clock.now + recheck  # 200 left; 71 resumed
    # Alone, it is asked for by its size: refused until the 800 tokens leave the window.
    clock.advance(recheck)
    assert jobs.resume(s)["postponed"] == 1
    assert s.queue.get(large).resume_after == pytest.approx(start + 60)
