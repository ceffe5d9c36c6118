"""The systemd units and launchd plists in scripts/ start the real services."""

from __future__ import annotations

import plistlib
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from agentbus.db import Database
from agentbus.migrations import migrate
from agentbus.schema import workers
from tests.support import Proc, wait_until

ROOT = Path(__file__).resolve().parents[1]
UNITS = ROOT / "scripts" / "systemd"
BIN = str(Path(sys.executable).parent)


def exec_start(unit: Path, instance: str = "codex") -> list[str]:
    line = next(x for x in unit.read_text().splitlines() if x.startswith("ExecStart="))
    argv = shlex.split(line.removeprefix("ExecStart=").replace("%i", instance))
    return [argv[0].replace("/srv/agentbus/.venv/bin", BIN), *argv[1:]]


@pytest.mark.process
@pytest.mark.parametrize("unit", ["agentbus-sweeper.service", "agentbus-worker@.service"])
def test_units_start_the_services_and_stop_on_sigterm(
    unit: str, tmp_path: Path, spawn: Callable[..., Proc]
) -> None:
    url = f"sqlite:///{tmp_path / 'bus.db'}"
    db = Database(url)
    migrate(db)
    argv = exec_start(UNITS / unit)
    assert Path(argv[0]).name in {"sweeper", "worker"}
    proc = spawn(Path(argv[0]).name, *argv[1:], env={"AGENTBUS_DATABASE_URL": url})
    if "worker" in unit:
        wait_until(
            lambda: (
                db.read(lambda c: c.execute(sa.select(workers.c.agent)).scalars().all())
                == ["codex"]
            )
        )
    else:
        wait_until(lambda: "sweeper_started" in proc.text())
    proc.signal(signal.SIGTERM)
    assert proc.wait() == 0
    db.dispose()


def test_units_verify_where_systemd_analyze_exists(tmp_path: Path) -> None:
    for unit in UNITS.iterdir():
        text = unit.read_text().replace("/srv/agentbus/.venv/bin", BIN)
        name = unit.name.replace("@.service", "@codex.service")
        (tmp_path / name).write_text(text.replace("User=agentbus", "User=root"))
        assert "ExecStart=" in text and "KillSignal=SIGTERM" in text
    tool = shutil.which("systemd-analyze")
    if tool is not None:
        done = subprocess.run(
            [tool, "verify", *map(str, tmp_path.iterdir())],
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr


def test_launchd_plists_parse_and_run_the_services() -> None:
    for path in (ROOT / "scripts" / "launchd").glob("*.plist"):
        plist = plistlib.loads(path.read_bytes())
        program = Path(plist["ProgramArguments"][0]).name
        assert program in {"sweeper", "worker"}
        assert plist["KeepAlive"] is True and plist["RunAtLoad"] is True
        if program == "worker":
            assert plist["ProgramArguments"][1:3] == ["--agent", "AGENT"]
