#!/usr/bin/env python3
"""Write docs/settings.md from the settings' own docs (``agentbus.settings.Settings``);
``--check`` says whether the page is current (a test runs it)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from agentbus.settings import Settings

PAGE = Path(__file__).resolve().parents[1] / "docs" / "settings.md"
INTRO = """# Settings

Every setting comes from, in rising precedence: its default, the TOML file
(`--config FILE`, `$AGENTBUS_CONFIG`, or `./agentbus.toml` if present; keys at
the top level), the environment (`AGENTBUS_` + the name in capitals), and
command-line flags. The tables of the file (`[providers]`, `[models]`,
`[roles]`, `[agents]`, `[bulkheads]`, `[routing]`, `[mcp]`, `[schedules]`) are the catalog:
`busctl init` writes an example that shows every key.

`AGENTBUS_CONFIG` names the config file; `AGENTBUS_SIM_JOURNAL` makes the
simulated provider append one JSON line per call to that file.

This page is written by `python scripts/settings_table.py` from the code.

| setting | env | default | meaning |
|---|---|---|---|
"""


def shown(default: object) -> str:
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, float) and default.is_integer():
        default = int(default)
    if default == "":
        return "(none)"
    return f"`{default}`" if isinstance(default, str) else str(default)


def page() -> str:
    rows = [
        f"| `{f.name}` | `AGENTBUS_{f.name.upper()}` | {shown(f.default)} | {f.metadata['doc']} |"
        for f in dataclasses.fields(Settings)
    ]
    return INTRO + "\n".join(rows) + "\n"


def main() -> int:
    if sys.argv[1:] == ["--check"]:
        current = PAGE.exists() and PAGE.read_text() == page()
        print("docs/settings.md is current" if current else "docs/settings.md is stale")
        return 0 if current else 1
    PAGE.write_text(page())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
