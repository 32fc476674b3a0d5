"""A new family is its folder and one registry line: tests/models/toy_family/ (model, TP plan, JAX
twin, weight adapter) registered with `register(SPEC)`, nothing else edited. It is planned,
trained, saved, exported to HF (safetensors + config.json) and read back, and exported to JAX
where its twin computes the torch model's logits."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file
from support import QUICK, RECIPES, read_metrics

from meshforge.convert import export_checkpoint, import_weights
from meshforge.models import MODELS, count_params, family_of_hf, register
from meshforge.recipe import load_recipe
from meshforge.run.rank.plan import make_plan
from meshforge.run.train.trainer import Trainer

ONE_RANK = ["mesh.dp_replicate=1", "mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1"]
TOY = ["model.name=toy", "model.flavor=debug", "train.steps=10", "checkpoint.enabled=true"]
LEARN = ["optimizer.lr=1e-2", "lr_scheduler.warmup_steps=2"]  # after QUICK: it visibly learns in 10 steps


@pytest.fixture(scope="module")
def toy():
    from toy_family import SPEC

    register(SPEC)  # the one registry line a family needs
    yield SPEC
    del MODELS[SPEC.name]


@pytest.fixture(scope="module")
def trained(toy, tmp_path_factory):
    """The toy recipe trained for 10 steps on one process, with its last checkpoint."""
    out = tmp_path_factory.mktemp("toy")
    recipe = load_recipe(RECIPES / "debug_cpu.toml", [*ONE_RANK, *QUICK, *TOY, *LEARN, f"output_dir={out}"])
    trainer = Trainer(recipe)
    trainer.run()
    state = {k: v.detach().clone() for k, v in trainer.pmodel.parts[0].state_dict().items()}
    [checkpoint] = sorted((out / recipe.run_name / "checkpoints").glob("step-*"))
    return recipe, out / recipe.run_name, checkpoint, state


def test_the_planner_sizes_the_toy_from_its_own_spec(toy):
    recipe = load_recipe(RECIPES / "debug_cpu.toml", [*ONE_RANK, *TOY])
    plan = make_plan(recipe)
    assert plan.args == toy.flavors["debug"]
    # embedding and output 2 x 256 x 48; per block q, o 48 x 64, k, v 48 x 32, FFN 3 x 48 x 80,
    # two norms of 48; the final norm
    by_hand = 2 * 256 * 48 + 2 * (2 * 48 * 64 + 2 * 48 * 32 + 3 * 48 * 80 + 2 * 48) + 48
    assert plan.n_params == count_params(toy.build(toy.flavors["debug"])) == by_hand == 66_288
    assert plan.state_bytes_per_rank == 16 * plan.n_params  # fp32 params, grads, AdamW's two moments


def test_the_toy_trains(trained):
    _, run_dir, checkpoint, _ = trained
    losses = [row["loss"] for row in read_metrics(run_dir)]
    assert len(losses) == 10 and 5.0 < losses[0] < 6.5  # about log(256): it starts knowing nothing
    assert losses[-1] < losses[0] - 1.0  # 5.95 -> 4.30 when written
    assert checkpoint.name == "step-00000010"


def test_the_toy_exports_to_hf_and_reads_back(trained, tmp_path):
    _, _, checkpoint, state = trained
    out = export_checkpoint(checkpoint, tmp_path / "hf", to="hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "toy_decoder" and config["head_dim"] == 16
    hf = load_file(str(out / "model.safetensors"))
    assert torch.equal(hf["model.layers.1.self_attn.k_proj.weight"], state["layers.1.attention.wk.weight"])
    assert len(hf) == len(state) == 2 + 2 * 9 + 1

    assert family_of_hf(out) == "toy"
    model = MODELS["toy"].build(MODELS["toy"].adapter.read_hf_args(out))
    import_weights(model, out, "hf")
    assert all(torch.equal(t, state[k]) for k, t in model.state_dict().items() if k in state)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_the_hf_export_is_the_hf_layout_mistral_computes(trained, tmp_path):
    """The toy is Mistral's shape: transformers' MistralForCausalLM, given the exported config and
    tensors, computes the torch model's logits (rows in HF's order, names HF's)."""
    import transformers

    _, _, checkpoint, state = trained
    out = export_checkpoint(checkpoint, tmp_path / "hf", to="hf")
    config = json.loads((out / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None)
    theirs = transformers.MistralForCausalLM(transformers.MistralConfig(**config)).eval()
    theirs.load_state_dict(load_file(str(out / "model.safetensors")))
    ours = MODELS["toy"].build(MODELS["toy"].flavors["debug"])
    ours.load_state_dict(state, strict=False)
    ours.init_buffers()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs the jax extra")
def test_the_toy_exports_to_jax_and_its_twin_computes_the_same_logits(trained, tmp_path):
    import jax.numpy as jnp
    import numpy as np

    from meshforge.jax.bridge import jax_twin, load_pytree

    _, _, checkpoint, state = trained
    folder = export_checkpoint(checkpoint, tmp_path / "jax", to="jax")
    params = load_pytree(folder)
    args = MODELS["toy"].flavors["debug"]
    ours = MODELS["toy"].build(args)
    ours.load_state_dict(state, strict=False)
    ours.init_buffers()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    twin = jax_twin(args)
    assert twin.__name__ == "toy_family.jax"
    logits = np.asarray(twin.forward(params, jnp.asarray(tokens.numpy()), args))
    with torch.no_grad():
        np.testing.assert_allclose(logits, ours(tokens).numpy(), atol=2e-5, rtol=1e-4)
