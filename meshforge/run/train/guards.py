"""What stops a run early: a signal (stop cleanly at the end of the step) and the budget of
non-finite steps it may skip."""

from __future__ import annotations

import signal
from pathlib import Path

from meshforge.core.errors import Interrupted, NonFiniteLoss

_asked: str | None = None  # a stop asked by a thread of this rank (request_stop)


def request_stop(reason: str) -> None:
    """Stop this rank's run at the end of a step as a signal would, naming `reason`: for a thread
    of the rank (Python runs signal handlers on the main thread only, and StopSignals' only while
    the steps run; a stop asked before them stops the run after its first step)."""
    global _asked
    _asked = reason


class StopSignals:
    """SIGTERM/SIGINT (or `request_stop`) set a flag instead of killing the step; the loop stops
    all ranks together at the end of the step (the flag rides in the loss all-reduce)."""

    def __init__(self):
        self._signal: str | None = None

    @property
    def requested(self) -> bool:
        return self._signal is not None or _asked is not None

    @property
    def name(self) -> str:
        # read once the run has saved: the flag may have reached this rank through the reduce
        # before its own stop was asked, never after
        return self._signal or _asked or "a signal to another rank"

    def __enter__(self) -> StopSignals:
        self._previous = {sig: signal.signal(sig, self._request) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def _request(self, signum, frame) -> None:
        self._signal = signal.Signals(signum).name

    def interrupted(self, step: int, checkpoint: Path | None) -> Interrupted:
        """The one line a stopped run ends with: what stopped it, where, and how to resume."""
        if checkpoint is None:
            return Interrupted(
                f"stopped by {self.name} after step {step}; checkpoint.enabled is false: nothing saved"
            )
        return Interrupted(
            f"stopped by {self.name} after step {step}; checkpoint saved in {checkpoint}; resume: the same "
            "command with checkpoint.load=auto"
        )

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class BadStepBudget:
    """train.max_bad_steps: how many non-finite steps may be skipped before the run stops."""

    def __init__(self, allowed: int):
        self.allowed, self.seen = allowed, 0

    def spend(self, step: int, loss: float, grad_norm: float) -> str:
        """Count a non-finite step; raise once over budget, else the note to show."""
        self.seen += 1
        if self.seen > self.allowed:
            raise NonFiniteLoss(
                f"non-finite loss ({loss}) or grad norm ({grad_norm}) at step {step}; the "
                "update was not applied. Lower optimizer.lr, check the data, or allow skipping with "
                f"train.max_bad_steps (now {self.allowed})"
            )
        return (
            f"step {step}: non-finite loss or grad norm, update skipped ({self.seen}/{self.allowed} allowed)"
        )
