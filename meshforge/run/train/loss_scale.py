"""Dynamic loss scaling for fp16 training, on any mesh.

fp16 gradients underflow below ~6e-8, so the loss is multiplied by a scale S before backward
and the gradients divided by S after it. Too large an S overflows them to inf: the step is
then skipped (no update, no scheduler step) and S multiplied by `backoff_factor`; after
`growth_interval` clean steps S grows by `growth_factor` (torch's GradScaler rule).

Why not torch's ShardedGradScaler: it checks for infs per optimizer with an all-reduce each,
while the trainer already reduces one number over every rank of every mesh dimension and
pipeline stage, the gradient norm (run/train/step.py: clip_grad_norm). An inf or nan in any
gradient shard on any rank makes that norm non-finite on all of them, so the skip decision
is the same everywhere with no extra collective; unscaling folds into the clipping multiply.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshforge.configs.schema import LossScaleConfig


@dataclass
class LossScaler:
    """The loss scale and its schedule; `scale` is 1.0 (and nothing changes) when disabled."""

    cfg: LossScaleConfig
    enabled: bool
    scale: float = 1.0
    clean_steps: int = 0  # steps since the last overflow or growth
    overflows: int = 0  # skipped steps, over the whole run (resumes included)

    def __post_init__(self) -> None:
        if self.enabled:
            self.scale = float(self.cfg.initial)

    def at_floor(self) -> bool:
        """An overflow here cannot be cured by backing off: it is a bad step."""
        return not self.cfg.dynamic or self.scale * self.cfg.backoff_factor < self.cfg.min_scale

    def judge(self, *, loss_finite: bool, grads_finite: bool) -> str:
        """The step's outcome, with the scale updated: "ok" (apply the update), "overflow"
        (skip it; the scale backed off) or "bad" (a non-finite loss, which no scale causes,
        or an overflow at the floor: it spends train.max_bad_steps)."""
        if not loss_finite:
            return "bad"
        cured = self.enabled and not grads_finite and not self.at_floor()
        self.update(grads_finite)
        return "ok" if grads_finite else "overflow" if cured else "bad"

    def metrics(self, scale: float) -> dict:
        """What the loggers get (fp16 only): the scale a step ran with, overflows so far."""
        return {"loss_scale": scale, "overflow_steps": self.overflows} if self.enabled else {}

    def update(self, grads_finite: bool) -> None:
        """After a step's gradients are known (on every rank alike): back off on overflow,
        grow after growth_interval clean steps."""
        if not self.enabled:
            return
        if not grads_finite:
            self.overflows += 1
            self.clean_steps = 0
            if not self.at_floor():
                self.scale *= self.cfg.backoff_factor
            return
        self.clean_steps += 1
        if self.cfg.dynamic and self.clean_steps >= self.cfg.growth_interval:
            self.scale *= self.cfg.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps, self.overflows = int(state["clean_steps"]), int(state["overflows"])


def overflow_note(step: int, scaler_metrics: dict) -> str:
    """The terminal's line for a step skipped on an fp16 overflow (`scaler_metrics`: the step's
    `LossScaler.metrics`)."""
    return (
        f"step {step}: fp16 gradients overflowed at loss scale {scaler_metrics['loss_scale']:g}; update "
        f"skipped and the scale backed off ({scaler_metrics['overflow_steps']} overflow steps so far)"
    )
