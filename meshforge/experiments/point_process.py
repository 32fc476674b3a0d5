"""One sweep or tune point run here as its own process: in a session of its own (a timeout kills
everything it started), and stopped with the sweep when the sweep is."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from meshforge.core.errors import Interrupted
from meshforge.experiments.sweep_record import log_verdict


def run_point(
    cmd: list[str],
    timeout: int,
    log: Path,
    watch: Callable[[], str | None] | None = None,
    started: Callable[[int], None] | None = None,
) -> tuple[str, str]:
    """Run one point in its own process group (a timeout kills everything it started); (status,
    error tail). A Ctrl-C or SIGTERM that stops the sweep stops the point too (`PassStop`), and the
    sweep then stops, raising Interrupted. `watch`, asked 4 times a second while the point runs,
    returns why to stop it (a search's pruner) or None: the point is then stopped as a SIGTERM
    stops a run (at the end of a step, its records closed) and its status is `stopped`. `started`
    is told the point's pid (its launcher's) once it runs."""
    with open(log, "w") as f, PassStop() as stop:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        stop.started(proc)
        if started is not None:
            started(proc.pid)
        try:
            reason = _wait(proc, timeout, watch)
            if reason is not None:
                os.kill(proc.pid, signal.SIGTERM)  # its launcher, which stops its ranks at a step
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            if stop.name is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the point and every rank it started
                proc.wait()
                return "hung", f"no result after {timeout}s; stopped"
            rc = proc.wait()  # stopping as asked, for as long as its save takes (a second signal kills it)
    if stop.name is not None:
        raise Interrupted(
            f"stopped by {stop.name}: its running point stopped too (exit code {rc}; its log: {log})"
        )
    if reason is not None and rc != 0:  # (0: it ended on its own meanwhile)
        return "stopped", reason
    if rc == 0:
        return "finished", ""
    message = log_verdict(log)
    oom = "out of memory" in message.lower() or "SIGKILL" in message
    return ("oom" if oom else "failed"), message


def _wait(proc: subprocess.Popen, timeout: int, watch: Callable[[], str | None] | None) -> str | None:
    """Wait for the point to end (TimeoutExpired after `timeout` s), or until `watch` gives a reason
    to stop it (returned)."""
    if watch is None:
        proc.wait(timeout=timeout)
        return None
    deadline = time.monotonic() + timeout
    while True:
        try:
            proc.wait(timeout=max(0.0, min(0.25, deadline - time.monotonic())))
            return None
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                raise
        if (reason := watch()) is not None:
            return reason


class PassStop:
    """A point runs in a session of its own, out of a terminal's Ctrl-C, so a SIGINT or SIGTERM to
    the sweep is passed on: the first to the point's launcher, which stops its ranks at a step as it
    stops a run (saving when checkpointing is on); a second kills the point's whole group. Handlers
    run on the main thread only: elsewhere the defaults stay. Unpassed, the sweep would exit and
    its point train on alone."""

    def __init__(self):
        self.asked: signal.Signals | None = None  # the first signal, passed on
        self._point: subprocess.Popen | None = None

    @property
    def name(self) -> str | None:
        return self.asked.name if self.asked is not None else None

    def __enter__(self) -> PassStop:
        on_main = threading.current_thread() is threading.main_thread()
        self._previous = {s: signal.signal(s, self._pass) for s in (signal.SIGINT, signal.SIGTERM) if on_main}
        return self

    def started(self, point: subprocess.Popen) -> None:
        self._point = point
        if self.asked is not None:  # asked while it started
            self._send(self.asked)

    def _pass(self, signum: int, frame) -> None:
        again = self.asked is not None
        self.asked = self.asked or signal.Signals(signum)
        if self._point is not None:
            self._send(signal.SIGKILL if again else signum)

    def _send(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # it has exited already
            if signum == signal.SIGKILL:
                os.killpg(self._point.pid, signum)
            else:  # its launcher only: a SIGTERM to the group would kill the ranks' fork server
                os.kill(self._point.pid, signum)

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
