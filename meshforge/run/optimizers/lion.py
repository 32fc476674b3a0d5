"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2).
torch has none; the update, with g the gradient and m the one state:
    c = beta1 m + (1 - beta1) g;  theta -= lr (sign(c) + wd theta);  m = beta2 m + (1 - beta2) g"""

from __future__ import annotations

import torch

from meshforge.configs.schema import OptimizerConfig


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float, betas: tuple[float, float], weight_decay: float) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m = state["exp_avg"]
                update = m.lerp(p.grad, 1 - beta1).sign_()  # beta1 m + (1 - beta1) g
                p.mul_(1 - lr * wd)
                p.add_(update, alpha=-lr)
                m.lerp_(p.grad, 1 - beta2)
        return loss


OPTIMIZER = Lion


def build(
    groups: list[dict], names: dict[int, str], cfg: OptimizerConfig, implementation=None, quiet: bool = False
) -> torch.optim.Optimizer:
    return Lion(groups, lr=cfg.lr, betas=cfg.lion.betas, weight_decay=cfg.weight_decay)


def steady_state(group: dict, p: torch.Tensor) -> dict:
    """Lion's one state: the momentum."""
    return {"exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format)}
