"""The MoE pieces on one process: grouped and looped experts agree, the balancing loss is
transformers' on one sequence and per sequence otherwise, its gradient enters through the block
output, ep's regrouping of received tokens, ep in the topology, and the recipe rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support import RECIPES

from meshforge.configs import ACPolicy, RecipeError
from meshforge.core.topology import ParallelDims
from meshforge.models import get_model_spec
from meshforge.models.common.moe import MoE, update_expert_bias
from meshforge.parallelisms.ep import check_ep, expert_major_order
from meshforge.recipe import load_recipe

SPEC = get_model_spec("qwen3_moe")
ARGS = SPEC.flavors["debug"]


def _moe(seed: int = 0, **changes) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(dataclasses.replace(ARGS, **changes))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe.train()


def test_grouped_and_looped_experts_give_the_same_outputs_and_gradients():
    x = torch.randn(3, 20, ARGS.dim)
    grads = {}
    for grouped in (True, False):
        moe = _moe(grouped_mm=grouped)
        out = moe(x)
        out.square().sum().backward()
        grads[grouped] = (out.detach(), [p.grad for p in moe.parameters()])
    torch.testing.assert_close(grads[True][0], grads[False][0], rtol=0, atol=1e-6)
    for a, b in zip(grads[True][1], grads[False][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(a.abs().max()))  # fp32 sums reordered


def test_the_aux_loss_is_transformers_on_one_sequence_and_per_sequence_on_a_batch():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    moe = _moe()
    x = torch.randn(2, 24, ARGS.dim)
    moe(x)
    batch_aux = float(moe.aux_sum)
    each = []
    for b in range(2):
        moe.reset_stats()
        moe(x[b : b + 1])
        each.append(float(moe.aux_sum))
        logits = moe.router.gate(x[b])
        theirs = load_balancing_loss_func((logits,), ARGS.num_experts, ARGS.num_experts_per_tok)
        assert each[-1] == pytest.approx(theirs.item(), rel=1e-6)
    assert batch_aux == pytest.approx(sum(each), rel=1e-6)  # summed per sequence, not pooled
    moe.reset_stats()
    theirs_pooled = load_balancing_loss_func(
        (moe.router.gate(x.flatten(0, 1)),), ARGS.num_experts, ARGS.num_experts_per_tok
    )
    assert 2 * theirs_pooled.item() != pytest.approx(batch_aux, rel=1e-4)  # what transformers pools


def test_the_aux_gradient_enters_through_the_output_with_its_weight():
    weight = 0.37
    x = torch.randn(2, 16, ARGS.dim)
    attached = _moe()
    attached.aux_grad_scale = weight
    (attached(x) * 0).sum().backward()  # the output's own gradient is zero: only the aux's is left
    explicit = _moe()
    explicit.aux_grad_scale = 0.0
    out = explicit(x)
    aux = explicit._aux_loss(*_routing(explicit, x))
    ((out * 0).sum() + weight * aux).backward()
    gate = attached.router.gate.weight.grad
    assert gate.abs().max() > 1e-3  # the router learns from the aux loss
    torch.testing.assert_close(gate, explicit.router.gate.weight.grad, rtol=1e-6, atol=1e-9)
    assert all(float(p.grad.abs().max()) == 0 for p in attached.experts.parameters())


def _routing(moe: MoE, x: torch.Tensor):
    _, experts, probs = moe.router(x.flatten(0, 1))
    return experts.view(*x.shape[:2], -1), probs.view(*x.shape[:2], -1)


def test_counts_are_kept_once_per_forward_not_again_in_a_recompute():
    from torch.utils.checkpoint import checkpoint

    moe = _moe()
    x = torch.randn(2, 8, ARGS.dim, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert float(moe.load.sum()) == 2 * 8 * ARGS.num_experts_per_tok
    assert moe.experts.rows == 2 * 8 * ARGS.num_experts_per_tok


def test_aux_free_balancing_evens_a_router_that_prefers_two_experts():
    """DeepSeek-V3's bias: a router whose logits favour experts 0 and 1 (+4 on a constant feature)
    overloads them; steps of `update_expert_bias` on the loads lower their bias, raise the others',
    and even the load out (sign steps of a fixed size: it then oscillates around balance)."""
    moe = _moe(load_balance="aux_free")
    with torch.no_grad():
        moe.router.gate.weight[:2, 0] += 4.0
    x = torch.randn(4, 32, ARGS.dim)
    x[..., 0] = 1.0
    imbalance = []
    for _ in range(100):
        moe.reset_stats()
        moe(x)
        imbalance.append(float(moe.load.max() / moe.load.mean()))
        update_expert_bias(moe, moe.load, rate=0.01)
    assert imbalance[0] > 2.5
    assert sum(imbalance[-10:]) / 10 < 0.7 * imbalance[0]
    assert moe.expert_bias[:2].max() < moe.expert_bias[2:].min()


def test_received_tokens_are_regrouped_expert_major():
    by_source = torch.tensor([[2, 0, 1], [1, 3, 0]])  # rows from rank 0 then rank 1, per local expert
    labels = [(r, e) for r in range(2) for e in range(3) for _ in range(int(by_source[r, e]))]
    order = expert_major_order(by_source)
    assert [labels[i] for i in order] == sorted(labels, key=lambda t: (t[1], t[0]))


def test_ep_borrows_from_dp_shard_x_cp_and_is_no_factor_of_the_world():
    dims = ParallelDims(dp_shard=4, tp=2, ep=2)
    assert dims.world_size == 8 and dims.label() == "dp4-ep2-tp2" and dims.degrees["ep"] == 2
    assert "ep=2" in dims.spelled() and "ep=" not in ParallelDims(dp_shard=4).spelled()  # only in use
    assert ParallelDims.from_degrees({"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1}).ep == 1
    assert check_ep(ParallelDims(dp_shard=2, cp=2, ep=4), ARGS, ACPolicy("full")) == []
    (problem,) = check_ep(
        ParallelDims(dp_shard=4, cp=2, ep=3), dataclasses.replace(ARGS, num_experts=12), ACPolicy("full")
    )
    assert problem.field == "mesh.ep" and "valid ep: 1, 2, 4" in problem.message  # gcd(8, 12) = 4
    dense, sparse = ParallelDims.all_of_world(8), ParallelDims.all_of_world(8, experts=12)
    assert all(d.ep == 1 for d in dense)
    assert len(sparse) == sum(len([e for e in (1, 2, 4) if d.fsdp_shard % e == 0]) for d in dense)


BASE = [str(RECIPES / "debug_cpu.toml"), "model.name=qwen3_moe", "mesh.pp=1"]


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        (["mesh.dp_shard=2", "mesh.tp=2", "mesh.ep=4"], "mesh.ep", "valid ep: 1, 2"),
        (["mesh.dp_shard=4", "mesh.tp=1", "mesh.ep=4", "model.num_experts=6"], "mesh.ep", "num_experts = 6"),
        (
            ["mesh.dp_shard=4", "mesh.tp=1", "mesh.ep=2", "model.mlp_only_layers=[0,1,2,3]"],
            "mesh.ep",
            "no sparse",
        ),
        (
            ["mesh.dp_shard=2", "mesh.tp=2", "model.router_aux_loss_coef=-0.1"],
            "model.router_aux_loss_coef",
            ">= 0",
        ),
        (
            [
                "mesh.dp_shard=2",
                "mesh.tp=2",
                "model.load_balance=aux_free",
                "model.router_aux_loss_coef=0.01",
            ],
            "model.router_aux_loss_coef",
            "not read",
        ),
        (
            ["mesh.dp_shard=2", "mesh.tp=2", "model.bias_update_rate=0.01"],
            "model.bias_update_rate",
            "not read",
        ),
        (
            ["mesh.dp_shard=2", "mesh.tp=2", "model.num_experts_per_tok=9"],
            "model.num_experts_per_tok",
            "top-k",
        ),
        (["mesh.dp_shard=2", "mesh.tp=2", "model.capacity_factor=1.25"], "model.capacity_factor", "dropless"),
        (["mesh.dp_shard=2", "mesh.tp=2", "model.load_balance=sinkhorn"], "model.load_balance", "aux_free"),
        (
            ["mesh.dp_shard=2", "mesh.tp=2", "mesh.ep=2", "activation_checkpoint.mode=op"],
            "activation_checkpoint.mode",
            "mesh.ep=1",
        ),
        (["mesh.dp_shard=2", "mesh.tp=2", "model.mlp_only_layers=[7]"], "model.mlp_only_layers", "0..3"),
        (["mesh.dp_shard=4", "mesh.tp=1", "mesh.ep=0"], "mesh.ep", "positive"),
    ],
)
def test_moe_recipes_that_would_change_the_math_are_refused(overrides, field, words):
    with pytest.raises(RecipeError) as e:
        load_recipe(BASE[0], [*BASE[1:], *overrides], world_size=4)
    problems = [p for p in e.value.problems if p.field == field]
    assert problems and words in str(problems[0]), e.value.problems


def test_ep_on_a_dense_model_and_moe_under_jax_are_refused():
    with pytest.raises(RecipeError, match="no sparse layer"):
        load_recipe(BASE[0], ["mesh.pp=1", "mesh.dp_shard=4", "mesh.tp=1", "mesh.ep=2"], world_size=4)
    with pytest.raises(RecipeError, match="torch-only"):
        load_recipe(BASE[0], [*BASE[1:], "backend=jax", "mesh.dp_shard=4", "mesh.tp=1"], world_size=4)


def test_a_resume_checks_the_selection_bias_only_of_a_model_with_experts():
    """A dense model resumes with nothing to check; a MoE trained aux-free is refused under aux_loss."""
    from meshforge.core.errors import IncompatibleWeights
    from meshforge.run.train.moe_stats import MoEStats

    dense_args = get_model_spec("llama3").flavors["debug"]
    MoEStats([get_model_spec("llama3").build(dense_args)], dense_args, 32, 16).check_restored("ckpt")
    model = SPEC.build(ARGS)
    stats = MoEStats([model], ARGS, 32, 16)
    stats.check_restored("ckpt")  # a zero bias routes as none
    model.layers["2"].moe.expert_bias[3] = 0.1
    with pytest.raises(IncompatibleWeights, match="layers.2.moe.expert_bias"):
        stats.check_restored("ckpt")
