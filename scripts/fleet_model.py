"""The model of scripts/fleet.py: a Python function a worker calls in-process, under the
fleet's admission, that waits the task's ``sleep`` seconds and writes one line per call
to ``$FLEET_JOURNAL``: the witness of what the models really saw, outside agentbus.

A line: ``task_id provider account started ended pid``, times from ``time.time()``
(one host, one clock). ``started`` is taken after admission let the call through and
``ended`` before the worker gives its slot back, so the lines' overlaps are at most the
slots admission held.
"""

from __future__ import annotations

import os
import time
from typing import Any

JOURNAL = "FLEET_JOURNAL"


def answer(request: Any) -> str:
    started = time.time()
    time.sleep(float(request.payload.get("sleep", 0.1)))
    ended = time.time()
    provider = request.model.split("/", 1)[0]
    line = (
        f"{request.task_id} {provider} {request.account} {started:.6f} {ended:.6f} {os.getpid()}\n"
    )
    fd = os.open(os.environ[JOURNAL], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one write of a short line: whole, never interleaved
    finally:
        os.close(fd)
    return "ok"
