"""A step's forwards and backwards: microbatches through the model, or through the
pipeline schedule, with the loss normalised by the global token count. Under context
parallelism each rank takes its part of every sequence here (inputs and labels alike)."""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor

from meshforge.run.train.step import StepPolicy, cross_entropy_sum


class Phase(enum.Enum):
    """What a step is doing, for an out-of-memory report (the value is what it says)."""

    SETUP = "setup"
    FORWARD = "forward"
    BACKWARD = "backward"
    PIPELINE = "forward/backward (pipeline schedule)"
    EVALUATION = "evaluation"
    PIPELINE_EVALUATION = "evaluation (pipeline schedule)"
    OPTIMIZER = "optimizer"


class PipelineLoss:
    """The pipeline schedule's loss_fn: a microbatch's CE sum, scaled, kept for the step's total.
    Built before the schedule (which takes it) and the ForwardBackward (which reads it)."""

    def __init__(self):
        self.ce_sums: list[torch.Tensor] = []
        self.scale: torch.Tensor | float = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ce = cross_entropy_sum(logits, labels)
        self.ce_sums.append(ce.detach())
        return ce * self.scale


class ForwardBackward:
    """Runs this rank's part of a step's forward and backward passes and sums the token
    cross-entropies it computed (only a last pipeline stage computes any). `phase` says what
    it is doing, for an out-of-memory report."""

    def __init__(
        self,
        *,
        parts: list[nn.Module],
        policy: StepPolicy,
        device: torch.device,
        schedule: _PipelineSchedule | None = None,
        loss: PipelineLoss | None = None,
        has_first: bool = True,
        has_last: bool = True,
        microbatches: int = 1,
        shard: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
    ):
        """`schedule` (pipeline parallel) runs the parts, calling `loss` (the schedule's loss_fn)
        on a last stage; `has_first`/`has_last`: this rank holds the first/last stage; `shard`: this
        rank's part of a (B, S) batch tensor (`parallelisms.cp.sequence_shard`)."""
        if (schedule is None) != (loss is None):
            raise ValueError("a pipeline schedule and its PipelineLoss come together")
        self.parts, self.schedule, self.policy, self.device = parts, schedule, policy, device
        self.has_first, self.has_last, self.microbatches = has_first, has_last, microbatches
        self.shard = shard
        self.phase = Phase.SETUP
        self._loss = loss or PipelineLoss()  # without a schedule: the same bookkeeping

    def __call__(self, batches: list, loss_scale: torch.Tensor) -> torch.Tensor:
        """Forward and backward every microbatch with gradients of (CE sum x loss_scale);
        returns this rank's CE sum over them."""
        return self._run(batches, loss_scale, train=True)

    @torch.no_grad()
    def evaluate(self, batches: list) -> torch.Tensor:
        """This rank's CE sum over `batches`, forward only: through the schedule's `eval()` under
        pipeline parallelism (only a last stage computes any), else the whole model."""
        return self._run(batches, 1.0, train=False)

    def _run(self, batches: list, loss_scale: torch.Tensor | float, *, train: bool) -> torch.Tensor:
        self._loss.scale, self._loss.ce_sums = loss_scale, []
        for b in batches:
            with self.policy.context(self.device.type):
                self._one(
                    self.shard(b.inputs).to(self.device), self.shard(b.labels).to(self.device), train=train
                )
        total = torch.zeros((), device=self.device)
        for ce in self._loss.ce_sums:
            total += ce.full_tensor() if isinstance(ce, DTensor) else ce
        return total

    def _one(self, inputs: torch.Tensor, labels: torch.Tensor, *, train: bool) -> None:
        ce_sums = self._loss.ce_sums
        if self.schedule is not None:
            self.phase = Phase.PIPELINE if train else Phase.PIPELINE_EVALUATION
            kwargs = {"target": labels, "losses": []} if self.has_last else {}
            args = (inputs,) if self.has_first else ()
            before = len(ce_sums)
            (self.schedule.step if train else self.schedule.eval)(*args, **kwargs)
            # the first step's shape inference also calls the loss on dummy data: keep the real ones
            real = ce_sums[before:][-self.microbatches :] if self.has_last else []
            ce_sums[before:] = real
            return
        self.phase = Phase.FORWARD if train else Phase.EVALUATION
        ce = cross_entropy_sum(self.parts[0](inputs), labels)
        if train:
            self.phase = Phase.BACKWARD
            (ce * self._loss.scale).backward()
        ce_sums.append(ce.detach())
