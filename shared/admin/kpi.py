"""The four KPIs of the cooldown design, read from the KPI views.

Each KPI is a ratio (or, for KPI 4, a count) with the counts behind it; a
zero denominator gives "n/a", never a division error. ``since`` limits every
KPI to facts at or after that epoch time.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

import sqlalchemy as sa

from agentbus.cli import table
from agentbus.db import Database
from agentbus.errors import BusError


@dataclass(frozen=True)
class Kpi:
    number: int
    name: str
    numerator: int
    denominator: int
    meaning: str
    target: str

    @property
    def value(self) -> float | None:
        """Percent for ratios, the count for KPI 4; None when there is nothing to measure."""
        if self.number == 4:
            return float(self.numerator)
        return None if self.denominator == 0 else 100.0 * self.numerator / self.denominator

    @property
    def passed(self) -> bool | None:
        value = self.value
        if value is None:
            return None
        if self.number == 4:
            return value == 0
        return value >= (80.0 if self.number == 2 else 100.0)

    def shown(self) -> str:
        value = self.value
        if value is None:
            return "n/a"
        return f"{value:.0f}" if self.number == 4 else f"{value:.1f} %"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "value": self.value, "passed": self.passed}


_QUERIES = {
    1: (
        "SELECT COUNT(CASE WHEN outcome = 'paused' THEN 1 END), COUNT(outcome) "
        "FROM kpi_cooldown_hits WHERE at >= :since"
    ),
    2: (
        "SELECT COUNT(CASE WHEN outcome = 'done' THEN 1 END), COUNT(outcome) "
        "FROM kpi_resumes WHERE at >= :since"
    ),
    3: "SELECT COUNT(CASE WHEN consistent = 1 THEN 1 END), COUNT(*) FROM kpi_decisions "
    "WHERE at >= :since",
    4: "SELECT COUNT(CASE WHEN cooldown_caused = 1 THEN 1 END), COUNT(*) FROM kpi_failures "
    "WHERE at >= :since",
}


def compute(db: Database, since: float | None = None) -> list[Kpi]:
    """The KPIs over all facts at or after ``since`` (all time when None)."""

    def work(conn: sa.Connection) -> list[Kpi]:
        meta = conn.execute(
            sa.text("SELECT kpi, name, meaning, target FROM kpi_summary ORDER BY kpi")
        ).all()
        out = []
        for number, name, meaning, target in meta:
            num, den = conn.execute(sa.text(_QUERIES[number]), {"since": since or 0.0}).one()
            out.append(Kpi(number, name, int(num), int(den), meaning, target))
        return out

    return db.read(work)


def render(kpis: list[Kpi]) -> str:
    """The KPI table for people: value, target, pass/fail and the counts behind it."""
    marks = {True: "PASS", False: "FAIL", None: "-"}
    rows = [
        [
            k.number,
            k.name,
            k.shown(),
            k.target,
            marks[k.passed],
            f"{k.numerator}/{k.denominator}",
            k.meaning,
        ]
        for k in kpis
    ]
    return table(["#", "kpi", "value", "target", "", "counts", "what is counted"], rows)


def parse_duration(text: str) -> float:
    """'90s', '15m', '2h', '7d' (or plain seconds) -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not match:
        raise BusError(f"invalid duration {text!r}: use e.g. 90s, 15m, 2h or 7d")
    unit = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
    return float(match.group(1)) * unit
