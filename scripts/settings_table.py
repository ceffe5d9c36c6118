#!/usr/bin/env python3
"""Print the README's settings table from ``shared.config.Settings`` (paste it in)."""

from __future__ import annotations

import dataclasses

from agentbus.config import Settings


def main() -> None:
    print("| setting | env | default | meaning |")
    print("|---|---|---|---|")
    for field in dataclasses.fields(Settings):
        default = field.default
        if isinstance(default, float) and default.is_integer():
            default = int(default)
        shown = f"`{default}`" if isinstance(default, str) else default
        env = f"AGENTBUS_{field.name.upper()}"
        print(f"| `{field.name}` | `{env}` | {shown} | {field.metadata['doc']} |")


if __name__ == "__main__":
    main()
