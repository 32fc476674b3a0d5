"""Every dp rank's data in one process: what one JAX controller trains on. A corpus is read as
the torch run's dp ranks read it (each rank its own part), and a step's global batch is their
micro-batches side by side, so both frameworks train on the same windows and a checkpoint's data
position means the same in either."""

from __future__ import annotations

import torch

from meshforge.configs import Recipe
from meshforge.run.data.loader import StepLoader, build_loader
from meshforge.run.data.synthetic import Batch


class GlobalBatchLoader:
    """The StepLoader protocol over `dp` ranks' loaders: a step is one Batch holding every rank's
    micro-batches, in rank order."""

    def __init__(self, parts: list[StepLoader]):
        self.parts = parts

    def next_step(self) -> list[Batch]:
        batches = [b for part in self.parts for b in part.next_step()]
        return [Batch(torch.cat([b.inputs for b in batches]), torch.cat([b.labels for b in batches]))]

    def state_dict(self) -> dict:
        return {"ranks": [p.state_dict() for p in self.parts]}

    def load_state_dict(self, state: dict) -> None:
        for part, own in zip(self.parts, state["ranks"]):
            part.load_state_dict(own)

    def checkpoint_state(self) -> dict:
        """meta.json's corpus entry, as the torch trainer's dp ranks gather it."""
        settings = self.parts[0].fingerprint
        return {
            "data_corpus": {"dp": len(self.parts), "ranks": self.state_dict()["ranks"], "settings": settings}
        }

    def restore_from(self, meta: dict) -> None:
        for part in self.parts:  # each rank takes its own position (or re-splits, from another dp degree)
            part.restore_from(meta)

    def hold_steps(self, n_steps: int) -> None:
        for part in self.parts:
            part.hold_steps(n_steps)

    def loss_floor(self) -> float | None:
        return self.parts[0].loss_floor()

    def close(self) -> None:
        for part in self.parts:
            part.close()


def global_batch_loader(recipe: Recipe, vocab_size: int, dp: int) -> StepLoader:
    """A step's whole global batch: the synthetic source's directly (index-addressed, it is the
    same samples), a corpus's from each of the `dp` ranks' parts."""
    if recipe.data.source == "synthetic":
        return build_loader(recipe, vocab_size, micro=recipe.train.global_batch_size)
    return GlobalBatchLoader([build_loader(recipe, vocab_size, rank, dp) for rank in range(dp)])
