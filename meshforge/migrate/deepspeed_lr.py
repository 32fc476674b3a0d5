"""DeepSpeed's lr schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR in
deepspeed/runtime/lr_schedules.py, 0.19) -> lr_scheduler fields that reproduce them exactly."""

from __future__ import annotations

from meshforge.core.errors import UsageError
from meshforge.migrate.report import Imported
from meshforge.migrate.source import MISSING, Keys


def scheduler(k: Keys, out: Imported) -> None:
    """DeepSpeed's three warmup schedules, exactly (lr_scheduler.convention = deepspeed)."""
    kind = k.take("scheduler.type")
    out.set("lr_scheduler.warmup_steps", 0)
    if kind is MISSING:
        out.set("lr_scheduler.decay", "constant")  # DeepSpeed without a scheduler: the optimizer's lr
        return
    p = lambda key, default: k.take(f"scheduler.params.{key}", default)  # noqa: E731
    if kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        out.refuse("scheduler.type", kind, "meshforge's schedules: warmup then constant, linear or cosine")
        k.take("scheduler")
        return
    out.set("lr_scheduler.convention", "deepspeed")
    if (shape := p("warmup_type", "log")) not in ("log", "linear"):
        out.refuse(
            "scheduler.params.warmup_type",
            shape,
            "DeepSpeed warns and warms up by 'log' for an unknown type: write 'log' or 'linear'",
        )
    out.set("lr_scheduler.warmup_shape", "linear" if shape == "linear" else "log")
    steps = p("warmup_num_steps", 1000)
    if not isinstance(steps, int) or steps <= 0:
        raise UsageError(f"DeepSpeed: warmup_num_steps must be a positive integer, got {steps!r}")
    out.set("lr_scheduler.warmup_steps", steps)
    if (it := p("last_batch_iteration", -1)) != -1:
        out.refuse(
            "scheduler.params.last_batch_iteration",
            it,
            "a schedule started mid-way: resume a meshforge checkpoint",
        )
    if kind == "WarmupCosineLR":  # ratios of the optimizer's lr
        out.set("lr_scheduler.decay", "cosine")
        out.set("lr_scheduler.warmup_start", _number(out, "warmup_min_ratio", p("warmup_min_ratio", 0.0)))
        out.set("lr_scheduler.min_lr_ratio", _number(out, "cos_min_ratio", p("cos_min_ratio", 0.0001)))
    else:  # absolute lrs; WarmupLR's peak defaults to the optimizer's lr, WarmupDecayLR's to 0.001
        peak = p("warmup_max_lr", None if kind == "WarmupLR" else 0.001)
        if peak is not None:
            out.set("optimizer.lr", _number(out, "warmup_max_lr", peak))
        low = _number(out, "warmup_min_lr", p("warmup_min_lr", 0.0))
        peak = out.values.get("optimizer.lr")
        if low and peak is None:
            out.refuse(
                "scheduler.params.warmup_min_lr",
                low,
                "without warmup_max_lr or an optimizer lr in the file the peak is the script's: write it",
            )
        start = low / peak if low and peak else 0.0
        out.set("lr_scheduler.decay", "constant" if kind == "WarmupLR" else "linear")
        out.set("lr_scheduler.warmup_start", start)
        out.set("lr_scheduler.min_lr_ratio", start)  # WarmupDecayLR decays back to warmup_min_lr
    if kind != "WarmupLR":
        total = p("total_num_steps", MISSING)
        if total is MISSING:
            raise UsageError(f"scheduler {kind} needs params.total_num_steps (DeepSpeed requires it too)")
        out.set("train.steps", int(total))
    out.notes.append(
        f"{kind}: DeepSpeed's schedule exactly (lr_scheduler.convention = 'deepspeed', {shape} warmup): "
        "step s runs at its iteration s-1, as its engine steps the schedule after each optimizer step"
    )


def _number(out: Imported, key: str, value) -> float:
    """A scheduler parameter as one number (DeepSpeed also takes one per parameter group)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        out.refuse(f"scheduler.params.{key}", value, "one value per parameter group: meshforge has one lr")
        return 0.0
    return float(value)
