"""Start-up of the console commands, for scripts/bench.py: what a user waits for at the
prompt, from exec to exit (the interpreter, imports, the command's work)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path


def bench(runs: int) -> list[tuple[str, ...]]:
    """Wall time of a command from exec to exit, median and max of ``runs``: what a
    user waits for at the prompt (the interpreter, imports, the command's work)."""
    bin_dir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/startup.db"
        subprocess.run(
            [str(bin_dir / "busctl"), "--db", url, "migrate"], check=True, capture_output=True
        )
        commands = {
            "busctl --help": ["busctl", "--help"],
            "worker --help": ["worker", "--help"],
            "sweeper --help": ["sweeper", "--help"],
            "busctl --version": ["busctl", "--version"],
            "busctl enqueue (SQLite)": [
                "busctl",
                "--db",
                url,
                "enqueue",
                "--agent",
                "a",
                "--models",
                "sim/a",
                "hello",
            ],
            "busctl status (SQLite)": ["busctl", "--db", url, "status"],
        }
        rows: list[tuple[str, ...]] = []
        for label, argv in commands.items():
            times = []
            for _ in range(runs):
                started = time.perf_counter()
                subprocess.run([str(bin_dir / argv[0]), *argv[1:]], check=True, capture_output=True)
                times.append(time.perf_counter() - started)
            times.sort()
            median = times[len(times) // 2]
            rows.append((label, f"{median * 1000:,.0f} ms", f"{times[-1] * 1000:,.0f} ms"))
    return rows
