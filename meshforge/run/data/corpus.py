"""Document corpora, streamed: each data-parallel rank reads only its own part, tokenizes
documents with BOS/EOS, packs them into `seq_len + 1` windows, shuffles within blocks, and
can say exactly where it is.

Records come from HF datasets with `streaming=True` (a hub dataset by name, or local
jsonl/parquet/text files by glob), split over dp ranks by whole files/shards, round robin
(`IterableDataset.shard`; with a count dp does not divide, parts differ in length by a shard,
and each rank cycles through its own); only with fewer shards than ranks does every rank read
the stream and keep every dp-th record (`split_dataset_by_node`), which we warn about.
Windows do not overlap: each token is predicted once, as TorchTitan packs.

The position of a rank is small and exact: the dataset's own state before the document
holding the next block's first token, the offset of that token in the document, the block
number and how many of its windows were handed out. A block's order is a permutation seeded
by (data.seed, dp rank, block), so a resume re-reads one block and hands out the same windows
next. On another dp degree the split differs; the rule (`windows_to_skip`) is documented
and tested: every rank starts its new part from the beginning and skips the windows a rank of
the new degree would have handed out by then (the old ranks' total / new dp).
"""

from __future__ import annotations

import glob
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from meshforge.configs.schema import DataConfig
from meshforge.core.errors import (
    DataError,
    DataNotFound,
    MissingColumn,
)
from meshforge.core.seeding import window_shuffle
from meshforge.recipe.inert import FILE_FORMATS
from meshforge.run.data.verify import first_problem

log = logging.getLogger(__name__)

# what HF's json/parquet/text readers raise on a malformed file (ArrowInvalid is a ValueError, so is
# UnicodeDecodeError; StopIteration from an empty file, TypeError from a line that is not an object):
# caught only around the reader, and turned into the file and line `verify` finds, else re-raised
READER_ERRORS = (ValueError, TypeError, StopIteration)


def corpus_files(cfg_path: str, fmt: str | None) -> tuple[str, list[str]]:
    """(HF builder, files) for a glob of local files; one format per corpus."""
    files = sorted(glob.glob(cfg_path, recursive=True))
    if not files:
        raise DataNotFound(f"data.path = {cfg_path!r} matches no files; check the glob")
    if fmt:
        return fmt, files
    found = {FILE_FORMATS.get(Path(f).suffix) for f in files}
    if None in found or len(found) > 1:
        suffixes = sorted({Path(f).suffix or "(none)" for f in files})
        raise DataError(
            f"data.path = {cfg_path!r} matches files of kinds {suffixes}; one of .jsonl/.json, .parquet, "
            ".txt/.md per corpus, or set data.format = json | parquet | text"
        )
    return found.pop(), files


def open_stream(cfg: DataConfig, split: str, dp_rank: int, dp_size: int):
    """This dp rank's part of the corpus, as an HF IterableDataset (nothing downloaded whole)."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    if cfg.source == "files":
        builder, files = corpus_files(cfg.path, cfg.format)
        kwargs = {"sample_by": cfg.text_sample_by} if builder == "text" else {}
        try:  # it reads the first file to learn the features
            ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=True, **kwargs)
        except READER_ERRORS as e:
            found = first_problem(files[:1], builder, cfg.text_column)
            if found is None:
                raise
            raise found from e
    else:
        try:
            ds = datasets.load_dataset(cfg.hf_dataset, cfg.hf_config, split=split, streaming=True)
        except (FileNotFoundError, ValueError, ConnectionError) as e:
            where = f"data.hf_dataset = {cfg.hf_dataset!r} (config {cfg.hf_config!r}, split {split!r})"
            raise DataNotFound(f"{where} cannot be opened: {e}") from None
    if dp_size == 1:
        return ds
    if ds.num_shards >= dp_size:  # whole files/shards per rank (round robin), however many
        if ds.num_shards % dp_size and dp_rank == 0:
            log.info(
                "data: %d shards over dp=%d: ranks hold %d or %d of them (parts of unequal length; "
                "each rank cycles through its own)",
                ds.num_shards,
                dp_size,
                ds.num_shards // dp_size + 1,
                ds.num_shards // dp_size,
            )
        return ds.shard(num_shards=dp_size, index=dp_rank, contiguous=False)
    log.warning(
        "data: the corpus has %d shards for dp=%d ranks: every rank reads the whole stream and keeps "
        "every %d-th document (more files than ranks avoids that)",
        ds.num_shards,
        dp_size,
        dp_size,
    )
    return split_dataset_by_node(ds, rank=dp_rank, world_size=dp_size)


def part_files(cfg: DataConfig, dp_rank: int, dp_size: int) -> tuple[str, list[str]]:
    """(builder, this dp rank's files in the order its stream reads them), as `open_stream`
    splits them: one HF shard per local file, round robin when there are enough."""
    builder, files = corpus_files(cfg.path, cfg.format)
    return builder, files[dp_rank::dp_size] if len(files) >= dp_size else files


@dataclass
class Position:
    """Where a rank's stream is: see the module doc. JSON-serialisable."""

    dataset: dict | None = None  # the dataset's state before the block's first document (None: the start)
    offset: int = 0  # tokens of that document already packed into earlier blocks
    block: int = 0  # blocks started before this one, over every epoch (seeds its order)
    taken: int = 0  # windows of the block handed out
    epoch: int = 0  # times the whole part was read before
    documents: int = 0  # documents of this epoch read before the block
    windows: int = 0  # windows handed out by this rank in all (the rule for another dp degree)


class DocumentWindows:
    """One dp rank's windows of `seq_len + 1` tokens from its part of a corpus, in blocks of
    `block` windows shuffled by (seed, dp rank, block number)."""

    def __init__(
        self,
        stream,
        tokenizer,
        text_column: str,
        seq_len: int,
        block: int,
        seed: int,
        dp_rank: int,
        files: tuple[str, list[str]] | None = None,
    ):
        """`files`: (builder, the part's local files in stream order), to name the file and line
        of a record the reader fails on or that holds no text (`part_files`)."""
        self.stream, self.tok, self.column, self.files = stream, tokenizer, text_column, files
        self.width, self.block_size, self.seed, self.dp_rank = seq_len + 1, max(1, block), seed, dp_rank
        self.position = Position()
        self._block: list[list[int]] = []
        self._next: Position | None = None  # where the block after this one starts
        self._docs: Iterator | None = None
        self._live: tuple[int, int] | None = None  # (epoch, block) the running stream is at
        self._carry: tuple[list[int], dict] | None = None  # that block's first document, the state after it
        self._start = stream.state_dict()  # before any iteration: the part's beginning
        self.min_windows = 1  # windows one step takes (the loader sets it)

    # -- reading documents ------------------------------------------------------------

    def _restart(self, state: dict | None) -> None:
        # the stream resumes from the last state loaded into it: the start is loaded explicitly
        self.stream.load_state_dict(self._start if state is None else state)
        self._docs = iter(self.stream)

    def _document(self) -> list[int] | None:
        """The next document's tokens; None at the end of the part."""
        try:
            record = next(self._docs, None)
        except READER_ERRORS as e:
            found = self._bad_file()
            if found is None:
                raise
            raise found from e
        if record is None:
            return None
        if self.column not in record:
            raise self._bad_file() or MissingColumn(
                f"data.text_column = {self.column!r} is not in the records' fields {sorted(record)}"
            )
        if not isinstance(record[self.column], str):
            raise self._bad_file() or DataError(
                f"data: a record of data rank {self.dp_rank}'s part has {self.column!r} = "
                f"{record[self.column]!r:.40}, not a string; fix or drop it in the dataset"
            )
        return self.tok.document(record[self.column])

    def _bad_file(self) -> DataError | None:
        """The first problem in the files the stream is reading (from the lowest shard index its
        state holds to the one after the highest: never the rest of the part); None without local
        files, or if they read cleanly."""
        if self.files is None:
            return None
        builder, files = self.files
        shards = _shard_indices(self.stream.state_dict()) or [0]
        return first_problem(files[min(shards) : max(shards) + 2], builder, self.column)

    def _fill(self, start: Position) -> tuple[list[list[int]], Position]:
        """The block that starts at `start`, in stream order, and where the next one starts
        (at the end of the part: the part's start, one epoch later). The stream keeps running
        from one block to the next; it is repositioned only when `start` is elsewhere (a resume)."""
        if self._live == (start.epoch, start.block):
            carried = self._carry  # the document this block starts in, read by the last fill
        else:
            self._restart(start.dataset)
            carried = None
        windows: list[list[int]] = []
        pending: list[int] = []
        offset, docs = start.offset, 0
        before = start.dataset  # the stream's state before the next document
        while True:
            if carried is not None:
                (full, after), carried = carried, None
            elif (full := self._document()) is not None:
                after = self.stream.state_dict()  # (read once the document is out)
            else:
                break
            state, before = before, after
            tokens, offset = full[offset:], 0
            docs += 1
            need = self.width - len(pending)
            while len(tokens) >= need:
                windows.append(pending + tokens[:need])
                tokens, pending, need = tokens[need:], [], self.width
                if len(windows) == self.block_size:
                    if tokens:  # the next block starts inside this document
                        nxt = Position(state, len(full) - len(tokens), start.block + 1, epoch=start.epoch)
                        nxt.documents = start.documents + docs - 1
                        self._carry = (full, after)
                    else:
                        nxt = Position(before, 0, start.block + 1, epoch=start.epoch)
                        nxt.documents = start.documents + docs
                        self._carry = None
                    self._live = (nxt.epoch, nxt.block)
                    return windows, nxt
            pending += tokens
        self._live = None
        return windows, Position(None, 0, start.block + 1, epoch=start.epoch + 1)

    # -- handing out windows ---------------------------------------------------------

    def _order(self, block: int, n: int) -> list[int]:
        order = list(range(n))
        window_shuffle(self.seed, self.dp_rank, block).shuffle(order)  # a per-rank stream (core.seeding)
        return order

    def next_windows(self, n: int) -> torch.Tensor:
        """The next `n` windows, (n, seq_len + 1)."""
        out = []
        while len(out) < n:
            if not self._block or self.position.taken == len(self._block):
                if self._block:
                    self._advance()
                blk, self._next = self._fill(self.position)
                if self._next.epoch > self.position.epoch == 0:
                    self._check_epoch(self.position.windows + len(blk))
                if not blk:  # the part ended exactly at a block boundary
                    self._block = []
                    self._advance()
                    continue
                if self.position.epoch and self.position.dataset is None and self.position.taken == 0:
                    log.info("data rank %d: epoch %d of its part begins", self.dp_rank, self.position.epoch)
                self._block = [blk[i] for i in self._order(self.position.block, len(blk))]
            out.append(self._block[self.position.taken])
            self.position.taken += 1
            self.position.windows += 1
        return torch.tensor(out, dtype=torch.long)

    def _advance(self) -> None:
        """On to the next block, keeping the count of windows handed out."""
        windows, self.position = self.position.windows, self._next
        self.position.windows = windows

    def _check_epoch(self, windows: int) -> None:
        """A part must hold at least one step's windows: a shorter one would repeat windows
        within a step."""
        if windows < self.min_windows:
            raise DataError(
                f"data rank {self.dp_rank}'s part of the corpus holds {windows} window(s) of seq_len + 1 = "
                f"{self.width} tokens, fewer than one step takes ({self.min_windows}); add data, lower "
                "train.seq_len or the batch, or use fewer dp ranks"
            )

    def state_dict(self) -> dict:
        return asdict(self.position)

    def load_state_dict(self, state: dict) -> None:
        self.position = Position(**state)
        self._block, self._live = [], None  # rebuilt (and re-permuted) from the position at the next call
        taken, windows = self.position.taken, self.position.windows
        self.position.taken, self.position.windows = 0, windows - taken
        if taken:
            self.next_windows(taken)  # skip what was handed out before


def _shard_indices(state) -> list[int]:
    """Every `shard_idx` in an HF stream's (nested) state: the files it is reading or has read ahead."""
    if isinstance(state, dict):
        found = [state["shard_idx"]] if isinstance(state.get("shard_idx"), int) else []
        return found + [i for v in state.values() for i in _shard_indices(v)]
    return []


def windows_to_skip(states: list[dict], new_dp: int) -> int:
    """Resuming on another dp degree: the split over ranks differs, so each new rank reads its
    new part from the start and skips the windows a rank of `new_dp` would have handed out by
    now (the old ranks' total / new_dp): the same steps' worth of data, other documents. It
    costs reading that much of the part again, once."""
    return sum(s["windows"] for s in states) // new_dp
