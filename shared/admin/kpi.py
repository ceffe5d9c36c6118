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


#: number -> (name, meaning, target): the columns of the ``kpi_summary`` view besides its
#: counts (a test holds them equal), so that no reader runs the view for its names.
META = {
    1: ("preservation", "paused / tasks whose every model was cooling", "100 %"),
    2: ("resume success", "done next / settled sweeper resumes", ">= 80 %"),
    3: ("cooldown consistency", "skips that matched model_cooldown at that moment", "100 %"),
    4: ("backoff inversion", "failure counts caused by cooldowns / all counted failures", "0"),
}

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

#: KPI 1 over a window: ``kpi_cooldown_hits`` groups every routing row by claim before
#: its time (the claim's last row) can be compared, so a window on the view reads all
#: of ``route_log``. This reads the claims with a row in the window (its time index),
#: then all of their rows (its task index): the same claims and outcomes as the view.
_COOLDOWN_HITS_SINCE = """
SELECT COUNT(CASE WHEN outcome = 'paused' THEN 1 END), COUNT(outcome) FROM (
  SELECT MAX(r.at) AS at,
         (SELECT e.to_status FROM task_events e
           WHERE e.task_id = r.task_id AND e.claim_token = r.claim_token
             AND e.from_status = 'claimed'
           ORDER BY e.id LIMIT 1) AS outcome
    FROM route_log r
   WHERE EXISTS (SELECT 1 FROM route_log w
                  WHERE w.at >= :since AND w.task_id = r.task_id
                    AND w.claim_token = r.claim_token)
   GROUP BY r.task_id, r.claim_token
  HAVING SUM(CASE WHEN r.decision IN ('skip', 'refuse')
                       OR r.outcome IN ('rate_limited', 'overloaded', 'timeout')
                  THEN 0 ELSE 1 END) = 0
     AND MAX(r.at) >= :since
) hits
"""


def compute(db: Database, since: float | None = None) -> list[Kpi]:
    """The KPIs over all facts at or after ``since`` (all time when None). With a window
    every KPI reads the rows of that window through an index; over all time the views
    read their whole tables (``busctl kpi`` says so; nothing polls it)."""
    queries = dict(_QUERIES)
    if since is not None:
        queries[1] = _COOLDOWN_HITS_SINCE

    def work(conn: sa.Connection) -> list[Kpi]:
        out = []
        for number, (name, meaning, target) in META.items():
            num, den = conn.execute(sa.text(queries[number]), {"since": since or 0.0}).one()
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
