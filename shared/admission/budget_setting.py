"""The workspace's client budget setting: its mode and size, as ``busctl budget set``
writes them and every process reads them (workspace settings ``budget_mode`` and
``client_budget``), and the line a process says when its own flags disagree."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.engine import Connection

from agentbus import workspace
from agentbus.admission import workspace_events
from agentbus.config import Settings, check_budget_mode
from agentbus.db import Database
from agentbus.errors import ConfigError

MODE, SIZE = "budget_mode", "client_budget"  # the names of the workspace settings


@dataclass(frozen=True)
class BudgetSetting:
    """The workspace's client budget as ``busctl budget set`` left it."""

    mode: str = "off"
    size: int = 0
    updated_at: float | None = None
    updated_by: str | None = None

    @classmethod
    def of(cls, found: dict[str, workspace.Setting]) -> BudgetSetting:
        mode, size = found.get(MODE), found.get(SIZE)
        stamps = [s for s in (mode, size) if s is not None]
        last = max(stamps, key=lambda s: s.updated_at) if stamps else None
        return cls(
            str(mode.value) if mode else "off",
            int(size.value) if size else 0,
            last.updated_at if last else None,
            last.updated_by if last else None,
        )

    def describe(self) -> str:
        return f"{self.mode}, size {self.size}" if self.size else self.mode


def read_setting(db: Database) -> BudgetSetting:
    """The workspace's client budget (off until set)."""
    return db.read(lambda conn: BudgetSetting.of(workspace.read(conn, (MODE, SIZE))))


def write_setting(
    db: Database,
    *,
    mode: str | None,
    size: int | None,
    by: str,
    clock: Callable[[], float] | None = None,
) -> tuple[BudgetSetting, BudgetSetting]:
    """Change the workspace's mode and/or size; returns (before, after). Raises
    ConfigError (and changes nothing) when the result would be invalid."""

    def work(conn: Connection) -> tuple[BudgetSetting, BudgetSetting]:
        now = (clock or db.clock)()
        before = BudgetSetting.of(workspace.read(conn, (MODE, SIZE)))
        after = BudgetSetting(
            before.mode if mode is None else mode, before.size if size is None else size, now, by
        )
        if size is not None and size < 0:
            raise ConfigError(f"the client budget size must not be negative, got {size}")
        if after.mode == "enforce" and after.size <= 0:
            raise ConfigError(
                "budget mode enforce needs a positive size: busctl budget set --mode enforce "
                "--size N"
            )
        check_budget_mode(after.mode, after.size)
        workspace.write(conn, {MODE: after.mode, SIZE: after.size}, now, by)
        detail = {"mode": after.mode, "size": after.size, "was": [before.mode, before.size]}
        workspace_events.emit(
            conn, "budget_set", now, scope=workspace_events.WORKSPACE, source=by, detail=detail
        )
        return before, after

    return db.write(work)


def disagreement(settings: Settings, setting: BudgetSetting) -> str | None:
    """One line when this process was given a mode or size (flag, environment or
    config file) other than the workspace's, which applies; None when they agree."""
    if settings.no_workspace_budget:
        return None
    given = []
    if settings.budget_mode != "off" and settings.budget_mode != setting.mode:
        given.append(f"--budget-mode {settings.budget_mode}")
    if settings.client_budget and settings.client_budget != setting.size:
        given.append(f"--client-budget {settings.client_budget}")
    if not given:
        return None
    return (
        f"{' '.join(given)} ignored: the client budget is the workspace's ({setting.describe()}); "
        "change it with busctl budget set, or set AGENTBUS_NO_WORKSPACE_BUDGET=1 for a "
        "per-process budget"
    )
