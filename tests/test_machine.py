"""scripts/machine.py: its commits append the pages they say, and its round trips leave
the process on the cores it had."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import script


def test_each_commit_appends_as_many_pages_as_tables_it_changes(tmp_path: Path) -> None:
    machine = script("machine")
    costs = machine.commit_cost(tmp_path, "FULL", (1, 3, 12), 6)
    assert {k: pages for k, (_, pages) in costs.items()} == {1: 1.0, 3: 3.0, 12: 12.0}
    assert all(us > 0 for us, _ in costs.values())
    assert list(tmp_path.iterdir()) == []  # each database file goes with its directory


@pytest.mark.parametrize("same_core", [False, True])
def test_round_trips_give_the_process_its_cores_back(same_core: bool) -> None:
    machine = script("machine")
    before = os.sched_getaffinity(0)
    if not same_core and len(before) < 2:
        with pytest.raises(ValueError, match="two cores"):
            machine.wake_up(10, same_core=False)
        return
    round_trip, cpu = machine.wake_up(50, same_core=same_core)
    assert os.sched_getaffinity(0) == before
    assert round_trip > 0 and cpu >= 0
