"""Records are never lost, only set aside to `<run>.<timestamp>` beside the run's folder: a rerun
of a run name moves the earlier run's folder there whole; a resume that starts from a checkpoint
before the last logged step copies the records there first, then cuts them back to the checkpoint
(those steps are trained again), and says which steps went where."""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from meshforge.core.files import write_atomic
from meshforge.run.observe.wandb_files import history

log = logging.getLogger("meshforge.run")

# what a resume copies aside whole (the checkpoints stay: the run goes on from one of them)
RECORDS = ("metrics.jsonl", "run.json", "recipe.toml", "tensorboard")


def aside_folder(run_dir: Path, when: float) -> Path:
    """`<run>.<YYYYmmdd-HHMMSS>` of `when` (local time), `-2`, `-3`, ... when taken."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
    target, n = run_dir.with_name(f"{run_dir.name}.{stamp}"), 1
    while target.exists():
        n += 1
        target = run_dir.with_name(f"{run_dir.name}.{stamp}-{n}")
    return target


def set_aside_earlier_run(run_dir: Path) -> Path | None:
    """A new run never appends to, or overwrites, the records of an earlier run of the same name:
    the earlier run's folder is renamed `<run>.<timestamp of its last change>`."""
    if not (run_dir.exists() and any(run_dir.iterdir())):
        return None
    target = aside_folder(run_dir, run_dir.stat().st_mtime)
    run_dir.rename(target)
    log.info(f"an earlier run's records were moved to {target}")
    return target


@dataclass(frozen=True)
class SetAside:
    """Logged steps past the checkpoint a resume starts from, and where their records went."""

    step: int  # the checkpoint's step
    steps: list[int]  # the steps set aside, in order
    to: Path

    def line(self) -> str:
        first, last = self.steps[0], self.steps[-1]
        span = f"step {first}" if first == last else f"steps {first}-{last}"
        why = (
            f"came after checkpoint step {self.step}, which this run resumes from and trains again"
            if self.step
            else "were logged by an earlier run that saved no checkpoint: this run starts from step 0 again"
        )
        return f"{span} ({len(self.steps)} logged) {why}: their records were set aside to {self.to}"


def _rows(path: Path) -> list[tuple[int, str]]:
    """(step, line) of metrics.jsonl's whole lines (one a hard-killed run was writing is dropped)."""
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        lines.pop()
    return [(json.loads(line)["step"], line) for line in lines if line.strip()]


def set_aside_past(run_dir: Path, step: int) -> SetAside | None:
    """Before a run resumes from checkpoint `step`: the records of any step logged after it (by
    the run that saved it, or a later one that saved nothing) are copied to `<run>.<timestamp>`,
    W&B's offline folders holding only such steps are moved there, and metrics.jsonl is cut
    back to `step`, so each step is logged once. None when nothing was logged past `step`."""
    metrics = run_dir / "metrics.jsonl"
    rows = _rows(metrics)
    later = [s for s, _ in rows if s > step]
    aside = None
    if later:
        target = aside_folder(run_dir, metrics.stat().st_mtime)
        target.mkdir()
        for name in RECORDS:
            source = run_dir / name
            if source.is_dir():
                shutil.copytree(source, target / name)
            elif source.is_file():
                shutil.copy2(source, target / name)
        for folder in _wandb_folders_past(run_dir, step):
            (target / "wandb").mkdir(exist_ok=True)
            folder.rename(target / "wandb" / folder.name)
        aside = SetAside(step, later, target)
    if metrics.is_file():
        write_atomic(metrics, "".join(line + "\n" for s, line in rows if s <= step))
    return aside


def _wandb_folders_past(run_dir: Path, step: int) -> list[Path]:
    """The run's offline W&B folders whose every logged step is past `step` (a folder that holds
    earlier steps too stays: W&B keeps its later ones, as it keeps a killed run's)."""
    out = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        steps = [row["step"] for row in history(list(folder.glob("run-*.wandb"))) if "step" in row]
        if steps and min(steps) > step:
            out.append(folder)
    return out
