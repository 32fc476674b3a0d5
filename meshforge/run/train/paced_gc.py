"""Python's cyclic garbage collector paced by the steps (`train.gc_every`), as TorchTitan's
`GarbageCollection` does. Left automatic, each rank collects when its own allocations say so, and
every peer waits for that rank at the next collective: on the debug model's 2-rank replicated
layout with full activation checkpointing, a rank's full collections took 0.18-0.20 s (the step
that held one, 0.26 s against 0.07-0.10) and the mean step read 0.107 s; paced, 0.077 s
Off while the steps run, every rank collects its young generations at the same
step's end instead; the old generation is then not collected until the steps end (its cycles are
rare and long-lived), when the collector is restored."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """Python's collector off, after one full collection of what came before (untimed setup's
    leftovers); restored on the way out, however that is. Calibrate's probe ranks run in it too, so
    they measure what a run's steps see."""
    was_enabled = gc.isenabled()
    try:
        gc.disable()
        gc.collect()
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def paced_gc(every: int) -> Iterator[Callable[[int], None]]:
    """Yields `collect(step)`, to call at each step's end; `every` = 0 leaves the collector as it is."""
    if every == 0:
        yield lambda step: None
        return

    def collect(step: int) -> None:
        if step % every == 0:
            gc.collect(1)

    with collector_off():
        yield collect
