"""meshforge's own messages go through Python logging, under the "meshforge" logger."""

from __future__ import annotations

import logging
import os

LOG_LEVEL_ENV = "MESHFORGE_LOG_LEVEL"  # also how a launcher hands its level to the ranks


def setup_logging(level: str | None = None) -> None:
    """meshforge's messages on stderr at `level` (default: MESHFORGE_LOG_LEVEL, else info)."""
    level = (level or os.environ.get(LOG_LEVEL_ENV) or "info").lower()
    os.environ[LOG_LEVEL_ENV] = level
    logger = logging.getLogger("meshforge")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s meshforge: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
