"""Read W&B's own offline run files back (wandb 0.31 ships no Python reader): the
`run-<id>.wandb` log of protobuf `Record`s, in LevelDB's log format after a 7-byte header.

A resumed offline run asks what W&B kept of the run before it stopped (a killed process
keeps only what W&B had flushed), and the tests read what users would upload."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from meshforge.core.errors import RunError

BLOCK = 32768  # LevelDB log blocks; a record never starts in a block's last 6 bytes
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """Every Record in one .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb  # wandb is slow to import: only when reading

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":  # e.g. a file W&B was killed while creating, or someone else's
        raise RunError(
            f"{path} is not a W&B run file (it starts {data[:4]!r}, not b':W&B'); "
            "move it out of the run's wandb/ folder and run again"
        )
    out, pos, pending = [], 7, b""
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
        if kind in (FULL, FIRST):
            pending = chunk
        else:
            pending += chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


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
    """The RunRecord (id, project, job_type, tags, group, config) of one file."""
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")


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
