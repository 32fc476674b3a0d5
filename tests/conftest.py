"""The session's pytest hooks and fixtures; what the tests import is in support/."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from support import EXTRAS, REPO

# W&B never touches the network in tests; tests that check W&B opt into offline mode.
os.environ["WANDB_MODE"] = "disabled"
os.environ.setdefault("WANDB_SILENT", "true")
os.environ["PYTHONUNBUFFERED"] = "1"  # as cli_env: the session's rank server inherits it


def pytest_sessionstart(session):
    """CI installs every extra (.[all]) and runs the whole suite with nothing skipped: a missing
    extra there is an error, not a skip. Locally, `.[test]` runs the quick subset without them.
    A suite started in the background (`nohup ... &`) inherits SIGINT ignored, and so would every
    program it starts, whose Ctrl-C tests then find it never stops: SIGINT is given back."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("CI"):
        import importlib.util

        missing = [m for m in EXTRAS if importlib.util.find_spec(m.split(".")[0]) is None]
        if missing:
            raise pytest.UsageError(
                f"CI must install every extra (pip install -e '.[all]'); missing: {missing}"
            )


@pytest.fixture
def repo() -> Path:
    return REPO


_seen_temp_dirs: set[Path] = set()


@pytest.fixture(autouse=True)
def multi_process_runs_are_marked_slow(request, tmp_path_factory):
    """A test not marked slow that launched ranks here (the local launcher writes one log folder
    per rank under <run>/logs/), itself or through a fixture it set up, fails: `-m "not slow"`
    must stay the quick loop."""
    yield
    base = tmp_path_factory.getbasetemp()
    new = set(base.iterdir()) - _seen_temp_dirs  # tmp_path and module fixtures' folders of this test
    _seen_temp_dirs.update(new)
    if request.node.get_closest_marker("slow"):
        return
    for folder in new:
        ranks = {p.name for p in folder.glob("**/logs/*/attempt_*/*") if p.is_dir()}
        if len(ranks) > 1:
            pytest.fail(f"this test launched {len(ranks)} ranks: mark it @pytest.mark.slow")
