"""What a step does for its mixture-of-experts layers: weigh the load-balancing loss, gather every
layer's per-expert load, aux-loss sum and computed rows from every rank, move aux-free balancing's
bias, and turn them into the metrics a MoE user reads (`moe/*`).

Each MoE keeps its own step statistics (models/common/moe.py); a rank holds its pipeline stages' layers and
routes its own tokens (its dp, cp and ep part), tp ranks route the same ones. So the statistics,
laid out (n_layers, E + 2) with zeros where a rank has no such layer, are summed over the world and
divided by tp: the global load of every layer, on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from meshforge.core.errors import IncompatibleWeights
from meshforge.models.common.moe import Balancing, MoE, has_experts, moe_layers, update_expert_bias


class MoEStats:
    """The MoE layers of this rank's model parts, and the model's shape of them."""

    def __init__(self, parts: list[nn.Module], args, seq_len: int, global_batch: int):
        self.layers: dict[int, MoE] = {i: m for part in parts for i, m in moe_layers(part).items()}
        self.args, self.n_layers = args, args.n_layers
        self.n_moe = args.n_moe_layers if has_experts(args) else 0
        self.sequences, self.seq_len = global_batch, seq_len

    @property
    def enabled(self) -> bool:
        return self.n_moe > 0

    def begin(self, loss_scale: float) -> None:
        """Before the step's forwards: fresh statistics, and the aux loss's weight in the loss
        (its coefficient over the sequences and MoE layers it is averaged over, times the fp16
        loss scale; 0 under aux-free balancing, which has no loss term)."""
        a = self.args
        coef = a.router_aux_loss_coef if Balancing(a.load_balance).adds_loss else 0.0
        weight = coef * loss_scale / (self.sequences * self.n_moe)
        for moe in self.layers.values():
            moe.reset_stats()
            moe.aux_grad_scale = weight

    def check_restored(self, source: str) -> None:
        """A checkpoint whose selection bias was trained (aux-free balancing) cannot resume under the
        aux loss, which would route without it: refused, not dropped."""
        if not self.enabled or Balancing(self.args.load_balance).routes_with_bias:
            return
        for i, moe in self.layers.items():
            if bool(moe.expert_bias.any()):
                raise IncompatibleWeights(
                    f"{source}: layers.{i}.moe.expert_bias holds aux-free balancing's trained bias, which "
                    "model.load_balance = 'aux_loss' would route without: set model.load_balance=aux_free"
                )

    def local(self, device: torch.device) -> torch.Tensor:
        """This rank's statistics, (n_layers, E + 2): loads, aux-loss sum, rows its experts computed."""
        e = self.args.num_experts
        stats = torch.zeros(self.n_layers, e + 2, device=device)
        for i, moe in self.layers.items():
            if moe.load is not None:
                stats[i, :e] = moe.load
                stats[i, e] = moe.aux_sum
            stats[i, e + 1] = float(moe.experts.rows)
        return stats

    def update_bias(self, stats: torch.Tensor) -> None:
        """Aux-free balancing: every layer's selection bias moves by the global loads."""
        if not Balancing(self.args.load_balance).routes_with_bias:
            return
        for i, moe in self.layers.items():
            update_expert_bias(moe, stats[i, : self.args.num_experts], self.args.bias_update_rate)

    def metrics(self, stats: torch.Tensor) -> dict[str, float]:
        """The global statistics (summed over ranks, / tp) as metrics: per layer the max and mean
        tokens per expert and their ratio (1 = balanced), the model's worst ratio, the aux loss
        (averaged over sequences and MoE layers, without its coefficient), and the routed copies no
        expert computed (dropless: 0, counted, not assumed)."""
        e, k = self.args.num_experts, self.args.num_experts_per_tok
        stats = stats.double().cpu()
        out: dict[str, float] = {}
        worst = 0.0
        moe_ids = [i for i in range(self.n_layers) if stats[i, :e].sum() > 0]
        for i in moe_ids:
            load = stats[i, :e]
            peak, mean = float(load.max()), float(load.mean())
            out[f"moe/layer{i}/max_load"], out[f"moe/layer{i}/mean_load"] = peak, mean
            out[f"moe/layer{i}/imbalance"] = peak / mean
            worst = max(worst, peak / mean)
        routed = self.n_moe * self.sequences * self.seq_len * k
        out["moe/imbalance"] = worst
        out["moe/aux_loss"] = float(stats[:, e].sum()) / (self.sequences * self.n_moe)
        out["moe/tokens_dropped"] = routed - float(stats[:, e + 1].sum())
        return out
