"""What every benchmark records beside its numbers, and how it writes them (JSON + markdown)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch


def provenance(**machine_extra) -> dict:
    """Machine, versions and date, so a recorded number says where it came from."""
    return {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), **machine_extra},
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d"),
        "commit": git_head(),
    }


def git_head() -> str:
    """The commit the working tree is at ('+' when it has changes; '' outside a git checkout)."""
    repo = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=repo).stdout.strip()
        except OSError:  # no git on this machine
            return ""

    head = git("rev-parse", "--short", "HEAD")
    return head + ("+" if head and git("status", "--porcelain", "--untracked-files=no") else "")


def save(out: Path, name: str, result: dict, markdown: list[str]) -> None:
    """`<out>/<name>.json` (the result) and `<out>/<name>.md` (the table a person reads), whose
    title is followed by the date, machine and commit unless its own header names the commit."""
    out.mkdir(parents=True, exist_ok=True)
    if result.get("commit") and result["commit"] not in "\n".join(markdown[:8]):
        markdown = [*markdown[:1], "", stamp(result), *markdown[1:]]
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text("\n".join(markdown) + "\n")


def at_least_one(text: str) -> int:
    """An argparse type for a count of passes or repeats: a whole number, 1 or more."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: at least 1")
    return n


def stamp(result: dict) -> str:
    """Where a record's numbers came from, in one line: date, machine, commit."""
    machine = result.get("machine", {})
    where = machine.get("gpu") or f"{machine.get('platform', '?')}, {machine.get('cpus', '?')} CPUs"
    return f"{result.get('date', '?')}, {where}; measured at commit {result['commit']}."
