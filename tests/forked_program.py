"""What a program run by conftest.run_cli does in its process, forked from the test session's rank
server: the installed entry point's work (meshforge.cli), with the test's arguments, environment,
working folder and output files. A module of its own so the server can import it without pytest."""

from __future__ import annotations

import os
import sys


def run_program(program: str, args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """`program ARGS` as the installed script runs it; ends this process with its exit code."""
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [program, *args]  # argparse names the program from it
    from meshforge.cli import exit_now, meshforge_main, run_recipe_main

    main = run_recipe_main if os.path.basename(program) == "run_recipe" else meshforge_main
    exit_now(main(args))
