"""A link's latency and bandwidth fitted to collective timings (`meshforge tune --calibrate`):
least squares on the relative error, leaving out the timings noise moved."""

from __future__ import annotations

import contextlib

import numpy as np

from meshforge.core.errors import RunError
from meshforge.simulate.hardware import Link, algorithm_factor


def fit_link(group_size: int, timings: list[tuple[str, int, float]]) -> tuple[Link, float]:
    """latency + bytes x factor / bandwidth fitted to (kind, full-buffer bytes, seconds) timings by
    least squares on the *relative* error, so the small sizes fix the latency and the large ones
    the bandwidth (absolute residuals would let the 4 MiB timings drown the latency). A timing
    behind compute is a difference of two loops, which noise can halve: while the fit misses a
    timing by over 50% (or finds no bandwidth), the one timing whose absence fits the rest best is
    left out, up to a quarter of them. Returns the link and the RMS relative error over all."""
    timings = [timing for timing in timings if timing[2] > 0]  # 0: noise drowned it (cost_under_load)
    if len(timings) < 2:
        raise RunError(
            f"calibration: too few collectives on groups of {group_size} took measurably longer than the "
            "compute around them; the machine was too busy to measure: calibrate again when it is quieter"
        )
    x = np.array([n * algorithm_factor(kind, group_size) for kind, n, _ in timings])
    t = np.array([seconds for _, _, seconds in timings])
    kept = np.arange(len(t))
    latency, per_byte = _relative_fit(x, t)
    for _ in range(len(t) // 4):
        if per_byte > 0 and np.abs((latency + per_byte * x[kept]) / t[kept] - 1).max() <= 0.5:
            break
        kept = min(
            (np.delete(kept, i) for i in range(len(kept))),
            key=lambda rest: _rms_miss(x[rest], t[rest], *_relative_fit(x[rest], t[rest])),
        )
        latency, per_byte = _relative_fit(x[kept], t[kept])
    if per_byte <= 0:
        raise RunError(
            f"calibration: collectives on groups of {group_size} took no longer for large buffers than "
            "for small ones; the machine was too busy to measure: calibrate again when it is quieter"
        )
    return Link(latency, 1 / per_byte), _rms_miss(x, t, latency, per_byte)


def _rms_miss(x: np.ndarray, t: np.ndarray, latency: float, per_byte: float) -> float:
    """The RMS relative error of a link on timings; infinite for one without a bandwidth."""
    return float(np.sqrt(np.mean(((latency + per_byte * x) / t - 1) ** 2))) if per_byte > 0 else np.inf


def _relative_fit(x: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    """(latency, seconds per byte) minimising the relative error; the bandwidth alone when noise
    puts the latency below zero."""
    (latency, per_byte), *_ = np.linalg.lstsq(np.stack([1 / t, x / t], axis=1), np.ones_like(t), rcond=None)
    if latency < 0:
        return 0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))
    return float(latency), float(per_byte)


def fit_kind_links(timings: list, groups: list[int], kinds: tuple[str, ...]) -> dict[str, dict[int, Link]]:
    """gloo's kinds differ beyond their algorithm factors (its reduce_scatter is slower): each its
    own fit per group size, from 4 timings; where noise leaves those no bandwidth, the kind keeps
    the size's pooled link (absent here, Profile.collective_time falls back to it)."""
    links: dict[str, dict[int, Link]] = {}
    for kind in kinds:
        for g in groups:
            with contextlib.suppress(RunError):
                own = [(k, n, t) for size, k, n, t in timings if size == g and k == kind]
                links.setdefault(kind, {})[g] = fit_link(g, own)[0]
    return links
