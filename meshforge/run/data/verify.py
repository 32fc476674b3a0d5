"""Local data files checked for what the streaming reader needs, naming the file, the line (or
row) and the fix of the first problem: before launch on the head of every file (`PEEK_BYTES`,
and a parquet file's footer), and in full on the files a rank's reader failed in, since the
reader's own errors (ArrowInvalid, ValueError, StopIteration, ...) name neither file nor line.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from meshforge.core.errors import DataError

PEEK_BYTES = 1 << 16  # what the pre-launch check reads of each JSON/text file; the rest is read in training
BOM = codecs.BOM_UTF8
JSON_TYPES = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", list: "an array"}


def check_file(path: str, builder: str, column: str, limit: int | None = PEEK_BYTES) -> None:
    """Raise a DataError for the first thing in `path` the `builder` (json | parquet | text)
    reader cannot use as documents of `column`, reading at most `limit` bytes (None: all)."""
    if os.path.getsize(path) == 0:
        raise DataError(f"{path}: the file is empty (0 bytes); regenerate it or leave it out of the glob")
    if builder == "parquet":
        _check_parquet(path, column, whole=limit is None)
        return
    with open(path, "rb") as f:
        head = f.read(-1 if limit is None else limit + 1)
    whole = limit is None or len(head) <= limit
    head = head if whole else head[:limit]
    if head.startswith(BOM):
        raise DataError(
            f"{path}: starts with a UTF-8 byte-order mark, which the reader takes for text (or fails on); "
            "save it as UTF-8 without one (e.g. sed -i '1s/^\\xEF\\xBB\\xBF//' FILE)"
        )
    if builder == "text":
        _check_utf8(path, head, whole)
    else:
        _check_json(path, head, whole, column)


def first_problem(files: Iterable[str], builder: str, column: str) -> DataError | None:
    """The first problem in `files`, each read in full (after a reader's error); None if none."""
    for path in files:
        try:
            check_file(path, builder, column, limit=None)
        except DataError as e:
            return e
    return None


def _check_utf8(path: str, data: bytes, whole: bool) -> None:
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=whole)
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{path}, line {line} (byte {e.start}): not UTF-8 (0x{data[e.start]:02x}: {e.reason}); "
            "data files are read as UTF-8 text: convert it (e.g. iconv -f latin1 -t utf-8) or leave it out"
        ) from e


def _check_json(path: str, data: bytes, whole: bool, column: str) -> None:
    if data.lstrip()[:1] == b"[":  # one JSON array of records (.json), checkable only whole
        if whole:
            records = _parse(path, "the file", data)
            if not isinstance(records, list):
                raise DataError(f"{path}: not one JSON array of records nor JSON lines; fix the file")
            for i, record in enumerate(records):
                check_record(path, f"record {i} of its array", record, column)
        return
    lines = data.split(b"\n")
    if not whole:
        lines = lines[:-1]  # the last one may be cut by the limit
    records = 0
    for number, raw in enumerate(lines, 1):
        if raw.strip():
            records += 1
            check_record(path, f"line {number}", _parse(path, f"line {number}", raw), column)
    if whole and not records:
        raise DataError(f"{path}: holds no records (only blank lines); regenerate it or leave it out")


def _parse(path: str, where: str, raw: bytes):
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}, {where}: not UTF-8 text (0x{raw[e.start]:02x} at byte {e.start}): a binary file? "
            "JSON lines are UTF-8 text, one JSON object per line"
        ) from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}, {where}: not JSON ({e.msg}: column {e.colno}); each line must be one JSON "
            "object: fix or remove it"
        ) from e


def check_record(path: str, where: str, record, column: str) -> None:
    """A record must be an object whose `column` is a string."""
    if not isinstance(record, dict):
        kind = JSON_TYPES.get(type(record), f"a {type(record).__name__}")
        raise DataError(f"{path}, {where}: {kind}, not an object with a {column!r} field; fix or remove it")
    if column not in record:
        raise DataError(
            f"{path}, {where}: no field {column!r} (it has {sorted(record)}); set data.text_column to "
            "the field holding the text"
        )
    value = record[column]
    if not isinstance(value, str):
        kind = "an object" if isinstance(value, dict) else JSON_TYPES.get(type(value), type(value).__name__)
        shown = "" if value is None else f" ({json.dumps(value)[:40]})"
        raise DataError(
            f"{path}, {where}: field {column!r} is {kind}{shown}, not a string; fix or remove that record"
        )


def _check_parquet(path: str, column: str, whole: bool) -> None:
    """The footer (a truncated file has none) and the column's type; nulls where the row groups'
    statistics count them (every row group when `whole`)."""
    try:
        pf = pq.ParquetFile(path)
    except pa.ArrowException as e:
        raise DataError(
            f"{path}: not a readable parquet file ({e}); a truncated download? fetch it again"
        ) from e
    schema = pf.schema_arrow
    if column not in schema.names:
        raise DataError(
            f"{path}: no column {column!r} (it has {schema.names}); set data.text_column to the column "
            "holding the text"
        )
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise DataError(
            f"{path}: column {column!r} holds {kind}, not strings; set data.text_column to a text column"
        )
    # the column's leaf in the file (other, nested columns shift leaf indices from arrow's)
    index = next(i for i in range(pf.metadata.num_columns) if pf.schema.column(i).path == column)
    first_row = 0
    for group in range(pf.num_row_groups):
        meta = pf.metadata.row_group(group)
        stats = meta.column(index).statistics
        counted = stats is not None and stats.has_null_count  # pyarrow writes it by default
        if whole or (counted and stats.null_count):
            try:
                values = pf.read_row_group(group, columns=[column]).column(0)
            except pa.ArrowException as e:
                raise DataError(f"{path}: row group {group} is unreadable ({e}); fetch the file again") from e
            if values.null_count:
                row = first_row + values.is_null().to_pylist().index(True)
                raise DataError(
                    f"{path}, row {row} (counting from 0): column {column!r} is null; fix or drop that row"
                )
        first_row += meta.num_rows
