"""Checkpoints written by transformers itself (not by us), in both config formats, for both
families: our torch model and the JAX twin give transformers' logits; every config key that
would change the math and that we do not implement is refused by name; weights round-trip
bit-exactly; `export --to hf` writes shards with the HF index that transformers loads."""

from __future__ import annotations

import copy
import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest  # noqa: E402

pytest.importorskip("jax", reason="the jax extra (installed by .[all], as CI does)")
pytest.importorskip("transformers", reason="installed by .[all], as CI does")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from support import QUICK, RECIPES, read_metrics, run_cli, run_recipe  # noqa: E402

from meshforge.core.errors import UnsupportedConfig  # noqa: E402
from meshforge.jax.bridge import jax_twin, state_to_pytree  # noqa: E402
from meshforge.models import MODELS, count_params, spec_of  # noqa: E402
from meshforge.models.llama3.adapter import ADAPTER as llama_hf  # noqa: E402
from meshforge.models.qwen3.adapter import ADAPTER as qwen3_hf  # noqa: E402

LLAMA = dict(
    hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=128, max_position_embeddings=256
)
QWEN3 = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_hidden_layers=2,
    vocab_size=128,
    head_dim=32,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# (family, name, config kwargs): GQA, tied, Llama 3 RoPE scaling from a short context, an FFN
# width that is neither 8/3 x dim nor a multiple of 256, non-default eps and theta
CASES = [
    ("llama", "gqa_ffn160", dict(LLAMA, num_key_value_heads=2, intermediate_size=160, rms_norm_eps=1e-6)),
    (
        "llama",
        "mha_tied_eps1e-5",
        dict(
            LLAMA,
            num_key_value_heads=4,
            intermediate_size=200,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_theta=500000.0,
        ),
    ),
    (
        "llama",
        "llama3_rope_scaling",
        dict(
            LLAMA, num_key_value_heads=2, intermediate_size=176, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE
        ),
    ),
    (
        "qwen3",
        "gqa_untied",
        dict(QWEN3, num_key_value_heads=2, intermediate_size=160, tie_word_embeddings=False, rope_theta=1e6),
    ),
    (
        "qwen3",
        "tied_eps1e-5",
        dict(QWEN3, num_key_value_heads=4, intermediate_size=96, rms_norm_eps=1e-5, tie_word_embeddings=True),
    ),
    (
        "qwen3",
        "llama3_rope_scaling",
        dict(
            QWEN3, num_key_value_heads=2, intermediate_size=160, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0
        ),
    ),
]
HF_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}
INTEROP = {"llama": llama_hf, "qwen3": qwen3_hf}


def save_with_transformers(family: str, kwargs: dict, folder, seed: int = 0):
    """A random-weight model saved by transformers' own save_pretrained (its config format)."""
    config_cls, model_cls = HF_CLASSES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # far from the init: logits that depend on every weight
    model.save_pretrained(folder)
    return model


def to_transformers_4_format(folder) -> None:
    """Rewrite a transformers-5 config.json (rope_parameters) as transformers 4 writes it."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    path.write_text(json.dumps(cfg))


def ours_from(folder, family):
    state, args = INTEROP[family].load_hf(folder)
    model = spec_of(args).build(args)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"output.weight"} and (not missing or args.tie_embeddings)
    model.init_buffers()
    return model.eval(), args


@pytest.mark.parametrize("config_format", ["transformers5", "transformers4"])
@pytest.mark.parametrize("family,name,kwargs", CASES, ids=[f"{f}-{n}" for f, n, _ in CASES])
def test_transformers_checkpoints_give_transformers_logits(tmp_path, family, name, kwargs, config_format):
    hf = save_with_transformers(family, kwargs, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in written  # transformers 5 is what the test extra installs
    if config_format == "transformers4":
        to_transformers_4_format(tmp_path)
    model, args = ours_from(tmp_path, family)
    assert args.rope_theta == kwargs.get("rope_theta", 10000.0) and args.norm_eps == kwargs.get(
        "rms_norm_eps", 1e-6
    )
    assert args.ffn_hidden_dim == kwargs["intermediate_size"] and args.tie_embeddings == kwargs.get(
        "tie_word_embeddings", False
    )
    assert args.rope_scaling_factor == (8.0 if "rope_scaling" in kwargs else None)
    tokens = torch.randint(
        0, 128, (2, 48), generator=torch.Generator().manual_seed(1)
    )  # past 16: scaling matters
    with torch.no_grad():
        expected = hf(tokens).logits.numpy()
        ours = model(tokens).numpy()
    twin = np.asarray(
        jax_twin(args).forward(state_to_pytree(model.state_dict()), jnp.asarray(tokens.numpy()), args)
    )
    assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero logits
    assert np.abs(ours - expected).max() < 1e-4
    assert np.abs(twin - expected).max() < 1e-4


# (family, key, value, what the error must say)
REFUSED = [
    ("llama", "attention_bias", True, "attention_bias"),
    ("llama", "mlp_bias", True, "mlp_bias"),
    ("llama", "hidden_act", "gelu", "hidden_act"),
    ("llama", "head_dim", 32, "head_dim"),
    ("llama", "attention_dropout", 0.1, "attention_dropout"),
    ("llama", "rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}, "yarn"),
    ("llama", "rope_parameters", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, "linear"),
    ("llama", "quantization_config", {"quant_method": "gptq"}, "quantization_config"),
    ("llama", "model_type", "mistral", "model_type"),
    ("qwen3", "use_sliding_window", True, "use_sliding_window"),
    ("qwen3", "layer_types", ["full_attention", "sliding_attention"], "layer_types"),
    ("qwen3", "attention_bias", True, "attention_bias"),
    (
        "qwen3",
        "rope_parameters",
        {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        "sliding",
    ),
    ("qwen3", "logit_softcapping", 30.0, "logit_softcapping"),
]


@pytest.mark.parametrize(
    "family,key,value,says", REFUSED, ids=[f"{f}-{k}-{v}"[:60] for f, k, v, _ in REFUSED]
)
def test_every_key_we_do_not_implement_is_refused_by_name(tmp_path, family, key, value, says):
    kwargs = LLAMA if family == "llama" else QWEN3
    save_with_transformers(family, dict(kwargs, intermediate_size=160), tmp_path)
    base = json.loads((tmp_path / "config.json").read_text())
    INTEROP[family].args_from_hf_config(base)  # the unmodified config reads
    cfg = copy.deepcopy(base)
    cfg[key] = value
    with pytest.raises(UnsupportedConfig) as e:
        INTEROP[family].args_from_hf_config(cfg)
    assert says in str(e.value) and "config.json" in str(e.value)


def test_the_harmless_keys_are_ignored_and_nested_full_attention_rope_is_read():
    cfg = json.loads(json.dumps(qwen3_hf.hf_config(MODELS["qwen3"].flavors["debug"])))
    cfg.update(
        _name_or_path="x",
        use_cache=False,
        bos_token_id=1,
        initializer_range=0.5,
        pretraining_tp=1,
        is_llama_config=True,
        rope_interleaved=False,
    )  # SmolLM2 writes the last two
    cfg.pop("rope_parameters", None)
    cfg["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 123.0}}
    assert qwen3_hf.args_from_hf_config(cfg).rope_theta == 123.0


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_round_trip_through_transformers_is_bit_exact(tmp_path, family):
    """meshforge -> HF folder -> transformers (load, save) -> meshforge: every tensor equal."""
    spec = MODELS[family]
    args = spec.flavors["debug"]
    model = spec.build(args)
    model.init_weights(seed=3)
    spec.adapter.save_hf(model.state_dict(), args, tmp_path / "ours")
    model_cls = HF_CLASSES[spec.adapter.hf_model_type][1]
    model_cls.from_pretrained(tmp_path / "ours").save_pretrained(tmp_path / "theirs")
    back, back_args = spec.adapter.load_hf(tmp_path / "theirs")
    assert (
        spec.adapter.check_compatible(back_args, args) == []
    )  # the same model (FFN width may be spelled apart)
    ours = {k: v for k, v in model.state_dict().items() if k in back}
    assert set(ours) == set(back) and all(torch.equal(ours[k], back[k]) for k in ours)


@pytest.mark.parametrize("flavor", ["0.6b", "1.7b", "4b", "8b"])
def test_qwen3_flavors_have_the_published_parameter_counts(flavor):
    """Our Qwen3 and transformers' Qwen3ForCausalLM, built from the same published config."""
    a = MODELS["qwen3"].flavors[flavor]
    cfg = transformers.Qwen3Config(**json.loads(json.dumps(qwen3_hf.hf_config(a))))
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.Qwen3ForCausalLM(cfg).parameters())
        ours = count_params(MODELS["qwen3"].build(a))
    published = {"0.6b": 596_049_920, "1.7b": 1_720_574_976, "4b": 4_022_468_096, "8b": 8_190_735_360}
    assert ours == theirs == published[flavor]


def test_recipe_model_from_an_hf_folder_validates_and_refuses_clearly(tmp_path):
    save_with_transformers("qwen3", dict(QWEN3, num_key_value_heads=2, intermediate_size=160), tmp_path / "q")
    one = ["mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1", "train.seq_len=32"]
    proc = run_cli(
        ["debug_cpu", *one, "model.name=qwen3", f"model.hf={tmp_path / 'q'}", "--dry-run"], cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        f"qwen3 from {tmp_path / 'q'}" in proc.stdout and "FFN 160" in proc.stdout and "of 32" in proc.stdout
    )
    proc = run_cli(
        ["debug_cpu", *one, f"model.hf={tmp_path / 'q'}", "model.head_dim=16", "--dry-run"], cwd=tmp_path
    )
    assert (
        proc.returncode == 2
        and "set model.name=qwen3" in proc.stderr
        and "llama3 has no head_dim" in proc.stderr
    )
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    (tmp_path / "q" / "config.json").write_text(json.dumps({**cfg, "attention_bias": True}))
    proc = run_cli(
        ["debug_cpu", *one, "model.name=qwen3", f"model.hf={tmp_path / 'q'}", "--dry-run"], cwd=tmp_path
    )
    assert proc.returncode == 2 and "model.hf" in proc.stderr and "attention_bias = True" in proc.stderr


@pytest.mark.slow
def test_a_recipe_trains_from_hf_weights_on_a_3d_mesh_and_exports_back(tmp_path):
    """The user's journey: a transformers-saved Qwen3 folder -> a recipe whose model and
    weights come from it, on FSDP 2 x TP 2 x PP 2 -> `export --to hf` (sharded) -> transformers."""
    folder = tmp_path / "qwen3-hf"
    hf = save_with_transformers("qwen3", dict(QWEN3, num_key_value_heads=2, intermediate_size=160), folder)
    run = tmp_path / "runs" / "from-hf"
    proc = run_recipe(
        [
            str(RECIPES / "debug_cpu.toml"),
            *QUICK,
            "model.name=qwen3",
            f"model.hf={folder}",
            f"checkpoint.init_from_hf={folder}",
            "mesh.dp_shard=2",
            "mesh.tp=2",
            "mesh.pp=2",
            "train.steps=2",
            "checkpoint.enabled=true",
            f"output_dir={tmp_path / 'runs'}",
            "run_name=from-hf",
            "optimizer.lr=1e-5",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # step 1's loss is transformers' loss on the same batch: the weights arrived intact on every rank
    from meshforge.recipe import load_recipe
    from meshforge.run.data.synthetic import ShardedLoader, build_source

    recipe = load_recipe(RECIPES / "debug_cpu.toml", [*QUICK, "model.name=qwen3", f"model.hf={folder}"], 8)
    source = build_source(recipe.data, 128, recipe.train.seq_len)
    (batch,) = ShardedLoader(source, recipe.train.global_batch_size, 1).next_step()
    with torch.no_grad():
        logits = hf(batch.inputs).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()).item()
    assert abs(read_metrics(run)[0]["loss"] - expected) < 1e-4
    # the trained weights, exported in shards of at most 40 KB, load in transformers
    out = tmp_path / "export"
    proc = run_cli(
        ["export", str(run / "checkpoints"), "--to", "hf", "--max-shard-size", "40KB", str(out)],
        cwd=tmp_path,
        program="meshforge",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {p.name for p in shards}
    assert all(p.stat().st_size < 40_000 + 4096 for p in shards)  # + the safetensors header
    from meshforge.run.checkpoint.dcp import load_full_model, resolve_load

    ours, _, _ = load_full_model(resolve_load("latest", run / "checkpoints"))
    theirs = transformers.Qwen3ForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        diff = (theirs(batch.inputs).logits - ours.eval()(batch.inputs)).abs().max().item()
    assert diff < 1e-4
    assert not torch.equal(theirs.model.embed_tokens.weight, hf.model.embed_tokens.weight)  # it did train


def test_export_writes_the_installed_transformers_config_format(monkeypatch):
    """transformers 5 reads rope_parameters; transformers 4 would ignore them (and silently use
    theta 10000), so without transformers 5 installed the config is written the old way,
    which both read. Either way it reads back to the same model."""
    import meshforge.models.common.hf_config as hf_config

    args = MODELS["llama3"].flavors["1b"]
    for major, key in ((5, "rope_parameters"), (4, "rope_scaling"), (0, "rope_scaling")):
        monkeypatch.setattr(hf_config, "transformers_major", lambda major=major: major)
        cfg = llama_hf.hf_config(args)
        assert key in cfg and (("rope_theta" in cfg) == (major < 5))
        assert llama_hf.check_compatible(llama_hf.args_from_hf_config(cfg), args) == []
