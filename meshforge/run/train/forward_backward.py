"""A step's forwards and backwards: microbatches through the model, or through the
pipeline schedule, with the loss normalised by the global token count."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor

from meshforge.run.train.step import StepPolicy, cross_entropy_sum


class ForwardBackward:
    """Runs this rank's part of a step's forward and backward passes and sums the token
    cross-entropies it computed (only a last pipeline stage computes any). `phase` says what
    it is doing, for an out-of-memory report."""

    def __init__(
        self,
        parts: list[nn.Module],
        schedule: _PipelineSchedule | None,
        has_first: bool,
        has_last: bool,
        microbatches: int,
        policy: StepPolicy,
        device: torch.device,
    ):
        self.parts, self.schedule, self.policy, self.device = parts, schedule, policy, device
        self.has_first, self.has_last, self.microbatches = has_first, has_last, microbatches
        self.phase = "setup"
        self._ce_sums: list[torch.Tensor] = []
        self._scale: torch.Tensor | float = 1.0

    def pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The schedule's loss_fn: a microbatch's CE sum, scaled, kept for the step's total."""
        ce = cross_entropy_sum(logits, labels)
        self._ce_sums.append(ce.detach())
        return ce * self._scale

    def __call__(self, batches: list, loss_scale: torch.Tensor) -> torch.Tensor:
        """Forward and backward every microbatch with gradients of (CE sum x loss_scale);
        returns this rank's CE sum over them."""
        return self._run(batches, loss_scale, train=True)

    @torch.no_grad()
    def evaluate(self, batches: list) -> torch.Tensor:
        """This rank's CE sum over `batches`, forward only: through the schedule's `eval()` under
        pipeline parallelism (only a last stage computes any), else the whole model."""
        return self._run(batches, 1.0, train=False)

    def _run(self, batches: list, loss_scale: torch.Tensor | float, train: bool) -> torch.Tensor:
        self._scale, self._ce_sums = loss_scale, []
        for b in batches:
            with self.policy.context(self.device.type):
                self._one(b.inputs.to(self.device), b.labels.to(self.device), train)
        total = torch.zeros((), device=self.device)
        for ce in self._ce_sums:
            total += ce.full_tensor() if isinstance(ce, DTensor) else ce
        return total

    def _one(self, inputs: torch.Tensor, labels: torch.Tensor, train: bool) -> None:
        if self.schedule is not None:
            self.phase = f"{'forward/backward' if train else 'evaluation'} (pipeline schedule)"
            kwargs = {"target": labels, "losses": []} if self.has_last else {}
            args = (inputs,) if self.has_first else ()
            before = len(self._ce_sums)
            (self.schedule.step if train else self.schedule.eval)(*args, **kwargs)
            # the first step's shape inference also calls the loss on dummy data: keep the real ones
            real = self._ce_sums[before:][-self.microbatches :] if self.has_last else []
            self._ce_sums[before:] = real
            return
        self.phase = "forward" if train else "evaluation"
        ce = cross_entropy_sum(self.parts[0](inputs), labels)
        if train:
            self.phase = "backward"
            (ce * self._scale).backward()
        self._ce_sums.append(ce.detach())
