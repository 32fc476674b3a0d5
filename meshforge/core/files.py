"""Files meshforge writes whole or not at all: written under a temporary name, then renamed into
place, with the mode a plain `open()` would give them under the user's umask (a temporary file is
created private, 0600, and safetensors writes its files so: a rename would keep that, and a
colleague could not read an export)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def umask() -> int:
    """This process's umask, read without changing it (Linux's /proc; else set and restored)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a new file gets from `open()`: 0o666 less the umask (0o644 under umask 022)."""
    return 0o666 & ~umask()


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """A temporary path beside `path` to write; on success it gets the umask's mode and is renamed
    to `path` (a reader never sees half a file), on an error it is removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: Path | str, data: str | bytes) -> None:
    """`data` into `path`, whole or not at all, readable as the umask says."""
    with atomic_path(path) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")


def save_safetensors(tensors: dict, path: Path | str, metadata: dict[str, str] | None = None) -> None:
    """safetensors' `save_file`, whole or not at all, with the umask's mode (its own file is 0600)."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


@contextlib.contextmanager
def output_folder(out: Path) -> Iterator[Path]:
    """`out`, made if missing, for a command to write into: when the command fails (a refused
    export), what it made is removed, the folders it created included, never what was there."""
    out = Path(out)
    made = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)  # the topmost new one
    before = set(out.iterdir()) if made is None else set()
    out.mkdir(parents=True, exist_ok=True)
    try:
        yield out
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        else:
            for p in set(out.iterdir()) - before:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink()
        raise
