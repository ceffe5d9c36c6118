"""``busctl demo`` end to end: real sweeper and worker processes, nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agentbus.admin import kpi
from agentbus.db import Database
from agentbus.queue import reads
from tests.support import clean_env, wait_until

pytestmark = pytest.mark.process
BUSCTL = str(Path(sys.executable).with_name("busctl"))


def children_of(url: str) -> list[int]:
    """Processes whose environment names this database (the demo's children)."""
    found = []
    needle = f"AGENTBUS_DATABASE_URL={url}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def demo_env(tmp_path: Path) -> dict[str, str]:
    """The demo's environment: its working folder (config, logs) made under ``tmp_path``,
    the temporary folder of its run, not in the machine's /tmp."""
    return {**clean_env(), "TMPDIR": str(tmp_path)}


def test_quick_demo_runs_to_completion(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    done = subprocess.run(
        [BUSCTL, "--db", url, "demo", "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        env=demo_env(tmp_path),
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(list(tmp_path.glob("agentbus-demo-*/sweeper.log"))) == 1
    assert "15 of 15 tasks done" in done.stdout
    assert "preservation" in done.stdout and "PASS" in done.stdout
    db = Database(url)
    counts = reads.counts(db)
    assert sum(n for (status, _), n in counts.items() if status == "done") == 15
    assert sum(counts.values()) == 15
    k1, _, _, k4 = kpi.compute(db)
    assert k1.denominator > 0 and k1.value == 100.0
    assert k4.value == 0
    db.dispose()
    assert children_of(url) == []


def test_ctrl_c_stops_every_child(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    with (tmp_path / "demo.out").open("wb") as out:
        demo = subprocess.Popen(
            [BUSCTL, "--db", url, "demo"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=demo_env(tmp_path),
            start_new_session=True,
        )
    try:
        wait_until(lambda: len(children_of(url)) == 4, timeout=60)
        os.killpg(demo.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        demo.wait(timeout=60)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    assert demo.returncode == 130
    assert children_of(url) == []
