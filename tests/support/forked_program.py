"""What a program run by support.run_cli does in its process, forked from the test session's rank
server: the installed console script's function (its entry point, as the script calls it), or a
Python script run as `python SCRIPT` runs it, with the test's arguments, environment, working
folder and output files. A module of its own so the server can import it without pytest."""

from __future__ import annotations

import os
import runpy
import sys
from importlib.metadata import entry_points


def run_program(program: str, args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """`program ARGS` as its installed script runs it, or `python program ARGS` for a `.py` file
    (its folder first on sys.path, run as __main__); the program's exit ends this process."""
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [program, *args]
    if program.endswith(".py"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(program)))
        runpy.run_path(program, run_name="__main__")  # returns (exit 0) or raises SystemExit
        return
    (script,) = entry_points(group="console_scripts", name=os.path.basename(program))
    script.load()()  # exits with the program's code (cli.exit_now)
