"""Read W&B's own offline run files back (wandb 0.31 ships no Python reader): the
`run-<id>.wandb` log of protobuf `Record`s, in LevelDB's log format after a 7-byte header.

A resumed offline run asks what W&B kept of the run before it stopped (a killed process
keeps only what W&B had flushed) and which folders `wandb sync` must be given, and the tests
read what users would upload."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

from meshforge.core.errors import RunError

BLOCK = 32768  # LevelDB log blocks; a record never starts in a block's last 6 bytes
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """Every Record in one .wandb file, in order."""
    return list(iter_records(path))


def _fragments(path: Path) -> Iterator[tuple[int, bytes, bool]]:
    """(kind, bytes, whole) of each fragment of the log, in order; `whole` is False for a last
    fragment cut short (its writer was killed mid-write). An empty file has none."""
    data = Path(path).read_bytes()
    if not data:  # created, nothing written yet (a process killed at once)
        return
    if data[:4] != b":W&B":  # e.g. someone else's file in the run's wandb/ folder
        raise RunError(
            f"{path} is not a W&B run file (it starts {data[:4]!r}, not b':W&B'); "
            "move it out of the run's wandb/ folder and run again"
        )
    pos = 7
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left  # the block's zero padding
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            pos += BLOCK - pos % BLOCK if pos % BLOCK else 0
            continue
        yield kind, chunk, len(chunk) == length
    if pos < len(data) and BLOCK - pos % BLOCK >= 7:  # a fragment's header cut short
        yield 0, b"", False


def iter_records(path: Path) -> Iterator:
    """The whole Records of one .wandb file, in order, read as they are asked for."""
    from wandb.proto import wandb_internal_pb2 as pb  # wandb is slow to import: only when reading

    pending = b""
    for kind, chunk, whole in _fragments(path):
        if not whole:
            return  # a record cut short: W&B's own reader stops there too
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def ends_mid_record(path: Path) -> bool:
    """Whether the file ends inside a record (its writer was killed mid-write): `wandb sync` then
    uploads the records before it and skips the run's later folders given in the same command."""
    last = None
    for last in _fragments(path):
        pass
    return last is not None and (not last[2] or last[0] in (FIRST, MIDDLE))


def run_files(run_dir: Path) -> list[Path]:
    """The .wandb files of every offline W&B run under a folder, oldest first."""
    return sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)


def history(files: list[Path]) -> list[dict]:
    """Every history row logged, across the files (a resumed run writes a second file)."""
    rows = []
    for f in files:
        for r in records(f):
            if r.WhichOneof("record_type") == "history":
                rows.append(
                    {(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
                )
    return rows


def run_record(path: Path):
    """The RunRecord (id, project, job_type, tags, group, config, start time) of one file; None
    when W&B wrote none to it (its process was killed first)."""
    return next((r.run for r in iter_records(path) if r.WhichOneof("record_type") == "run"), None)


def segments(wandb_dir: Path, run_id: str) -> list[Path]:
    """The offline folders of one W&B run id (a resumed run writes one per process) that hold its
    run record, in start order: what `wandb sync` uploads as one run, in the order it does. A folder
    without a run record is left out: it holds nothing, and `wandb sync` given it uploads nothing."""
    found = []
    for f in Path(wandb_dir).glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"):
        run = run_record(f)
        if run is not None:
            found.append((run.start_time.ToMicroseconds(), f.parent))
    return [folder for _, folder in sorted(found)]


def config(path: Path) -> dict:
    """The run's config as logged (the run record's, then config updates), values decoded."""
    out: dict = {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        items = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        for item in items:
            key = item.key or ".".join(item.nested_key)
            out[key] = json.loads(item.value_json)
    return out


def artifacts(path: Path) -> list:
    """The artifacts a run logged (name, type, files)."""
    return [r.artifact for r in records(path) if r.WhichOneof("record_type") == "artifact"]
