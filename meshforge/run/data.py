"""Data: token sources addressed by a global sample index, and a dp-sharded loader.

A source maps a global sample index to `seq_len + 1` tokens, deterministically. The
loader's only state is the next global index, so the stream is the same whatever the
data-parallel degree, and a run can continue it exactly on another mesh.
"""

from __future__ import annotations

import glob
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from meshforge.configs.schema import DataConfig
from meshforge.core.errors import DataError, DataNotFound, MissingColumn
from meshforge.core.seeding import seeded_generator


class TokenSource(Protocol):
    seq_len: int

    def batch(self, indices: Sequence[int]) -> torch.Tensor:
        """(len(indices), seq_len + 1) int64 tokens."""


class MarkovSource:
    """A seeded first-order Markov chain: each token has `branching` random successors.

    Its entropy rate is the floor of the per-token cross-entropy any model can reach,
    so tests and users can see that training really learns.
    """

    def __init__(self, vocab_size: int, seq_len: int, branching: int = 4, seed: int = 0):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        g = torch.Generator().manual_seed(seed)
        branching = min(branching, vocab_size)
        succ = torch.stack([torch.randperm(vocab_size, generator=g)[:branching] for _ in range(vocab_size)])
        weights = -torch.rand(vocab_size, branching, generator=g, dtype=torch.float64).log()  # Dirichlet(1)
        probs = weights / weights.sum(-1, keepdim=True)
        self.transition = torch.zeros(vocab_size, vocab_size, dtype=torch.float64).scatter_(1, succ, probs)
        self.cdf = self.transition.cumsum(-1)
        self.stationary = self._stationary()

    def _stationary(self) -> torch.Tensor:
        pi = torch.full((self.vocab_size,), 1.0 / self.vocab_size, dtype=torch.float64)
        for _ in range(10_000):
            nxt = pi @ self.transition
            if (nxt - pi).abs().max() < 1e-13:
                break
            pi = nxt
        return nxt / nxt.sum()

    def entropy_rate(self) -> float:
        """Expected next-token entropy (nats) under the stationary distribution: the loss floor."""
        p = self.transition
        row_entropy = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)
        return float(self.stationary @ row_entropy)

    def batch(self, indices: Sequence[int]) -> torch.Tensor:
        # one generator per sample: content depends only on (seed, global index)
        u = torch.stack(
            [
                torch.rand(self.seq_len + 1, generator=seeded_generator(self.seed, i), dtype=torch.float64)
                for i in indices
            ]
        )  # (B, L+1)
        stationary_cdf = self.stationary.cumsum(0)
        state = torch.searchsorted(stationary_cdf, u[:, :1].contiguous()).clamp_max(self.vocab_size - 1)
        out = [state]
        for t in range(1, self.seq_len + 1):
            cdf = self.cdf[state.squeeze(1)]  # (B, V)
            state = torch.searchsorted(cdf, u[:, t : t + 1].contiguous()).clamp_max(self.vocab_size - 1)
            out.append(state)
        return torch.cat(out, dim=1).long()


class TokenWindows:
    """A token stream cut into `seq_len + 1` windows (stride seq_len), reshuffled each epoch."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int = 0):
        self.tokens, self.seq_len, self.seed = tokens.long(), seq_len, seed
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(
                f"{len(tokens)} tokens cannot fill one sample of seq_len={seq_len}+1; "
                "add data or lower train.seq_len"
            )
        self._perms: dict[int, torch.Tensor] = {}

    def _window(self, index: int) -> int:
        epoch, i = divmod(index, self.n_windows)
        if epoch not in self._perms:
            self._perms = {
                epoch: torch.randperm(self.n_windows, generator=seeded_generator(self.seed, epoch))
            }
        return int(self._perms[epoch][i])

    def batch(self, indices: Sequence[int]) -> torch.Tensor:
        starts = [self._window(i) * self.seq_len for i in indices]
        return torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts])


# --- tokenizers -------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens: no vocabulary file, nothing to download."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A HuggingFace `tokenizer.json` (the tokenizers library; read from a local file)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


def build_tokenizer(spec: str):
    if spec == "byte":
        return ByteTokenizer()
    if not Path(spec).is_file():
        raise DataNotFound(f"data.tokenizer = {spec!r}: no such tokenizer.json; use 'byte' or a local path")
    return HFTokenizer(spec)


# --- sources from the recipe ------------------------------------------------------


def _expand(pattern: str) -> list[str]:
    files = sorted(glob.glob(pattern, recursive=True))
    if not files:
        raise DataNotFound(f"data.path = {pattern!r} matches no files; check the glob")
    return files


def _texts(cfg: DataConfig) -> list[str]:
    if cfg.source == "text":
        return [Path(f).read_text(encoding="utf-8", errors="replace") for f in _expand(cfg.path)]
    import datasets  # optional extra: meshforge[hf]

    if cfg.path:
        ds = datasets.load_dataset(cfg.hf_format, data_files=_expand(cfg.path), split="train")
    else:
        ds = datasets.load_dataset(cfg.hf_dataset, split="train")
    if cfg.text_column not in ds.column_names:
        raise MissingColumn(
            f"data.text_column = {cfg.text_column!r} not in the dataset's columns {ds.column_names}"
        )
    return list(ds[cfg.text_column])


def build_source(cfg: DataConfig, vocab_size: int, seq_len: int) -> TokenSource:
    """The recipe's token source. Text is tokenized once, documents joined by a blank line."""
    if cfg.source == "synthetic":
        return MarkovSource(vocab_size, seq_len, cfg.markov_branching, cfg.seed)
    tok = build_tokenizer(cfg.tokenizer)
    if tok.vocab_size > vocab_size:
        raise DataError(
            f"tokenizer has {tok.vocab_size} tokens but model.vocab_size = {vocab_size}; "
            f"set model.vocab_size={tok.vocab_size}"
        )
    ids = tok.encode("\n\n".join(_texts(cfg)))
    return TokenWindows(torch.tensor(ids, dtype=torch.long), seq_len, cfg.seed)


@dataclass
class Batch:
    inputs: torch.Tensor  # (micro, seq_len)
    labels: torch.Tensor  # (micro, seq_len)


class ShardedLoader:
    """Yields, per optimizer step, this dp rank's `grad_accum_steps` micro-batches.

    Step s covers global samples [s*G, (s+1)*G); micro-batch a of dp rank d takes
    G-slice a*(micro*dp) + d*micro + [0, micro). Its state is one global sample index.
    """

    def __init__(
        self, source: TokenSource, micro_batch: int, grad_accum: int, dp_rank: int = 0, dp_size: int = 1
    ):
        self.source, self.micro, self.accum = source, micro_batch, grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.position = 0  # next global sample index

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.dp_size

    def next_step(self) -> list[Batch]:
        out = []
        for a in range(self.accum):
            start = self.position + a * self.micro * self.dp_size + self.dp_rank * self.micro
            tokens = self.source.batch(range(start, start + self.micro))
            out.append(Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
        self.position += self.global_batch
        return out

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def loss_floor(source: TokenSource) -> float | None:
    """The source's entropy rate (nats/token) where it is known."""
    return source.entropy_rate() if isinstance(source, MarkovSource) else None


__all__ = [
    "MarkovSource",
    "TokenWindows",
    "ByteTokenizer",
    "HFTokenizer",
    "build_source",
    "ShardedLoader",
    "Batch",
    "loss_floor",
]
