"""One exception family for everything a user can cause or meet, each carrying its exit code.

The CLI maps a `MeshforgeError` to its message and `exit_code` in one place; anything else
is a bug and keeps its traceback. Where callers (and tests) catch a builtin exception, the
subclass derives from it too (a missing data file is still a FileNotFoundError).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

EXIT_RUNTIME = 1  # the run started and failed
EXIT_USAGE = 2  # bad recipe, bad arguments, or a machine that cannot run the recipe
EXIT_INTERRUPTED = 130  # SIGINT/SIGTERM, as a shell reports Ctrl-C


def nearest(value: int, valid: list[int], k: int = 2) -> str:
    """The k valid values closest to `value`, as '2, 4' (for a Problem's fix)."""
    best = sorted(valid, key=lambda v: (abs(v - value), v))[:k]
    return ", ".join(str(v) for v in sorted(best))


class MeshforgeError(Exception):
    """Base of every error meshforge reports to a user; `exit_code` is what the CLI returns."""

    exit_code = EXIT_RUNTIME


@dataclass
class Problem:
    """One thing wrong with a recipe: the field, the value, and what to do."""

    field: str
    value: Any
    message: str

    def __str__(self) -> str:
        return f"{self.field} = {self.value!r}: {self.message}"


class RecipeError(MeshforgeError, ValueError):
    """A recipe that cannot run, with every problem found."""

    exit_code = EXIT_USAGE

    def __init__(self, problems: Sequence[Problem], source: str = "recipe", kind: str = "recipe"):
        self.problems = list(problems)
        self.source = source
        self.kind = kind  # what the problems are in: a recipe, a hardware profile
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s)\n{lines}")


class UsageError(MeshforgeError):
    """Bad command-line input that is not a recipe field (a path, a flag's value)."""

    exit_code = EXIT_USAGE


class NothingProduced(UsageError):
    """A command that produced none of what it was asked for (every layout refused, a metric no
    run logged); the message says why, on one line."""


class MachineError(MeshforgeError):
    """This machine lacks what the recipe needs (devices, memory); nothing was started."""

    exit_code = EXIT_USAGE

    def __init__(self, missing: Sequence[str]):
        self.missing = list(missing)
        super().__init__(
            "this machine cannot run the recipe as written:\n" + "\n".join(f"  - {m}" for m in missing)
        )


class RunError(MeshforgeError, RuntimeError):
    """The run started and failed; its records and last checkpoint are kept."""


class SchedulerError(RunError):
    """A cluster scheduler's command (sbatch, squeue, sacct) is missing or failed."""


class NonFiniteLoss(RunError, FloatingPointError):
    """A non-finite loss or grad norm beyond train.max_bad_steps; the update was not applied."""


class OutOfMemory(RunError):
    """A rank ran out of device memory; the report says where and what to change."""


class LaunchFailed(RunError):
    """A rank of a locally launched job failed; the message names it and carries its error."""


class CheckpointError(RunError):
    """A checkpoint that cannot be written or loaded (corrupt, refused, of another model)."""


class IncompatibleWeights(MeshforgeError, ValueError):
    """Weights (a checkpoint, an HF folder, a pytree) of another model than the recipe's."""

    exit_code = EXIT_USAGE


class UnsupportedConfig(IncompatibleWeights):
    """An HF config.json key or value that changes the math in a way meshforge does not implement."""


class CheckpointNotFound(MeshforgeError, FileNotFoundError):
    """No complete checkpoint where one was named."""

    exit_code = EXIT_USAGE


class DataError(RunError, ValueError):
    """The data section names something that cannot be read as asked."""


class DataNotFound(RunError, FileNotFoundError):
    """A data file, glob or tokenizer that does not exist."""


class MissingColumn(RunError, KeyError):
    """A dataset without the text column the recipe names."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Interrupted(MeshforgeError, RuntimeError):
    """Stopped by SIGTERM/SIGINT (after saving a checkpoint when enabled)."""

    exit_code = EXIT_INTERRUPTED
