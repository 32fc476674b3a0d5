"""Qwen3-MoE checkpoints written by transformers itself (Qwen3MoeForCausalLM.save_pretrained: one
tensor per expert, `num_local_experts` in config.json): our torch model and the JAX twin give
transformers' logits; our export loads in transformers with our logits; weights round-trip
bit-exactly; transformers' fused in-memory layout (gate_up_proj) reads to the same weights; a
rank reads only its slice of the experts; every key we do not implement is refused by name and
value; the published flavors have transformers' parameter counts, total and active."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil

import pytest

pytest.importorskip("jax", reason="the jax extra (installed by .[all], as CI does)")
pytest.importorskip("transformers", reason="installed by .[all], as CI does")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts  # noqa: E402

from meshforge.core.errors import IncompatibleWeights, UnsupportedConfig  # noqa: E402
from meshforge.interop.weights import WeightReader, hf_reader_for, load_into  # noqa: E402
from meshforge.jax.bridge import jax_twin, state_to_pytree  # noqa: E402
from meshforge.models import MODELS, count_params, spec_of  # noqa: E402
from meshforge.models.qwen3_moe import active_params, total_params  # noqa: E402
from meshforge.models.qwen3_moe.adapter import ADAPTER as qwen3_moe_hf  # noqa: E402

SPEC = MODELS["qwen3_moe"]
BASE = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_hidden_layers=2,
    vocab_size=128,
    intermediate_size=160,
    moe_intermediate_size=48,
    max_position_embeddings=256,
)
# (name, Qwen3MoeConfig kwargs): tied and untied, (experts, top-k), renormalised or not, dense
# layers by decoder_sparse_step and mlp_only_layers (layer 1 sparse, 0, 2, 3 dense), top-k = all
CASES = [
    ("e4_top1_tied", dict(BASE, num_experts=4, num_experts_per_tok=1, tie_word_embeddings=True)),
    ("e8_top2_norm", dict(BASE, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, rope_theta=1e6)),
    ("e6_top3", dict(BASE, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, rms_norm_eps=1e-5)),
    (
        "e8_top2_dense_layers_tied",
        dict(
            BASE,
            num_hidden_layers=4,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            tie_word_embeddings=True,
        ),
    ),
    ("e4_top4_norm", dict(BASE, num_experts=4, num_experts_per_tok=4, norm_topk_prob=True)),
]
IDS = [name for name, _ in CASES]
TOKENS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))


def save_with_transformers(kwargs: dict, folder, seed: int = 0) -> transformers.Qwen3MoeForCausalLM:
    """A random-weight Qwen3MoeForCausalLM saved by transformers' own save_pretrained."""
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kwargs)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # far from the init: logits that depend on every weight
    model.save_pretrained(folder)
    return model


def ours_from(folder):
    state, args = qwen3_moe_hf.load_hf(folder)
    model = SPEC.build(args)
    missing, unexpected = model.load_state_dict(state, strict=False)
    bias = {f"layers.{i}.moe.expert_bias" for i in range(args.n_layers)}  # no HF counterpart: zeros
    tied = set(missing) - bias
    assert not unexpected and tied <= {"output.weight"} and (not tied or args.tie_embeddings)
    model.init_buffers()
    return model.eval(), args


def logits(model) -> np.ndarray:
    with torch.no_grad():
        out = model(TOKENS)
    return (out.logits if hasattr(out, "logits") else out).numpy()


def test_the_registry_gives_the_moe_family_its_own_formats_and_twin():
    """Qwen3MoeArgs is a Qwen3Args: the family of its args must still be qwen3_moe's."""
    args = SPEC.flavors["debug"]
    assert spec_of(args) is SPEC and spec_of(MODELS["qwen3"].flavors["debug"]) is MODELS["qwen3"]
    assert jax_twin(args).__name__ == "meshforge.models.qwen3_moe.jax"


@pytest.mark.parametrize("name,kwargs", CASES, ids=IDS)
def test_transformers_checkpoints_give_transformers_logits(tmp_path, name, kwargs):
    hf = save_with_transformers(kwargs, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["num_local_experts"] == kwargs["num_experts"] and "num_experts" not in written
    model, args = ours_from(tmp_path)
    assert (args.num_experts, args.num_experts_per_tok, args.moe_dim) == (
        kwargs["num_experts"],
        kwargs["num_experts_per_tok"],
        48,
    )
    assert args.norm_topk_prob == kwargs.get("norm_topk_prob", False)  # Qwen3MoeConfig's default
    assert args.tie_embeddings == kwargs.get("tie_word_embeddings", False)
    expected = logits(hf)
    twin = np.asarray(
        jax_twin(args).forward(state_to_pytree(model.state_dict()), jnp.asarray(TOKENS.numpy()), args)
    )
    assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero logits
    assert np.abs(logits(model) - expected).max() < 1e-4
    assert np.abs(twin - expected).max() < 1e-4


@pytest.mark.parametrize("name,kwargs", CASES, ids=IDS)
def test_our_export_loads_in_transformers_and_round_trips_bit_exactly(tmp_path, name, kwargs):
    """transformers' folder -> ours -> our HF folder -> transformers (same logits; save) -> ours:
    every tensor equal."""
    save_with_transformers(kwargs, tmp_path / "theirs")
    model, args = ours_from(tmp_path / "theirs")
    qwen3_moe_hf.save_hf(model.state_dict(), args, tmp_path / "ours")
    theirs = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert np.abs(logits(theirs) - logits(model)).max() < 1e-4
    theirs.save_pretrained(tmp_path / "again")
    back, back_args = qwen3_moe_hf.load_hf(tmp_path / "again")
    assert qwen3_moe_hf.check_compatible(back_args, args) == []
    ours = {k: v for k, v in model.state_dict().items() if k in back}
    assert set(ours) == set(back) and all(torch.equal(ours[k], back[k]) for k in ours)


@pytest.mark.parametrize("name,kwargs", CASES[1:4], ids=IDS[1:4])
def test_the_fused_layout_reads_to_the_same_weights_and_slices(tmp_path, name, kwargs):
    """A folder holding transformers' in-memory tensors (experts.gate_up_proj: gate rows, then
    up; experts.down_proj) loads to the weights of the per-expert folder, whole or a slice at a
    time (what an expert-parallel or FSDP rank reads)."""
    hf = save_with_transformers(kwargs, tmp_path / "per_expert")
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(tmp_path / "per_expert" / "config.json", fused)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    if kwargs.get("tie_word_embeddings"):
        del state["lm_head.weight"]
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(fused / "model.safetensors"))
    want, args = qwen3_moe_hf.load_hf(tmp_path / "per_expert")
    got, _ = qwen3_moe_hf.load_hf(fused)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    layer = next(i for i in range(args.n_layers) if f"layers.{i}.moe.experts.w1" in want)
    for folder in (tmp_path / "per_expert", fused):
        reader = WeightReader(folder, args, "hf")
        for w in ("w1", "w2", "w3"):
            full = want[f"layers.{layer}.moe.experts.{w}"]
            assert reader.shape(f"layers.{layer}.moe.experts.{w}") == tuple(full.shape)
            for index in ((slice(1, 3), slice(None), slice(None)), (slice(0, 5), slice(4, 20), slice(3, 7))):
                assert torch.equal(reader.read(f"layers.{layer}.moe.experts.{w}", index), full[index])
        assert reader.read(f"layers.{layer}.moe.experts.w1", (slice(2, 2),)).shape[0] == 0  # an empty shard


def test_init_from_hf_fills_a_recipe_model_and_training_settings_may_differ(tmp_path):
    """hf_reader_for + load_into (what checkpoint.init_from_hf runs on each rank): the recipe's
    balancing and kernels are its own; aux_free's bias starts at zero."""
    save_with_transformers(CASES[3][1], tmp_path)
    want, args = qwen3_moe_hf.load_hf(tmp_path)
    recipe_args = dataclasses.replace(
        args, load_balance="aux_free", grouped_mm=False, router_aux_loss_coef=0.0
    )
    model = SPEC.build(recipe_args)
    model.init_weights(seed=0)
    load_into(model, hf_reader_for(tmp_path, recipe_args))
    model.init_buffers()
    state = model.state_dict()
    assert all(torch.equal(state[k], want[k]) for k in want)
    assert all(not state[k].any() for k in state if k.endswith("expert_bias"))
    other = dataclasses.replace(args, num_experts=16)
    with pytest.raises(IncompatibleWeights, match="num_experts: checkpoint 8, recipe 16"):
        hf_reader_for(tmp_path, other)


def test_meshforge_export_to_hf_from_a_checkpoint_loads_in_transformers(tmp_path):
    """`meshforge export --to hf` of a seed checkpoint (read one tensor at a time, the experts
    written one per expert), and back in with `import_weights`."""
    from meshforge.convert import export_checkpoint, import_weights, write_seed
    from meshforge.recipe import load_recipe
    from meshforge.run.checkpoint.dcp import load_full_model

    recipe = load_recipe("debug_cpu", ["model.name=qwen3_moe", "mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1"])
    seed = write_seed(recipe, tmp_path / "seed")
    out = export_checkpoint(seed, tmp_path / "hf", "hf")
    ours, args, _ = load_full_model(seed)
    theirs = transformers.Qwen3MoeForCausalLM.from_pretrained(out).eval()
    assert np.abs(logits(theirs) - logits(ours.eval())).max() < 1e-4
    again = SPEC.build(args)
    import_weights(again, out, "hf")
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), again.state_dict().values()))


def test_aux_free_bias_is_refused_on_export_by_name_and_the_twin_routes_with_it(tmp_path):
    args = dataclasses.replace(SPEC.flavors["debug"], load_balance="aux_free")
    model = SPEC.build(args)
    model.init_weights(seed=1)
    model.init_buffers()
    qwen3_moe_hf.save_hf(model.state_dict(), args, tmp_path / "zero")  # an untouched bias: exact
    assert "expert_bias" not in " ".join(qwen3_moe_hf.to_hf(model.state_dict(), args))
    with torch.no_grad():
        model.layers["1"].moe.expert_bias.copy_(torch.linspace(-0.2, 0.2, args.num_experts))
    with pytest.raises(
        IncompatibleWeights, match=r"layers\.1\.moe\.expert_bias: .*aux_free.*Qwen3MoeForCausalLM"
    ):
        qwen3_moe_hf.save_hf(model.state_dict(), args, tmp_path / "biased")
    twin = jax_twin(args).forward(state_to_pytree(model.state_dict()), jnp.asarray(TOKENS.numpy()), args)
    assert np.abs(np.asarray(twin) - logits(model.eval())).max() < 1e-5


def test_the_twin_loss_is_the_torch_loss():
    args = SPEC.flavors["debug"]
    model = SPEC.build(args)
    model.init_weights(seed=2)
    model.init_buffers()
    labels = TOKENS.roll(-1, dims=1)
    labels[0, :5] = -100
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(
            model.eval()(TOKENS).flatten(0, 1), labels.flatten(), reduction="sum"
        )
    total, n = jax_twin(args).token_ce_sum(
        state_to_pytree(model.state_dict()), jnp.asarray(TOKENS.numpy()), jnp.asarray(labels.numpy()), args
    )
    assert int(n) == labels.numel() - 5 and abs(float(total) - want.item()) < 1e-3


# (key, value, what the error must say): each on a config that otherwise reads
REFUSED = [
    ("shared_expert_intermediate_size", 256, "shared_expert_intermediate_size = 256"),
    ("num_experts_per_tok", 9, "num_experts_per_tok = 9"),
    ("num_experts_per_tok", 0, "num_experts_per_tok = 0"),
    ("router_jitter_noise", 0.1, "router_jitter_noise = 0.1"),
    ("scoring_func", "sigmoid", "scoring_func = 'sigmoid'"),
    ("n_group", 4, "n_group = 4"),
    ("topk_group", 2, "topk_group = 2"),
    ("use_sliding_window", True, "use_sliding_window = True"),
    ("layer_types", ["full_attention", "sliding_attention"], "layer_types = "),
    ("num_experts", 6, "num_local_experts = 8: differs from num_experts = 6"),
    ("decoder_sparse_step", 0, "decoder_sparse_step = 0"),
    ("hidden_act", "gelu", "hidden_act = 'gelu'"),
    ("model_type", "qwen2_moe", "model_type = 'qwen2_moe'"),
]


@pytest.mark.parametrize("key,value,says", REFUSED, ids=[f"{k}-{v}"[:50] for k, v, _ in REFUSED])
def test_every_key_we_do_not_implement_is_refused_by_name_and_value(tmp_path, key, value, says):
    save_with_transformers(CASES[1][1], tmp_path)
    base = json.loads((tmp_path / "config.json").read_text())
    qwen3_moe_hf.args_from_hf_config(base)  # the unmodified config reads
    cfg = copy.deepcopy(base)
    cfg[key] = value
    with pytest.raises(UnsupportedConfig) as e:
        qwen3_moe_hf.args_from_hf_config(cfg)
    assert says in str(e.value) and "config.json" in str(e.value)


def test_config_json_both_ways_and_the_harmless_keys():
    """Our config.json reads back to the same args, in transformers too; the keys that change
    nothing we compute are read; transformers 4's spelling (num_experts, rope_theta) is too."""
    for flavor in ("debug", "30b-a3b"):
        args = SPEC.flavors[flavor]
        cfg = json.loads(json.dumps(qwen3_moe_hf.hf_config(args)))
        assert qwen3_moe_hf.check_compatible(qwen3_moe_hf.args_from_hf_config(cfg), args) == []
        theirs = transformers.Qwen3MoeConfig(**cfg)
        assert (theirs.num_experts, theirs.moe_intermediate_size, theirs.mlp_only_layers) == (
            args.num_experts,
            args.moe_dim,
            list(args.mlp_only_layers),
        )
    cfg.update(
        output_router_logits=True, router_aux_loss_coef=0.01, max_window_layers=48, sliding_window=None
    )
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg["rope_scaling"] = None
    read = qwen3_moe_hf.args_from_hf_config(cfg)
    assert read.router_aux_loss_coef == 0.01 and qwen3_moe_hf.check_compatible(read, args) == []


def test_check_compatible_compares_what_the_weights_compute():
    a = SPEC.flavors["debug"]  # layer 0 dense
    same = dataclasses.replace(a, mlp_only_layers=(), decoder_sparse_step=1)
    assert (
        qwen3_moe_hf.check_compatible(a, dataclasses.replace(a, grouped_mm=False, load_balance="aux_free"))
        == []
    )
    assert qwen3_moe_hf.check_compatible(a, same) == [
        "sparse layers: checkpoint [1, 2, 3], recipe [0, 1, 2, 3]"
    ]
    assert "num_experts_per_tok" in " ".join(
        qwen3_moe_hf.check_compatible(a, dataclasses.replace(a, num_experts_per_tok=3))
    )


# the published config.json files (transformers 4.51's format)
PUBLISHED = {
    "30b-a3b": dict(
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        intermediate_size=6144,
        moe_intermediate_size=768,
        max_window_layers=48,
    ),
    "235b-a22b": dict(
        hidden_size=4096,
        num_hidden_layers=94,
        num_attention_heads=64,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        max_window_layers=94,
    ),
}
COMMON = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    vocab_size=151936,
    tie_word_embeddings=False,
    rope_theta=1000000.0,
    rope_scaling=None,
    max_position_embeddings=40960,
    rms_norm_eps=1e-06,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    use_sliding_window=False,
    sliding_window=None,
    attention_bias=False,
    attention_dropout=0.0,
    hidden_act="silu",
    output_router_logits=False,
    router_aux_loss_coef=0.001,
    torch_dtype="bfloat16",
)


@pytest.mark.parametrize("flavor", ["30b-a3b", "235b-a22b"])
def test_flavors_have_transformers_parameter_counts_total_and_active(flavor):
    """Ours, the closed forms, and transformers' Qwen3MoeForCausalLM built on the meta device
    from the published config; active = total less the (E - k) unpicked experts of each layer."""
    published = {**COMMON, **PUBLISHED[flavor]}
    args = SPEC.flavors[flavor]
    assert qwen3_moe_hf.check_compatible(qwen3_moe_hf.args_from_hf_config(published), args) == []
    config = transformers.Qwen3MoeConfig(**{k: v for k, v in published.items() if k != "architectures"})
    with torch.device("meta"):
        theirs = transformers.Qwen3MoeForCausalLM(config)
        ours = count_params(SPEC.build(args))
    total = sum(p.numel() for p in theirs.parameters())
    experts = [m for m in theirs.modules() if isinstance(m, Qwen3MoeExperts)]
    unpicked = sum(sum(p.numel() for p in m.parameters()) // 128 * (128 - 8) for m in experts)
    assert len(experts) == args.n_layers and ours == total == total_params(args)
    assert active_params(args) == total - unpicked
    counts = {"30b-a3b": (30_532_122_624, 3_353_032_704), "235b-a22b": (235_093_634_560, 22_190_763_520)}
    assert (total, total - unpicked) == counts[flavor]  # the flavors' comments
