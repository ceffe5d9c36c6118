"""Benchmark processes started together: spawned, warmed up, then released at once."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def together(
    processes: int, work: Callable[..., T], args: Callable[[int], tuple[object, ...]]
) -> tuple[list[T], float]:
    """Start ``processes`` spawned processes running ``work(*args(n), ready, go)``; once
    every one is ready (connected, warmed up) start the clock and let them go. Returns
    their results and the seconds until the last one finished."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(processes, mp_context=ctx) as pool:
        readies = [manager.Event() for _ in range(processes)]
        go = manager.Event()
        futures = [pool.submit(work, *args(n), readies[n], go) for n in range(processes)]
        for ready in readies:
            ready.wait()
        began = time.perf_counter()
        go.set()
        results = [f.result() for f in futures]
        return results, time.perf_counter() - began
