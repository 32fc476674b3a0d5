"""Muon (Keller Jordan 2024; torch.optim.Muon's update exactly): momentum, orthogonalised by a
quintic Newton-Schulz iteration, on the hidden matrices; AdamW (torch's, through its functional
form) on the embeddings, norms, output, router and biases, in the same optimizer so a checkpoint
holds both. A sharded matrix (a DTensor under FSDP2, TP, EP) is gathered whole, orthogonalised
once on every rank alike, and each rank keeps its own shard of the update."""

from __future__ import annotations

import logging
import math

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.adam import adam

from meshforge.configs.schema import OptimizerConfig
from meshforge.parallelisms.fsdp import DTYPES

from . import adamw
from .adamw import resolved_implementation
from .kinds import param_kind

log = logging.getLogger(__name__)

# the kinds of parameter (kinds.py) Muon leaves to AdamW, and why (Muon is for hidden matrices)
TO_ADAMW = {
    "embedding": "an embedding is a lookup table, not a linear map",
    "output": "the output projection maps to the vocabulary; Muon's authors keep it on AdamW",
    "router": "a router's gate is kept on AdamW, as the embeddings and output are",
    "norm": "a norm's scale is a vector",
    "bias": "a bias is a vector",
}


def adamw_reason(name: str, p: torch.Tensor) -> str | None:
    """Why Muon leaves the parameter `name` to AdamW (None: Muon orthogonalises it). 3-D
    parameters are stacks of matrices (grouped experts), orthogonalised one matrix at a time."""
    if why := TO_ADAMW.get(param_kind(name)):
        return why
    if p.ndim not in (2, 3):
        return f"a {p.ndim}-D tensor is not a matrix (nor a stack of expert matrices)"
    return None


def newton_schulz(g: torch.Tensor, coefficients, steps: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """The orthogonalised `g` (2-D), as torch.optim.Muon's _zeropower_via_newtonschulz computes it
    in bfloat16; `dtype` float32 runs the same iteration unrounded."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def orthogonalised(update: torch.Tensor, group: dict) -> torch.Tensor:
    """`update` orthogonalised; a DTensor is gathered whole and each rank keeps its own shard."""
    full = update.full_tensor() if isinstance(update, DTensor) else update
    args = (group["ns_coefficients"], group["ns_steps"], group["eps"], DTYPES[group["ns_dtype"]])
    if full.ndim == 3:  # grouped experts: one matrix each
        ortho = torch.stack([newton_schulz(m, *args) for m in full])
    else:
        ortho = newton_schulz(full, *args)
    if isinstance(update, DTensor):  # every rank holds the same `ortho`: slice, no communication
        return distribute_tensor(ortho, update.device_mesh, update.placements, src_data_rank=None)
    return ortho


def adjusted_lr(lr: float, rule: str, shape: torch.Size) -> float:
    """torch.optim.Muon's _adjust_lr for a matrix of `shape` (rows, columns)."""
    rows, cols = shape
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1, rows / cols))


class Muon(torch.optim.Optimizer):
    """Groups with use_muon = True take Muon's step, the others AdamW's."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (self.muon_step if group["use_muon"] else self.adamw_step)(group)
        return loss

    def muon_step(self, group: dict) -> None:
        lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
            ortho = orthogonalised(update, group)
            p.mul_(1 - lr * wd)
            p.add_(ortho, alpha=-adjusted_lr(lr, group["adjust_lr"], p.shape[-2:]))

    def adamw_step(self, group: dict) -> None:
        fused = group["implementation"] == "fused"
        params, grads, avgs, sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(adamw.initial_state(p, fused))
            if fused and state["step"].device != p.device:  # a loaded step stays on the host
                state["step"] = state["step"].to(p.device, torch.float32)
            params.append(p)
            grads.append(p.grad)
            avgs.append(state["exp_avg"])
            sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adam(
            params, grads, avgs, sqs, [], steps,
            foreach=group["implementation"] == "foreach",
            fused=fused,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )  # fmt: skip


OPTIMIZER = Muon


def log_routing(groups: list[dict], names: dict[int, str]) -> None:
    """One line: how many tensors Muon orthogonalises, and which go to AdamW, by reason."""
    by_reason: dict[str, list[str]] = {}
    for p in (p for g in groups if not g["use_muon"] for p in g["params"]):
        by_reason.setdefault(adamw_reason(names[id(p)], p), []).append(names[id(p)])
    n_muon = sum(len(g["params"]) for g in groups if g["use_muon"])
    to_adamw = "; ".join(f"{len(ns)} like {ns[0]} ({why})" for why, ns in by_reason.items())
    log.info("optimizer.name = muon: %d matrices orthogonalised; to AdamW: %s", n_muon, to_adamw or "none")


def build(
    groups: list[dict], names: dict[int, str], cfg: OptimizerConfig, implementation=None, quiet: bool = False
) -> Muon:
    """Each group split in two: its hidden matrices (Muon) and the rest (AdamW at muon.adamw_lr
    times the group's lr multiplier), the split logged in one line (log_routing)."""
    m = cfg.muon
    split = []
    for group in groups:
        matrices = [p for p in group["params"] if adamw_reason(names[id(p)], p) is None]
        others = [p for p in group["params"] if adamw_reason(names[id(p)], p) is not None]
        scale = group.get("lr", cfg.lr) / cfg.lr  # a group's lr multiplier applies to both halves
        if matrices:
            split.append({**group, "params": matrices, "use_muon": True})
        if others:
            impl, why = resolved_implementation(others, implementation or cfg.implementation)
            if why and not quiet:
                log.warning("optimizer.implementation = fused: %s; Muon's AdamW part uses %s", why, impl)
            adamw_lr = (m.adamw_lr or cfg.lr) * scale
            split.append(
                {**group, "params": others, "use_muon": False, "lr": adamw_lr, "implementation": impl}
            )
    if not quiet:
        log_routing(split, names)
    defaults = dict(
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=m.momentum,
        nesterov=m.nesterov,
        ns_coefficients=tuple(m.ns_coefficients),
        ns_steps=m.ns_steps,
        eps=m.eps,
        ns_dtype=m.ns_dtype,
        adjust_lr=m.adjust_lr,
        betas=tuple(cfg.betas),
        implementation=implementation or cfg.implementation,
    )
    for g in split:
        if not g["use_muon"]:
            g["eps"] = cfg.eps  # AdamW's epsilon, not Newton-Schulz's norm floor
    return Muon(split, defaults)


def steady_state(group: dict, p: torch.Tensor) -> dict:
    """A matrix's momentum buffer; AdamW's state for the rest."""
    if group["use_muon"]:
        return {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)}
    return adamw.initial_state(p, fused=group["implementation"] == "fused")
