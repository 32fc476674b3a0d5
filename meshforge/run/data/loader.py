"""The loader of a recipe: the synthetic source's, or a corpus's (per dp rank, prefetched on a
background thread, its position in every checkpoint); and the data checks made before launch."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch.distributed as dist

from meshforge.configs import Recipe
from meshforge.core.errors import CheckpointError, DataError, DataNotFound, Problem, RecipeError
from meshforge.run.data.corpus import DocumentWindows, corpus_files, open_stream, part_files, windows_to_skip
from meshforge.run.data.synthetic import Batch, ShardedLoader, build_source
from meshforge.run.data.tokenizer import build_tokenizer, is_hub_id
from meshforge.run.data.verify import check_file

log = logging.getLogger(__name__)

# the data settings a corpus position belongs to (what is read, how it is cut into windows, in
# what order): resuming with any of them changed would skip or repeat data, so it is refused
FINGERPRINT = (
    "source",
    "path",
    "format",
    "text_sample_by",
    "hf_dataset",
    "hf_config",
    "split",
    "text_column",
    "tokenizer",
    "shuffle_windows",
    "seed",
)


class StepLoader(Protocol):
    """What the trainers, the checkpointer and the evaluator use of a loader: the synthetic
    source's ShardedLoader and the CorpusLoader both implement it, so no caller asks which."""

    def next_step(self) -> list[Batch]:
        """This dp rank's micro-batches of the next optimizer step."""

    def state_dict(self) -> dict:
        """This rank's position: after the last step handed out (a prefetched one not counted)."""

    def load_state_dict(self, state: dict) -> None:
        """Continue from a position `state_dict` gave."""

    def checkpoint_state(self) -> dict:
        """meta.json's data entry (a corpus gathers every dp rank's position: a collective)."""

    def restore_from(self, meta: dict) -> None:
        """Continue from a checkpoint's meta.json, or refuse it naming why."""

    def hold_steps(self, n_steps: int) -> None:
        """Require this rank's part to hold `n_steps` steps' batches (the evaluator's held-out set)."""

    def loss_floor(self) -> float | None:
        """The data's entropy rate in nats/token where it is known, else None."""

    def close(self) -> None:
        """Stop the background thread."""


class CorpusLoader:
    """Per optimizer step, this dp rank's `grad_accum` micro-batches of `micro` windows. The
    next step is built on a background thread (reading and tokenizing off the training
    thread); the state is the position after the last step handed out."""

    def __init__(
        self,
        windows: DocumentWindows,
        micro_batch: int,
        grad_accum: int,
        dp_rank: int,
        dp_size: int,
        dp_group=None,
        fingerprint: dict | None = None,
    ):
        self.windows, self.micro, self.accum = windows, micro_batch, grad_accum
        self.dp_rank, self.dp_size, self.dp_group = dp_rank, dp_size, dp_group
        self.fingerprint = fingerprint or {}
        windows.min_windows = micro_batch * grad_accum
        self._state = windows.state_dict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="meshforge-corpus")
        self._ahead: Future | None = None

    def _step(self) -> tuple[list[Batch], dict]:
        out = []
        for _ in range(self.accum):
            tokens = self.windows.next_windows(self.micro)
            out.append(Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
        return out, self.windows.state_dict()

    def next_step(self) -> list[Batch]:
        ahead, self._ahead = self._ahead, None
        batches, self._state = ahead.result() if ahead else self._step()
        self._ahead = self._pool.submit(self._step)
        return batches

    def state_dict(self) -> dict:
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        self._drop_ahead()
        self.windows.load_state_dict(state)
        self._state = self.windows.state_dict()

    def skip(self, n_windows: int) -> None:
        """Hand out and drop `n_windows` (resuming on another dp degree)."""
        self._drop_ahead()
        while n_windows > 0:
            take = min(n_windows, 1024)
            self.windows.next_windows(take)
            n_windows -= take
        self._state = self.windows.state_dict()

    def hold_steps(self, n_steps: int) -> None:
        """A part shorter than `n_steps` steps is an error, never windows repeated."""
        self.windows.min_windows = self.micro * self.accum * n_steps

    def loss_floor(self) -> None:
        """Unknown for documents."""
        return None

    def _drop_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead.exception()  # let it finish (an error of a step never handed out is moot), rewind
            self._ahead = None
            self.windows.load_state_dict(self._state)

    # -- checkpoints -------------------------------------------------------------------

    def checkpoint_state(self) -> dict:
        """Every dp rank's position (gathered over the dp group; a collective), for meta.json."""
        states = [self.state_dict()]
        if self.dp_size > 1:
            states = [None] * self.dp_size
            dist.all_gather_object(states, self.state_dict(), group=self.dp_group)
        return {"data_corpus": {"dp": self.dp_size, "ranks": states, "settings": self.fingerprint}}

    def restore_from(self, meta: dict) -> None:
        saved = meta.get("data_corpus")
        if saved is None:
            raise CheckpointError(
                "the checkpoint holds a synthetic data position and this recipe reads a corpus: "
                "start from its weights instead (checkpoint.init_from=<its folder>)"
            )
        changed = sorted(k for k in self.fingerprint if saved["settings"].get(k) != self.fingerprint[k])
        if changed:
            was = ", ".join(f"{k}: {saved['settings'].get(k)!r} -> {self.fingerprint[k]!r}" for k in changed)
            raise CheckpointError(
                f"the checkpoint's data position belongs to other data settings ({was}); resume with "
                "the same ones, or start from its weights (checkpoint.init_from=<its folder>)"
            )
        if saved["dp"] == self.dp_size:
            self.load_state_dict(saved["ranks"][self.dp_rank])
            return
        skip = windows_to_skip(saved["ranks"], self.dp_size)
        log.info(
            "data: dp %d -> %d: this rank's new part skips its first %d windows",
            saved["dp"],
            self.dp_size,
            skip,
        )
        self.skip(skip)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._ahead = None


def build_loader(
    recipe: Recipe,
    vocab_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    dp_group=None,
    micro: int | None = None,
) -> StepLoader:
    """The recipe's loader for this dp rank: the synthetic source's index-addressed
    ShardedLoader, or a CorpusLoader over this rank's part of a corpus."""
    d, t = recipe.data, recipe.train
    micro = micro or t.micro_batch_size
    accum = t.grad_accum_steps if micro == t.micro_batch_size else 1
    if d.source == "synthetic":
        return ShardedLoader(
            build_source(d, vocab_size, t.seq_len), micro, accum, dp_rank, dp_size, prefetch=True
        )
    tok = build_tokenizer(d.tokenizer)
    check_vocab(d.tokenizer, tok.vocab_size, vocab_size)
    stream = open_stream(d, d.split, dp_rank, dp_size)
    files = part_files(d, dp_rank, dp_size) if d.source == "files" else None
    windows = DocumentWindows(
        stream, tok, d.text_column, t.seq_len, d.shuffle_windows, d.seed, dp_rank, files
    )
    fingerprint = {f"data.{k}": getattr(d, k) for k in FINGERPRINT} | {"train.seq_len": t.seq_len}
    return CorpusLoader(windows, micro, accum, dp_rank, dp_size, dp_group, fingerprint)


def check_data(recipe: Recipe, vocab_size: int) -> list[str]:
    """What --dry-run and the launcher can know of the data settings without downloading
    anything (files exist, are of one kind, and the head of each is readable documents; a local
    tokenizer reads and fits the model's vocabulary); lines for the plan. Problems raise a
    RecipeError naming the field, the file and the line."""
    d = recipe.data
    if d.source == "synthetic":
        return [f"synthetic Markov source (branching {d.markov_branching}, seed {d.seed})"]
    problems, lines = [], []
    corpora = [("data.path", d.path)] if d.source == "files" else []
    if recipe.eval.path and recipe.eval.every:  # eval off: eval.path is unread (recipe/inert.py)
        corpora.append(("eval.path", recipe.eval.path))
    for field, pattern in corpora:
        try:
            builder, files = corpus_files(pattern, d.format)
            lines.append(f"{len(files)} local {builder} files ({pattern}), field {d.text_column!r}")
        except (DataError, DataNotFound) as e:
            problems.append(Problem(field, pattern, str(e).removeprefix(f"data.path = {pattern!r} ")))
            continue
        problems += [Problem(field, pattern, m) for m in _file_problems(files, builder, d.text_column)]
    if d.source != "files":
        where = f"config {d.hf_config!r}, " if d.hf_config else ""
        lines.append(f"HF dataset {d.hf_dataset} ({where}split {d.split!r}), streamed from the first step")
    if not is_hub_id(d.tokenizer):
        try:
            tok = build_tokenizer(d.tokenizer)
            check_vocab(d.tokenizer, tok.vocab_size, vocab_size)
            lines.append(
                f"tokenizer {d.tokenizer}: {tok.vocab_size} tokens, BOS {tok.bos_id}, EOS {tok.eos_id}"
            )
        except (DataError, DataNotFound) as e:
            problems.append(
                Problem(
                    "data.tokenizer", d.tokenizer, str(e).removeprefix(f"data.tokenizer = {d.tokenizer!r}: ")
                )
            )
    else:
        lines.append(f"tokenizer {d.tokenizer}: from the hub at start (not checked here)")
    if problems:
        raise RecipeError(problems, "data")
    return lines


def _file_problems(files: list[str], builder: str, column: str, most: int = 10) -> list[str]:
    """The first problem of each bad file in the head of every file (`verify.PEEK_BYTES`), at
    most `most` of them and a count of the rest."""
    found = []
    for path in files:
        try:
            check_file(path, builder, column)
        except DataError as e:
            found.append(str(e))
    more = [f"... and {len(found) - most} more file(s) like these"] if len(found) > most else []
    return found[:most] + more


def check_vocab(spec: str, tokenizer_vocab: int, model_vocab: int) -> None:
    if tokenizer_vocab > model_vocab:
        raise DataError(
            f"data.tokenizer = {spec!r}: has {tokenizer_vocab} tokens but model.vocab_size = {model_vocab}; "
            f"set model.vocab_size >= {tokenizer_vocab} or use a smaller tokenizer"
        )
