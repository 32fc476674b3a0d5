"""What a program run by conftest.run_cli does in its process, forked from the test session's rank
server: the installed console script's function (its entry point, as the script calls it), with
the test's arguments, environment, working folder and output files. A module of its own so the
server can import it without pytest."""

from __future__ import annotations

import os
import sys
from importlib.metadata import entry_points


def run_program(program: str, args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """`program ARGS` as its installed script runs it; the entry point ends this process."""
    (script,) = entry_points(group="console_scripts", name=os.path.basename(program))
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [program, *args]
    script.load()()  # exits with the program's code (cli.exit_now)
