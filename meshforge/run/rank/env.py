"""What the process's environment says, without importing torch (the CLI asks before it does):
whether torchrun started it, whether a launcher owns the terminal, the machine's memory."""

from __future__ import annotations

import os

LAUNCHED_ENV = "MESHFORGE_CONSOLE"  # set to "launcher" for the ranks: the launcher owns the terminal


def under_torchrun() -> bool:
    """True when torchrun (or our local launcher, which is torchrun's API) started us."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def host_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
