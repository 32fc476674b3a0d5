"""TorchTitan 0.2's mixture-of-experts keys -> recipe values: expert parallel and its expert tensor
parallel (torchtitan/distributed/parallel_dims.py at v0.2.0), the MoE debug routing, and how its
Qwen3 MoE trains where that is not a key (load balancing, the experts' dtype: models/moe at v0.2.0).

TorchTitan's ep, like meshforge's, borrows its ranks from dp_shard x cp (the inner ones), with
etp = tp; with etp = 1 it borrows the tp ranks too. meshforge's MoE is not split over tp (every tp
rank computes it whole), so both etp settings import with the same math and a note.
"""

from __future__ import annotations

from meshforge.core.errors import UsageError
from meshforge.migrate.report import Imported
from meshforge.migrate.source import Keys

EP = "parallelism.expert_parallel_degree"
ETP = "parallelism.expert_tensor_parallel_degree"


def expert_parallel(k: Keys, out: Imported, moe: bool | None, dp_shard: int, cp: int, tp: int) -> None:
    """mesh.ep from expert_parallel_degree and expert_tensor_parallel_degree (`moe`: the imported
    model has experts; None: the model was not imported). TorchTitan's own rules are checked first:
    it refuses the job otherwise, whatever the model."""
    ep, etp = k.take(EP, 1), k.take(ETP, 1)
    if ep == 1:
        if etp != 1:
            out.skip(ETP, etp, "no effect with expert_parallel_degree = 1")
        return
    if etp not in (1, tp):
        raise UsageError(
            f"{ETP} = {etp} with tensor_parallel_degree = {tp}: TorchTitan supports only ETP=TP or ETP=1"
        )
    borrowed, width = (dp_shard * cp, cp) if etp == tp else (dp_shard * cp * tp, cp * tp)
    if ep % width or borrowed % ep:
        over = "dp_shard x cp" if etp == tp else "dp_shard x cp x tp"
        raise UsageError(
            f"{EP} = {ep} (etp = {etp}): TorchTitan's ep must be a multiple of "
            f"{'cp' if etp == tp else 'cp x tp'} = {width} and divide {over} = {borrowed}"
        )
    if not moe:
        why = (
            "no effect: the model has no experts (TorchTitan builds its ep mesh and ignores it)"
            if moe is False
            else "expert parallel of a model not imported (model.flavor)"
        )
        out.skip(EP, ep, why)
        if etp != 1:
            out.skip(ETP, etp, why)
        return
    if tp == 1:
        out.set("mesh.ep", ep)
    elif etp == tp:
        out.set("mesh.ep", ep)
        out.notes.append(
            f"{ETP} = {etp} (= tp): TorchTitan splits every expert over the tp ranks, meshforge computes "
            f"them whole on each tp rank: mesh.ep = {ep} over dp_shard x cp as there, the same math, "
            f"{tp} x the expert weights and expert compute per rank"
        )
    else:  # etp = 1: TorchTitan's ep spans the tp ranks, meshforge's borrows only dp_shard x cp
        out.set("mesh.ep", ep // tp)
        out.notes.append(
            f"{EP} = {ep} with etp = 1 spans TorchTitan's tp ranks; meshforge's ep borrows only dp_shard x "
            f"cp and runs the MoE whole on every tp rank: mesh.ep = {ep} / tp {tp} = {ep // tp}, the same "
            f"math, {tp} x the experts per rank"
        )


def moe_details(k: Keys, out: Imported, moe: bool | None) -> None:
    """training.debug_moe_force_load_balance (TorchTitan's round-robin routing: refused with experts,
    inert without) and the experts' dtype in fp32 training."""
    if (force := k.take("training.debug_moe_force_load_balance", False)) is not False:
        if moe:
            out.refuse(
                "training.debug_moe_force_load_balance",
                force,
                "round-robin expert assignment (a TorchTitan debug mode): meshforge routes by the router",
            )
        else:
            why = (
                "no effect without experts"
                if moe is False
                else "routing of a model not imported (model.flavor)"
            )
            out.skip("training.debug_moe_force_load_balance", force, why)
    if moe and out.values.get("fsdp.param_dtype") == "float32":
        out.notes.append(
            "TorchTitan's grouped experts multiply in bfloat16 even when training in float32; meshforge's "
            "in the training dtype (float32 here)"
        )
