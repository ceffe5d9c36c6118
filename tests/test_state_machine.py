"""Only the legal transitions of the state machine ever succeed (hypothesis, stateful).

The machine drives one task through random queue operations (including ones
with a stale claim token) on a real database and checks, after every step,
that an operation succeeded exactly when the model says it is legal, that a
refused one changed nothing, and that the event log follows the status.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from agentbus.errors import TransitionRejected
from agentbus.queue import TaskQueue, reads
from agentbus.queue.states import TRANSITIONS, TaskStatus, is_legal
from agentbus.queue.tasks import TaskSpec
from tests.support import FakeClock

S = TaskStatus
ACTIONS = [
    "complete",
    "fail",
    "error",
    "pause",
    "release",
    "requeue",
    "rescue",
    "rescue_fail",
    "expire",
]


def test_transition_table_is_spec_section_2() -> None:
    legal = {
        (S.QUEUED, S.CLAIMED),
        (S.CLAIMED, S.DONE),
        (S.CLAIMED, S.PAUSED),
        (S.CLAIMED, S.FAILED),
        (S.CLAIMED, S.ERROR),
        (S.PAUSED, S.QUEUED),
        (S.PAUSED, S.FAILED),
        (S.CLAIMED, S.QUEUED),
        (S.FAILED, S.QUEUED),
        (S.ERROR, S.QUEUED),
        # Cancelled by an operator or a producer, and retried by one.
        (S.QUEUED, S.CANCELLED),
        (S.PAUSED, S.CANCELLED),
        (S.CLAIMED, S.CANCELLED),
        (S.CANCELLED, S.QUEUED),
        # A row written by hand that no worker can run is failed by the sweeper.
        (S.QUEUED, S.FAILED),
    }
    assert {(a, b) for a in S for b in S if is_legal(a, b)} == legal


def make_machine(queue: TaskQueue, clock: FakeClock) -> type[RuleBasedStateMachine]:
    runs = iter(range(1_000_000))

    class TaskMachine(RuleBasedStateMachine):
        @initialize()
        def new_task(self) -> None:
            # Each run gets an agent of its own, so earlier runs' tasks are never claimed.
            self.agent = f"sm{next(runs)}"
            self.task_id = queue.enqueue(
                TaskSpec(agent=self.agent, command="x", models=("sim/a",), max_attempts=1000)
            ).id
            self.status = S.QUEUED
            self.token = 0
            self.stale = 0  # a token that was superseded (none yet)

        def _attempt(self, action: str, op: Callable[[], object]) -> None:
            sources, target = TRANSITIONS[action]
            legal = self.status in sources
            before = reads.get_task(queue.db, self.task_id)
            n_events = len(reads.task_events(queue.db, self.task_id))
            try:
                op()
            except TransitionRejected:
                assert not legal, f"{action} from {self.status} was refused"
                assert reads.get_task(queue.db, self.task_id) == before
                assert len(reads.task_events(queue.db, self.task_id)) == n_events
                return
            assert legal, f"{action} from {self.status} was allowed"
            assert is_legal(self.status, target)
            self.status = target

        @rule()
        def claim(self) -> None:
            got = queue.claim(self.agent, "w", 30)
            if self.status is S.QUEUED:
                assert [t.id for t in got] == [self.task_id]
                self.stale, self.token = self.token, got[0].claim_token
                self.status = S.CLAIMED
            else:
                assert got == []

        @rule(action=st.sampled_from(ACTIONS), stale=st.booleans())
        def settle(self, action: str, stale: bool) -> None:
            token = self.stale if stale else self.token
            calls = {
                "complete": lambda: queue.complete(self.task_id, token, "ok"),
                "fail": lambda: queue.fail(self.task_id, token, "bad"),
                "error": lambda: queue.error(self.task_id, token, "bug"),
                "pause": lambda: queue.pause(self.task_id, token, clock.now + 9, "cooldown"),
                "release": lambda: queue.release(self.task_id, token),
                "requeue": lambda: queue.requeue(self.task_id, token, clock.now, "500"),
                "rescue": lambda: queue.rescue(self.task_id, token),
                "rescue_fail": lambda: queue.rescue(self.task_id, token, poison="x"),
                "expire": lambda: queue.expire(self.task_id, token, "deadline: passed"),
            }
            if action.startswith("rescue"):
                clock.advance(31)  # only an expired lease may be rescued
            if stale:
                before = reads.get_task(queue.db, self.task_id)
                with pytest.raises(TransitionRejected):
                    calls[action]()
                assert reads.get_task(queue.db, self.task_id) == before
                return
            self._attempt(action, calls[action])

        @rule()
        def resume(self) -> None:
            moved = queue.resume([self.task_id])
            assert (moved == [self.task_id]) == (self.status is S.PAUSED)
            if moved:
                self.status = S.QUEUED

        @rule()
        def demote(self) -> None:
            moved = queue.demote({self.task_id: self.agent}, "paused 48h")
            assert (moved == [self.task_id]) == (self.status is S.PAUSED)
            if moved:
                self.status = S.FAILED

        @rule()
        def cancel(self) -> None:
            moved = queue.cancel([self.task_id], by="test")
            cancellable = self.status in TRANSITIONS["cancel"][0]
            assert (moved == [self.task_id]) == cancellable
            if moved:
                self.status = S.CANCELLED

        @rule()
        def retry(self) -> None:
            self._attempt("retry", lambda: queue.retry(self.task_id))

        @invariant()
        def matches_database(self) -> None:
            if not hasattr(self, "task_id"):
                return
            assert reads.get_task(queue.db, self.task_id).status is self.status
            log = reads.task_events(queue.db, self.task_id)
            assert log[-1]["to_status"] == self.status.value
            for prev, cur in itertools.pairwise(log):
                assert prev["to_status"] == cur["from_status"]
                assert is_legal(S(cur["from_status"]), S(cur["to_status"]))

    return TaskMachine


def test_only_legal_transitions_succeed(queue: TaskQueue, clock: FakeClock) -> None:
    machine = make_machine(queue, clock)
    machine.TestCase.settings = settings(
        max_examples=25,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    machine.TestCase().runTest()
