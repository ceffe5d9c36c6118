"""The built wheel installs one package, agentbus, and works from a directory full of
look-alikes: a user's own ``shared/``, ``migrations/`` and ``worker.py`` are never imported.

The wheel goes into a fresh virtual environment with ``--no-deps``; the
dependencies come from this environment's site-packages, named in a ``.pth``
file (a path line there adds the folder only: the editable install's own
``.pth`` files in it are not run, so the only agentbus is the wheel's).
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
import venv
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.support import own_engine

ROOT = Path(__file__).resolve().parent.parent
TRAP = "raise SystemExit('the user\\'s own {name} was imported')\n"

pytestmark = pytest.mark.process


@dataclass(frozen=True)
class Installed:
    wheel: Path
    bin: Path
    site_packages: Path


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    base = tmp_path_factory.mktemp("wheel")
    dist = base / "dist"
    source = base / "source"  # a copy: the build writes build/ and *.egg-info beside the code
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "tests"
        ),
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(source)],
        check=True,
        capture_output=True,
        text=True,
    )
    (wheel,) = dist.glob("agentbus-*.whl")
    env_dir = base / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        text=True,
    )
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (Path(purelib) / "borrowed-dependencies.pth").write_text("\n".join(ours) + "\n")
    yield Installed(wheel, env_dir / "bin", Path(purelib))


def test_the_wheel_has_one_top_level_package(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as whl:
        names = whl.namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"agentbus", f"{installed.wheel.name.split('-py')[0]}.dist-info"}
    for shipped in (
        "agentbus/py.typed",
        "agentbus/admin/dashboard.html",
        "agentbus/admin/kpi.sql",
        "agentbus/admin/agentbus.example.toml",
        "agentbus/migrations/env.py",
        "agentbus/migrations/versions/0001_legacy_bus_commands.py",
        "agentbus/worker/loop.py",
        "agentbus/sweeper/service.py",
    ):
        assert shipped in names
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    with zipfile.ZipFile(installed.wheel) as whl:
        text = whl.read(metadata).decode()
    assert "License-Expression: MIT" in text
    assert "Provides-Extra: postgres" in text


@pytest.fixture
def lookalikes(tmp_path: Path) -> Path:
    """A project directory with its own shared/, migrations/ and worker.py (each fails
    loudly if imported), as an orchestrator or a Flask-Migrate project has."""
    home = tmp_path / "orchestrator"
    (home / "shared").mkdir(parents=True)
    (home / "shared" / "__init__.py").write_text(TRAP.format(name="shared/"))
    (home / "shared" / "client.py").write_text(TRAP.format(name="shared/client.py"))
    (home / "migrations" / "versions").mkdir(parents=True)
    (home / "migrations" / "env.py").write_text(TRAP.format(name="migrations/env.py"))
    (home / "migrations" / "__init__.py").write_text(TRAP.format(name="migrations/"))
    (home / "migrations" / "versions" / "0001_theirs.py").write_text(
        "revision = 'theirs'\ndown_revision = None\n"
    )
    (home / "worker.py").write_text(TRAP.format(name="worker.py"))
    (home / "sweeper.py").write_text(TRAP.format(name="sweeper.py"))
    return home


def test_the_installed_wheel_works_beside_lookalikes(
    installed: Installed, lookalikes: Path, empty_db_url: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTBUS_", "PYTHON"))}
    env["AGENTBUS_DATABASE_URL"] = empty_db_url

    def run(program: str, *args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [str(installed.bin / program), *args],
            cwd=lookalikes,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, (program, args, done.stdout, done.stderr)
        return done

    run("busctl", "migrate")
    where = run("python", "-c", "import agentbus; print(agentbus.__file__)").stdout.strip()
    assert Path(where).is_relative_to(installed.site_packages)
    producer = textwrap.dedent(
        f"""
        import json, sys
        from agentbus import AgentBus
        with AgentBus({empty_db_url!r}) as bus:
            first = bus.enqueue("orchestra", "from the producer API", models=["sim/a"])
        print(json.dumps({{"id": first, "modules": sorted(m for m in sys.modules
              if m.split(".")[0] in ("shared", "migrations", "worker", "sweeper"))}}))
        """
    )
    made = json.loads(run("python", "-c", producer).stdout)
    assert made["modules"] == []
    second = int(run("busctl", "enqueue", "--agent", "orchestra", "--models", "sim/a", "hi").stdout)
    run("worker", "--agent", "orchestra", "--drain")
    run("sweeper", "--once")
    assert "kpi" in run("busctl", "kpi", "--sql").stdout.lower()
    for program in ("busctl", "worker", "sweeper"):
        assert "0.1.0" in run(program, "--version").stdout

    engine = own_engine(empty_db_url)
    try:
        with engine.connect() as conn:
            statuses = dict(
                conn.execute(
                    sa.text("SELECT id, status FROM bus_commands WHERE id IN (:a, :b)").bindparams(
                        a=made["id"], b=second
                    )
                ).all()
            )
    finally:
        engine.dispose()
    assert statuses == {made["id"]: "done", second: "done"}
