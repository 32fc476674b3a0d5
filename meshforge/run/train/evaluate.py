"""Held-out evaluation: every `eval.every` steps and after the last, the same `eval.batches`
global batches of held-out data, forward only (through the pipeline schedule's `eval()` under
PP); `eval/loss` (token cross-entropy over every held-out target token of every dp rank,
normalised as the training loss is, so every mesh gives the same number for the same weights)
and `eval/perplexity`.

Held out: the synthetic source's samples from index 2^40 on (a range training never reaches),
`eval.path` files, or the dataset's `eval.split`; never the training stream.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

from meshforge.configs import Recipe
from meshforge.run.data.loader import StepLoader, build_loader
from meshforge.run.train.forward_backward import ForwardBackward
from meshforge.run.train.step import IGNORE_INDEX

HELD_OUT_INDEX = 2**40  # the synthetic source's held-out samples start here


def held_out_recipe(recipe: Recipe) -> Recipe:
    """The recipe whose data stream is the held-out set, read in order."""
    r = copy.deepcopy(recipe)
    if r.data.source == "files":
        r.data.path = r.eval.path
    elif r.data.source == "hf":
        r.data.split = r.eval.split
    r.data.shuffle_windows = 0
    return r


def data_streams(recipe: Recipe, vocab_size: int, meshes, dims, device) -> tuple[StepLoader, Evaluator]:
    """This rank's training loader and evaluator: its dp coordinate decides its slice of every
    global batch (its part of a corpus), and of the held-out set."""
    dp_rank = meshes.dp.get_local_rank() if meshes is not None else 0
    dp_group = meshes.dp.get_group() if dims.dp > 1 else None
    loader = build_loader(recipe, vocab_size, dp_rank, dims.dp, dp_group)
    return loader, Evaluator(recipe, vocab_size, dp_rank, dims.dp, dp_group, device)


class Evaluator:
    def __init__(
        self,
        recipe: Recipe,
        vocab_size: int,
        dp_rank: int,
        dp_size: int,
        dp_group,
        device,
        loader: StepLoader | None = None,
    ):
        """`loader`: the held-out set's, where not this dp rank's (one JAX controller reads every
        rank's: data/global_batch.py)."""
        self.cfg, self.steps, self.device, self.tp = recipe.eval, recipe.train.steps, device, recipe.mesh.tp
        self.dp_group = dp_group
        self.loader: StepLoader | None = None
        self.last: dict = {}
        if not self.cfg.every:
            return
        self.loader = loader or build_loader(held_out_recipe(recipe), vocab_size, dp_rank, dp_size, dp_group)
        self.loader.hold_steps(self.cfg.batches)  # a corpus: the held-out part must hold every batch
        if recipe.data.source == "synthetic":  # its held-out samples: a range training never reaches
            self.loader.load_state_dict({"position": HELD_OUT_INDEX})
        self._start = self.loader.state_dict()

    def due(self, step: int) -> bool:
        return self.loader is not None and (step % self.cfg.every == 0 or step == self.steps)

    def __call__(self, forward: ForwardBackward) -> dict:  # or anything with its `evaluate(batches)`
        """Evaluate the model now; the metrics to log."""
        self.loader.load_state_dict(self._start)  # the same batches every time
        ce = torch.zeros((), device=self.device)
        tokens = torch.zeros((), device=self.device)
        for _ in range(self.cfg.batches):
            batches = self.loader.next_step()
            ce += forward.evaluate(batches)
            tokens += sum(float((b.labels != IGNORE_INDEX).sum()) for b in batches)
        # as the training loss: last stages hold their dp slice's sum, tp peers copies of it
        if dist.is_initialized():
            dist.all_reduce(ce)
            ce /= self.tp
        if self.dp_group is not None:  # every stage read its dp slice's batches
            dist.all_reduce(tokens, group=self.dp_group)
        loss = float(ce / tokens)
        self.last = {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 700.0))}
        return self.last

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
