"""The synthetic source, addressed by a global sample index, and its dp-sharded loader.

The source maps a global sample index to `seq_len + 1` tokens, deterministically. The
loader's only state is the next global index, so the stream is the same whatever the
data-parallel degree, and a run can continue it exactly on another mesh. Real corpora are
streamed per dp rank instead (run/data/corpus.py).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from meshforge.configs.schema import DataConfig
from meshforge.core.errors import CheckpointError, DataError
from meshforge.core.seeding import seeded_generator, source_generator


class TokenSource(Protocol):
    seq_len: int

    def batch(self, indices: Sequence[int]) -> torch.Tensor:
        """(len(indices), seq_len + 1) int64 tokens."""


def _distinct_successors(vocab_size: int, k: int, g: torch.Generator) -> torch.Tensor:
    """(V, k) distinct random tokens per row: rows with a repeat are redrawn whole, so the
    cost is V x k draws (a permutation per row would be V x V, 128 GB at a 128K vocabulary)."""
    succ = torch.randint(vocab_size, (vocab_size, k), generator=g)
    while True:
        ordered = succ.sort(-1).values
        redo = (ordered[:, 1:] == ordered[:, :-1]).any(-1).nonzero().squeeze(1)
        if len(redo) == 0:
            return succ
        succ[redo] = torch.randint(vocab_size, (len(redo), k), generator=g)


class MarkovSource:
    """A seeded first-order Markov chain: each token has `branching` random successors.

    Its entropy rate is the floor of the per-token cross-entropy any model can reach,
    so tests and users can see that training really learns. The chain is kept sparse
    (successors and their cumulative probabilities, in token order), so a 128K vocabulary
    costs V x branching numbers, not V x V, and a draw searches `branching` entries.
    """

    def __init__(self, vocab_size: int, seq_len: int, branching: int = 4, seed: int = 0):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        g = source_generator(seed)
        branching = min(branching, vocab_size)
        succ = _distinct_successors(vocab_size, branching, g)
        weights = -torch.rand(vocab_size, branching, generator=g, dtype=torch.float64).log()  # Dirichlet(1)
        probs = weights / weights.sum(-1, keepdim=True)
        order = succ.argsort(-1)  # token order: the cumulative sums of the dense row, minus its zeros
        self.successors, self.probs = succ.gather(1, order), probs.gather(1, order)
        self.cdf = self.probs.cumsum(-1)
        # a draw past a row's rounded total lands on the last token, as a dense row's search did
        self._draw_table = torch.cat([self.successors, torch.full((vocab_size, 1), vocab_size - 1)], dim=1)
        self.stationary = self._stationary()
        self._stationary_cdf = self.stationary.cumsum(0)
        self._rows: tuple[list, list] | None = None

    def _stationary(self) -> torch.Tensor:
        pi = torch.full((self.vocab_size,), 1.0 / self.vocab_size, dtype=torch.float64)
        flat_succ = self.successors.flatten()
        for _ in range(10_000):
            nxt = torch.zeros_like(pi).index_add_(0, flat_succ, (pi[:, None] * self.probs).flatten())
            if (nxt - pi).abs().max() < 1e-13:
                break
            pi = nxt
        return nxt / nxt.sum()

    def probability(self, prev: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
        """P(nxt | prev), elementwise (0 where nxt is not a successor of prev)."""
        hit = self.successors[prev] == nxt.unsqueeze(-1)
        return (self.probs[prev] * hit).sum(-1)

    def entropy_rate(self) -> float:
        """Expected next-token entropy (nats) under the stationary distribution: the loss floor."""
        row_entropy = -(self.probs * self.probs.log()).sum(-1)
        return float(self.stationary @ row_entropy)

    def batch(self, indices: Sequence[int]) -> torch.Tensor:
        # one generator per sample: content depends only on (seed, global index)
        u = torch.stack(
            [
                torch.rand(self.seq_len + 1, generator=seeded_generator(self.seed, i), dtype=torch.float64)
                for i in indices
            ]
        )  # (B, L+1)
        first = torch.searchsorted(self._stationary_cdf, u[:, 0].contiguous()).clamp_max_(self.vocab_size - 1)
        if self._rows is None:  # Python lists: a draw from 8 entries is a bisect, ~20x a torch op's speed
            self._rows = self.cdf.tolist(), self._draw_table.tolist()
        cdf, table = self._rows
        out = []
        for state, draws in zip(first.tolist(), u[:, 1:].tolist()):
            seq = [state]
            for x in draws:
                state = table[state][bisect_left(cdf[state], x)]  # the first cumulative prob >= x
                seq.append(state)
            out.append(seq)
        return torch.tensor(out, dtype=torch.long)


def build_source(cfg: DataConfig, vocab_size: int, seq_len: int) -> MarkovSource:
    """The synthetic source; corpora are streamed per dp rank instead (run/data/corpus.py)."""
    if cfg.source != "synthetic":
        raise DataError(
            f"data.source = {cfg.source!r} is a corpus: read it with run.data.loader.build_loader"
        )
    return MarkovSource(vocab_size, seq_len, cfg.markov_branching, cfg.seed)


@dataclass
class Batch:
    inputs: torch.Tensor  # (micro, seq_len)
    labels: torch.Tensor  # (micro, seq_len)


class ShardedLoader:
    """Yields, per optimizer step, this dp rank's `grad_accum_steps` micro-batches.

    Step s covers global samples [s*G, (s+1)*G); micro-batch a of dp rank d takes
    G-slice a*(micro*dp) + d*micro + [0, micro). Its state is one global sample index.
    With `prefetch`, a background thread builds the next step's batches while this one
    trains; the state still counts only the batches handed out.
    """

    def __init__(
        self,
        source: TokenSource,
        micro_batch: int,
        grad_accum: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        prefetch: bool = False,
    ):
        self.source, self.micro, self.accum = source, micro_batch, grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.position = 0  # next global sample index
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="meshforge-data") if prefetch else None
        self._ahead: tuple[int, Future] | None = None  # (position, its batches being built)

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.dp_size

    def _batches_at(self, position: int) -> list[Batch]:
        out = []
        for a in range(self.accum):
            start = position + a * self.micro * self.dp_size + self.dp_rank * self.micro
            tokens = self.source.batch(range(start, start + self.micro))
            out.append(Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
        return out

    def next_step(self) -> list[Batch]:
        ahead, self._ahead = self._ahead, None
        out = ahead[1].result() if ahead and ahead[0] == self.position else self._batches_at(self.position)
        self.position += self.global_batch
        if self._pool is not None:
            self._ahead = (self.position, self._pool.submit(self._batches_at, self.position))
        return out

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])

    def checkpoint_state(self) -> dict:
        """meta.json's data entry: one global index serves every dp degree."""
        return {"data_position": self.position}

    def restore_from(self, meta: dict) -> None:
        if "data_position" not in meta:
            raise CheckpointError(
                "the checkpoint holds a corpus position and this recipe reads the synthetic source: "
                "start from its weights instead (checkpoint.init_from=<its folder>)"
            )
        self.load_state_dict({"position": meta["data_position"]})

    def hold_steps(self, n_steps: int) -> None:
        """Nothing to check: an index-addressed stream never runs short."""

    def loss_floor(self) -> float | None:
        """The source's entropy rate (nats/token), where it is known (a Markov source)."""
        return self.source.entropy_rate() if isinstance(self.source, MarkovSource) else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._ahead = None, None


__all__ = [
    "MarkovSource",
    "build_source",
    "ShardedLoader",
    "Batch",
]
