"""A token window shared by four real worker processes (SQLite, PostgreSQL, and
PostgreSQL through PgBouncer), judged from the database and the simulated
provider's journal."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from agentbus.db import Database
from agentbus.queue import TaskQueue, reads
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import call_slots
from tests.support import Proc, wait_until
from tests.test_admission_process import journal, live_queue, setup, statuses, stop, workers

__all__ = ["live_queue"]  # the fixture, for the tests here
pytestmark = pytest.mark.process

WINDOW = 4
LIMIT = 1040  # five calls of 108 + 100 tokens
TOKENS = """
rpm_window_sec = 4
[providers.sim]
kind = "simulated"
tpm = 1040
"""
#: 400 characters and max_tokens 100: estimated 100 + 8 input and 100 output tokens. The
#: simulated answer reports 22 input tokens more (20 %, the estimate's worst measured
#: error): a window then holds at most LIMIT and the error of the calls in flight when
#: the last of its calls was admitted, one per worker.
TEXT = "word " * 80
ERROR = 22
SCRIPT = {"sim/a": {"usage": {"prompt_tokens": 108 + ERROR, "completion_tokens": 100}}}
WORKERS = 4


def enqueue(queue: TaskQueue, n: int, max_tokens: int = 100) -> list[int]:
    payload = {"params": {"max_tokens": max_tokens}, "simulate": SCRIPT}
    return [
        queue.enqueue(TaskSpec(agent="codex", command=TEXT, payload=payload, models=("sim/a",))).id
        for _ in range(n)
    ]


def most_tokens_in_window(rows: list[tuple[float, int]], window: float) -> int:
    """The most tokens the calls admitted in any ``window`` seconds hold."""
    rows = sorted(rows)
    return max(
        (sum(n for at, n in rows[i:] if at < start + window) for i, (start, _) in enumerate(rows)),
        default=0,
    )


def test_four_workers_share_a_token_window_and_pause_until_it_has_room(
    db_url: str, live_queue: TaskQueue, spawn: Callable[..., object], tmp_path: Path
) -> None:
    queue = live_queue
    db = queue.db
    env, calls = setup(tmp_path, TOKENS)
    ids = enqueue(queue, 15)
    (huge,) = enqueue(queue, 1, max_tokens=2000)  # 2,108 tokens: more than the window
    drained = workers(spawn, db_url, env, WORKERS, "--drain")  # type: ignore[arg-type]
    assert [p.wait() for p in drained] == [0] * WORKERS, [p.text()[-2000:] for p in drained]

    failed = queue.get(huge)
    assert failed is not None and failed.status == "failed"
    assert failed.last_error == (
        "no usable model: sim/a: tpm: the call needs ~2,108 tokens, more than the "
        "1,040 per 4s sim/- ever admits"
    )
    (route,) = reads.routes(db, task_id=huge)
    assert route["decision"] == "refuse" and route["code"] == "too_large"

    def admitted() -> list[tuple[float, int]]:
        rows = db.read(
            lambda conn: conn.execute(
                sa.select(
                    call_slots.c.admitted_at, call_slots.c.tokens_in + call_slots.c.tokens_out
                )
            ).all()
        )
        return [(at, int(n)) for at, n in rows]

    first = admitted()
    assert first and all(n == 208 + ERROR for _, n in first)  # reserved 208, then reported
    paused = [t for t in (queue.get(i) for i in ids) if t is not None and t.status == "paused"]
    assert paused and len(paused) + len(first) == len(ids)
    for task in paused:
        assert "rate_limited" in (task.pause_reason or "")
        (route,) = reads.routes(db, task_id=task.id)
        assert route["refusal"]["gate"] == "tpm" and route["retry_after"] == task.resume_after
        # Exactly when a call admitted before the refusal leaves the window.
        assert task.resume_after is not None
        assert any(task.resume_after == pytest.approx(at + WINDOW) for at, _ in first)

    # The sweeper resumes them as the window frees; the limit holds throughout.
    procs = [*workers(spawn, db_url, env, WORKERS), spawn("sweeper", "--db", db_url, env=env)]  # type: ignore[arg-type]
    wait_until(lambda: set(statuses(db, ids).values()) == {"done"}, timeout=90)
    stop(procs)  # type: ignore[arg-type]
    assert sorted(c["task_id"] for c in journal(calls)) == sorted(ids)  # each called once
    rows = admitted()
    assert len(rows) == len(ids)
    assert most_tokens_in_window(rows, WINDOW) <= LIMIT + WORKERS * ERROR


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[providers.sim]\nkind = 'simulated'\ntpm = -5\n", "tpm must be a whole number"),
        (
            "[providers.sim]\nkind = 'simulated'\n"
            "[agents.codex]\nmodels = ['sim/a']\nshare = 'lots'\n",
            "share must be a positive number",
        ),
        ("[agents.ghost]\nshare = 2\n", "give either role or models"),
        (
            "[providers.sim]\nkind = 'simulated'\n[models.'sim/a']\nprovider = 'sim'\n"
            "params = { max_tokens = 3000000000 }\n",
            "max_tokens must be a whole number from 1 to",
        ),
    ],
)
def test_a_bad_token_limit_or_share_is_one_line_and_exit_2(
    db_url: str,
    run_busctl: Callable[..., subprocess.CompletedProcess[str]],
    spawn: Callable[..., Proc],
    tmp_path: Path,
    body: str,
    message: str,
) -> None:
    """The worker and busctl refuse the config before they touch the database."""
    config = tmp_path / "agentbus.toml"
    config.write_text(body)
    worker = spawn("worker", "--agent", "codex", "--db", db_url, "--config", str(config))
    assert worker.wait() == 2
    lines = Path(worker.log_path).read_text().strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    enqueued = run_busctl(
        "--db", db_url, "--config", str(config), "enqueue", "--agent", "codex", "hi"
    )
    assert enqueued.returncode == 2 and message in enqueued.stderr, enqueued.stderr
    assert len(enqueued.stderr.strip().splitlines()) == 1
    db = Database(db_url)
    assert reads.counts(db) == {}
    db.dispose()
