"""meshforge's own messages go through Python logging, under the "meshforge" logger."""

from __future__ import annotations

import logging
import os
import sys

LOG_LEVEL_ENV = "MESHFORGE_LOG_LEVEL"  # also how a launcher hands its level to the ranks


class _CurrentStderr(logging.StreamHandler):
    """Writes to `sys.stderr` as it is when a message is logged, not when logging was set up: a
    caller that redirects stderr around an in-process run (a notebook, a test) gets the messages."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):  # StreamHandler.__init__ assigns one; the property is the stream
        pass


def setup_logging(level: str | None = None) -> None:
    """meshforge's messages on stderr at `level` (default: MESHFORGE_LOG_LEVEL, else info)."""
    level = (level or os.environ.get(LOG_LEVEL_ENV) or "info").lower()
    logger = logging.getLogger("meshforge")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("%(levelname)s meshforge: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def log_level_name() -> str:
    """meshforge's level as `setup_logging` takes it (what a launcher hands its ranks and points)."""
    level = logging.getLogger("meshforge").level
    return logging.getLevelName(level).lower() if level else (os.environ.get(LOG_LEVEL_ENV) or "info").lower()
