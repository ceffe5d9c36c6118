"""The worker's pure decisions."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agentbus.admission.gates import cooldown_until
from agentbus.config import Settings
from agentbus.providers.outcomes import Failed, RateLimited, TimedOut
from agentbus.worker import policy

S = Settings()
COOLDOWNS = (S.model_cooldown_sec, S.model_timeout_cooldown_sec)
STEPS = S.backoff_steps()


def test_cooldown_lengths_and_retry_after() -> None:
    assert cooldown_until(RateLimited("429"), 100.0, *COOLDOWNS) == 280.0
    assert cooldown_until(RateLimited("429", retry_after_sec=30), 100.0, *COOLDOWNS) == 280.0
    assert cooldown_until(RateLimited("429", retry_after_sec=600), 100.0, *COOLDOWNS) == 700.0
    assert cooldown_until(TimedOut("slow"), 100.0, *COOLDOWNS) == 1900.0


def test_failures_spend_attempts_with_growing_delay() -> None:
    err = Failed("HTTP 500", retryable=True)
    assert policy.after_failure(err, 0, 3, 0.0, S) == policy.Requeue(10.0, "HTTP 500")
    assert policy.after_failure(err, 1, 3, 0.0, S) == policy.Requeue(20.0, "HTTP 500")
    assert policy.after_failure(err, 2, 3, 0.0, S) == policy.Fail(
        "attempts exhausted (3/3): HTTP 500"
    )
    capped = policy.after_failure(err, 20, 100, 0.0, S)
    assert capped == policy.Requeue(S.retry_backoff_max_sec, "HTTP 500")
    assert policy.after_failure(Failed("HTTP 400", False), 0, 3, 0.0, S) == policy.Fail("HTTP 400")


def test_no_candidate_left() -> None:
    pause = policy.when_no_candidate_left({"a": 300.0, "b": 200.0}, [])
    assert pause == policy.Pause(200.0, "b", policy.ALL_COOLING, {"a": 300.0, "b": 200.0})
    # A refused credential next to a cooling model: wait for the cooldown.
    assert isinstance(policy.when_no_candidate_left({"a": 1.0}, ["b: 401"]), policy.Pause)
    assert policy.when_no_candidate_left({}, ["b: 401"]) == policy.Fail("no usable model: b: 401")


def test_backoff_thresholds_of_the_older_system() -> None:
    expected = {0: 0, 1: 0, 2: 0, 3: 30, 4: 30, 5: 60, 9: 60, 10: 300, 50: 300}
    assert {n: policy.backoff_sec(n, STEPS) for n in expected} == expected


@given(st.integers(0, 1000), st.integers(0, 1000))
def test_backoff_never_shrinks_as_failures_grow(a: int, b: int) -> None:
    lo, hi = sorted((a, b))
    assert policy.backoff_sec(lo, STEPS) <= policy.backoff_sec(hi, STEPS)


@given(st.floats(0, 1e6), st.one_of(st.none(), st.floats(0, 1e5)))
def test_a_cooldown_is_never_shorter_than_asked(now: float, retry_after: float | None) -> None:
    until = cooldown_until(RateLimited("x", retry_after_sec=retry_after), now, *COOLDOWNS)
    assert until >= now + S.model_cooldown_sec
    assert until >= now + (retry_after or 0)
