"""How hard the fuzz tests try: ``AGENTBUS_FUZZ=ci`` (the default) runs a bounded
number of examples from a fixed seed, so a run is quick and says the same every time;
``AGENTBUS_FUZZ=long`` (``make fuzz``) runs many more, from fresh seeds."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILES = {"ci": 60, "long": 2000}
PROFILE = os.environ.get("AGENTBUS_FUZZ", "ci")
if PROFILE not in PROFILES:
    raise SystemExit(f"AGENTBUS_FUZZ must be one of {', '.join(PROFILES)}, not {PROFILE!r}")

FUZZ = settings(
    max_examples=PROFILES[PROFILE],
    deadline=None,
    derandomize=PROFILE == "ci",
    database=None if PROFILE == "ci" else settings.default.database,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
