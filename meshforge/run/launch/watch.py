"""The terminal of a locally launched run: the launching process renders it from the run's
records (run.json, metrics.jsonl) while every rank writes its output to its own log file.

So there is one live progress display with an ETA, the banner and summary once, meshforge's own
warnings from the ranks as they come (each distinct one once, at the ranks' log level, progress
display or not), and under the summary every other distinct warning once (torch's, Python's); the
ranks' logs keep everything, under `<run>/logs/`.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from pathlib import Path

from meshforge.run.observe.console import Banner, RunConsole

# what a log line's own prefix adds (torch's "[rank3]:W1130 21:50:26.478000 14124 ", a path:line)
_PREFIX = re.compile(r"^(\[rank\d+\]:)?[WIEF]\d{4} [\d:.]+ \d+ ")
# a line meshforge's own logging wrote in a rank (core/logs.py's format)
_OWN = re.compile(r"^(?:\[rank\d+\]:)?WARNING meshforge: (.*)$")
log = logging.getLogger("meshforge.run")


class RunWatcher:
    """Follows `<run_dir>`'s records, and the logs of launch `launch_id` (torch's rendezvous run
    id: an earlier launch's logs in a resumed run's folder are not this one's), from a thread;
    leaving prints the summary."""

    def __init__(self, run_dir: Path, console: RunConsole, started: float, launch_id: str):
        self.run_dir, self.console, self.started = run_dir, console, started
        self._logs = f"logs/{launch_id}_*/**/stderr.log"  # DefaultLogsSpecs' folder per launch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._shown = False
        self._offsets: dict[Path, int] = {}  # how far each followed file (records, logs) was read
        self._said: set[str] = set()  # meshforge's warnings already shown

    def __enter__(self) -> RunWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()  # the last lines
        self._forward_own_warnings()  # a run that ended before its banner still says them
        info = self._info()
        if info is not None and "summary" in info:
            self.console.finish(
                info["run_name"],
                info["status"],
                info["summary"],
                self.run_dir,
                info["device"],
                info.get("loggers", {}),
            )
        self.print_warnings()

    def _info(self) -> dict | None:
        """This launch's run.json (not an earlier run's, which a resumed run replaces)."""
        try:
            info = json.loads((self.run_dir / "run.json").read_text())
        except (OSError, ValueError):
            return None
        return info if info.get("start_time", 0) >= self.started and "loggers" in info else None

    def _follow(self) -> None:
        while not self._stop.wait(0.5):
            self._poll()

    def _poll(self) -> None:
        if not self._shown:
            info = self._info()
            if info is None:
                return
            self.console.start(Banner(**info["banner"]), self.run_dir, info.get("wandb"))
            self._shown = True
        self._forward_own_warnings()  # under the banner
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return
        for line in self._new_lines(path):
            row = json.loads(line)
            self.console.update(row["step"], row)

    def _new_lines(self, path: Path) -> list[str]:
        """The complete lines `path` has gained since the last call (one still being written waits
        for the next); offsets in bytes, so any text reads back where it stopped."""
        with open(path, "rb") as f:
            f.seek(self._offsets.get(path, 0))
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._offsets[path] = self._offsets.get(path, 0) + len(complete)
        return complete.decode(errors="replace").splitlines()

    def _forward_own_warnings(self) -> None:
        """meshforge's warnings the ranks logged since the last poll, each distinct one once,
        through this process's logging: they say something changed the run (a setting taken from
        the recipe on resume, a skipped step), so they show when they happen, progress display or
        not. (A rank's error ends the launch, which names it.)"""
        for path in sorted(self.run_dir.glob(self._logs)):
            for line in self._new_lines(path):
                if (own := _OWN.match(line.strip())) and own.group(1) not in self._said:
                    self._said.add(own.group(1))
                    log.warning(own.group(1))

    def print_warnings(self) -> None:
        """Each distinct warning the ranks logged that is not meshforge's own (shown as it came),
        once, with where the full logs are."""
        seen: dict[str, None] = {}
        for path in sorted(self.run_dir.glob(self._logs)):
            for line in path.read_text(errors="replace").splitlines():
                if "warn" in line.lower() and not _OWN.match(line.strip()):
                    seen.setdefault(_PREFIX.sub("", line).strip(), None)
        if seen and self.console.enabled:
            self.console.console.print(
                f"warnings from the ranks (each once; full logs in {self.run_dir / 'logs'}):", highlight=False
            )
            for w in seen:
                self.console.console.print(f"  {w}", highlight=False, markup=False)
