"""The terminal of a locally launched run: the launching process renders it from the run's
records (run.json, metrics.jsonl) while every rank writes its output to its own log file.

So there is one live progress display with an ETA, the banner and summary once, and each
distinct warning once (the ranks' logs keep everything, under `<run>/logs/`).
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

from meshforge.run.observe.console import Banner, RunConsole

LAUNCHED_ENV = "MESHFORGE_CONSOLE"  # set to "launcher" for the ranks: the launcher owns the terminal
# what a log line's own prefix adds (torch's "[rank3]:W1130 21:50:26.478000 14124 ", a path:line)
_PREFIX = re.compile(r"^(\[rank\d+\]:)?[WIEF]\d{4} [\d:.]+ \d+ ")


class RunWatcher:
    """Follows `<run_dir>`'s records from a thread; `close()` prints the summary."""

    def __init__(self, run_dir: Path, console: RunConsole, started: float):
        self.run_dir, self.console, self.started = run_dir, console, started
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._offset = 0
        self._shown = False

    def __enter__(self) -> RunWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()  # the last lines
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
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return
        with open(path) as f:
            f.seek(self._offset)
            text = f.read()
        complete = text[: text.rfind("\n") + 1]  # a line still being written waits for the next poll
        self._offset += len(complete)
        for line in complete.splitlines():
            row = json.loads(line)
            self.console.update(row["step"], row)

    def print_warnings(self) -> None:
        """Each distinct warning the ranks logged, once, with where the full logs are."""
        seen: dict[str, None] = {}
        for log in sorted(self.run_dir.glob("logs/**/stderr.log")):
            for line in log.read_text(errors="replace").splitlines():
                if "warn" in line.lower():
                    seen.setdefault(_PREFIX.sub("", line).strip(), None)
        if seen and self.console.enabled:
            self.console.console.print(
                f"warnings from the ranks (each once; full logs in {self.run_dir / 'logs'}):", highlight=False
            )
            for w in seen:
                self.console.console.print(f"  {w}", highlight=False, markup=False)
