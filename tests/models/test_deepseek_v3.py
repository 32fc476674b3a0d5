"""DeepSeek-V3 (models/deepseek_v3/): checkpoints transformers itself saves (DeepseekV3ForCausalLM,
random weights) give transformers' logits in our model, with and without a low-rank query, YaRN on
and off, 1 and 2 shared experts, grouped routing on and off, dense first layers; our export loads
in transformers with the same logits and round-trips bit-exactly; the flavors have transformers'
parameter counts; what the family does not implement is refused by key, value and fix."""

from __future__ import annotations

import dataclasses
import json

import pytest

transformers = pytest.importorskip("transformers", reason="installed by .[all], as CI does")
import torch  # noqa: E402

from meshforge.convert import import_weights  # noqa: E402
from meshforge.core.errors import IncompatibleWeights, UnsupportedConfig  # noqa: E402
from meshforge.core.topology import ParallelDims  # noqa: E402
from meshforge.models import MODELS, count_params, spec_of  # noqa: E402
from meshforge.models.deepseek_v3 import active_params  # noqa: E402

SPEC = MODELS["deepseek_v3"]
ADAPTER = SPEC.adapter
BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=24,  # unlike the key heads' 24 = 16 + 8 only by chance: see the next cases
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    max_position_embeddings=64,
)
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=16,
    beta_fast=32,
    beta_slow=1,
    mscale=0.707,
    mscale_all_dim=1.0,
)
# (name, DeepseekV3Config overrides of BASE)
CASES = [
    ("plain_q_1shared_ungrouped", {}),
    (
        "q_lora_2shared_grouped",
        dict(q_lora_rank=48, n_shared_experts=2, n_group=4, topk_group=2, v_head_dim=20),
    ),
    ("yarn_grouped_2dense", dict(rope_parameters=YARN, n_group=2, topk_group=1, first_k_dense_replace=2)),
    (
        "yarn_q_lora_halves_no_dense_unnormalised",
        dict(
            rope_parameters=dict(YARN, mscale=1.0),
            q_lora_rank=24,
            rope_interleave=False,
            first_k_dense_replace=0,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
        ),
    ),
]
IDS = [name for name, _ in CASES]
TOKENS = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))


def save_with_transformers(kwargs: dict, folder, seed: int = 0):
    """A random DeepseekV3ForCausalLM saved by transformers' own save_pretrained; its norms and
    router correction bias drawn too (their inits, ones and zeros, would hide a misread)."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**BASE, **kwargs})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.2) if "norm" in name else p.normal_(0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    model.save_pretrained(folder)
    return model


def ours_from(folder):
    args = ADAPTER.read_hf_args(folder)
    model = SPEC.build(args)
    import_weights(model, folder, "hf")
    return model.eval(), args


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(TOKENS)
    return out.logits if hasattr(out, "logits") else out


def test_the_family_is_registered_with_its_own_args():
    args = SPEC.flavors["debug"]
    assert spec_of(args) is SPEC and args.n_moe_layers == 2 and args.softmax_scale == 24**-0.5


@pytest.mark.parametrize("name,kwargs", CASES, ids=IDS)
def test_transformers_checkpoints_give_transformers_logits(tmp_path, name, kwargs):
    hf = save_with_transformers(kwargs, tmp_path)
    model, args = ours_from(tmp_path)
    assert (args.q_lora_rank, args.n_group, args.first_k_dense_replace) == (
        kwargs.get("q_lora_rank") or 0,
        kwargs.get("n_group", 1),
        kwargs.get("first_k_dense_replace", 1),
    )
    assert (args.yarn_factor is not None) == ("rope_parameters" in kwargs)
    assert any(b.any() for n, b in model.named_buffers() if n.endswith("expert_bias"))  # read, not zeroed
    expected = logits(hf)
    assert expected.abs().max() > 1.0  # the comparison is not between near-zero logits
    assert (logits(model) - expected).abs().max() < 1e-4


@pytest.mark.parametrize("name,kwargs", CASES, ids=IDS)
def test_our_export_loads_in_transformers_and_round_trips_bit_exactly(tmp_path, name, kwargs):
    """transformers' folder -> ours -> our HF folder -> transformers (same logits; save) -> ours:
    every tensor, the correction bias included, equal."""
    save_with_transformers(kwargs, tmp_path / "theirs")
    model, args = ours_from(tmp_path / "theirs")
    ADAPTER.save_hf(model.state_dict(), args, tmp_path / "ours")
    theirs = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert (logits(theirs) - logits(model)).abs().max() < 1e-4
    theirs.save_pretrained(tmp_path / "again")
    back, back_args = ADAPTER.load_hf(tmp_path / "again")
    assert ADAPTER.check_compatible(back_args, args) == []
    ours = model.state_dict()
    assert set(back) == set(ours) - {"freqs_cis"}
    assert all(torch.equal(ours[k], back[k]) for k in back)


def test_a_softmax_routed_model_is_not_exported_as_transformers_sigmoid_one(tmp_path):
    """The 16b flavor (TorchTitan's, softmax scoring) would load in transformers and route by
    sigmoid: refused before anything is written."""
    args = dataclasses.replace(SPEC.flavors["debug"], score_func="softmax", n_group=1, topk_group=1)
    with pytest.raises(IncompatibleWeights, match="score_func = 'softmax'"):
        ADAPTER.save_hf({"norm.weight": torch.ones(args.dim)}, args, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def hf_counts(args) -> tuple[int, int]:
    """transformers' DeepseekV3ForCausalLM of `args`' config, built on the meta device: all its
    parameters, and those a token computes with (the routed experts it was not sent to left out)."""
    sigmoid = dataclasses.replace(args, score_func="sigmoid")  # the scoring has no parameters
    cfg = {k: v for k, v in ADAPTER.hf_config(sigmoid).items() if k not in ("architectures", "torch_dtype")}
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**cfg))
    total = sum(p.numel() for p in model.parameters())
    experts = [m for m in model.modules() if type(m).__name__ == "DeepseekV3Experts"]
    per_expert = sum(p[0].numel() for m in experts for p in m.parameters())
    return total, total - per_expert * (args.num_experts - args.num_experts_per_tok)


# flavor: (total, active), the table of the family's note
COUNTS = {
    "debug": (235_648, 161_920),
    "16b": (15_706_484_224, 2_661_150_208),
    "671b": (671_026_404_352, 37_552_282_624),
    "kimi_k2": (1_026_408_209_408, 32_861_477_888),
}


@pytest.mark.parametrize("flavor", sorted(COUNTS))
def test_flavors_have_transformers_parameter_counts(flavor):
    args = SPEC.flavors[flavor]
    with torch.device("meta"):
        ours = count_params(SPEC.build(args))
    assert hf_counts(args) == (ours, active_params(args, ours)) == COUNTS[flavor]


def folder_with(tmp_path, **changes):
    """A transformers-saved tiny folder whose config.json has `changes` (None: key removed)."""
    if not (tmp_path / "config.json").exists():
        save_with_transformers({}, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


# (config.json changes, what the error must say: the key, its value, the fix)
REFUSED = [
    (dict(scoring_func="softmax"), r"scoring_func = 'softmax'.*does not implement this key"),
    (dict(n_group=3), r"n_group = 3: must divide n_routed_experts = 8 into equal groups"),
    (dict(n_group=8), r"n_group = 8: a group is scored by its best two experts: at most 4"),
    (dict(n_group=2, topk_group=3), r"topk_group = 3: must be between 1 and n_group = 2"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=3), r"num_experts_per_tok = 3: more than the 2"),
    (dict(rope_parameters=dict(YARN, truncate=False)), r"rope_parameters.truncate = False: not implemented"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), r"rope_type = 'linear'"),
    (dict(hidden_act="gelu"), r"hidden_act = 'gelu'"),
    (dict(attention_bias=True), r"attention_bias = True"),
    (dict(head_dim=16), r"head_dim = 16: transformers derives it as 8"),
]


@pytest.mark.parametrize(
    "changes,message", REFUSED, ids=[next(iter(c)) + str(i) for i, (c, _) in enumerate(REFUSED)]
)
def test_what_the_family_does_not_implement_is_refused_by_key(tmp_path, changes, message):
    with pytest.raises(UnsupportedConfig, match=message):
        ADAPTER.read_hf_args(folder_with(tmp_path, **changes))


def test_the_mesh_rules_refuse_what_is_not_wired_for_mla_and_bad_groups():
    import dataclasses

    args = SPEC.flavors["debug"]
    assert SPEC.check(args, ParallelDims(dp_shard=2, ep=2)) == []
    assert SPEC.check(args, ParallelDims(dp_shard=2, ep=2, pp=2)) == []
    found = {(p.field, p.value) for p in SPEC.check(args, ParallelDims(tp=2, cp=2))}
    assert found == {("mesh.tp", 2), ("mesh.cp", 2)}
    bad = dataclasses.replace(args, n_group=3, topk_group=4, load_balance="aux_loss")
    problems = {p.field: p.message for p in SPEC.check(bad, ParallelDims())}
    assert "into equal groups" in problems["model.n_group"]
    assert "between 1 and n_group=3" in problems["model.topk_group"]
    assert "model.load_balance=aux_free" in problems["model.load_balance"]


# --- parity on a mesh: one process vs FSDP 2, EP 2, EP 2 x PP 2 (slow: multi-process launches) ----

PARITY_STEPS = 10
DSV3 = ["model.name=deepseek_v3", "model.bias_update_rate=0.01"]  # a bias that moves: its sync shows
PARITY = {
    "fsdp2": ["mesh.dp_shard=2"],
    "ep2": ["mesh.dp_shard=2", "mesh.ep=2"],
    "ep2_pp2": ["mesh.dp_shard=2", "mesh.ep=2", "mesh.pp=2"],
}


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory):
    """The debug flavor trained 10 steps on one process and on each mesh of PARITY, as a user
    launches it (support.run_recipe: tests/parallel/test_moe_parallel.py's machinery); records by name."""
    from support import QUICK, RECIPES, read_metrics, run_recipe

    out = tmp_path_factory.mktemp("dsv3")
    runs = {}
    for name, mesh in {"one": ["mesh.dp_shard=1"], **PARITY}.items():
        args = [str(RECIPES / "debug_cpu.toml"), "mesh.dp_replicate=1", "mesh.tp=1", "mesh.pp=1", *QUICK]
        args += [*DSV3, *mesh, f"train.steps={PARITY_STEPS}", "logging.memory_breakdown_step=0"]
        proc = run_recipe([*args, f"output_dir={out}", f"run_name={name}"], cwd=out)
        assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        runs[name] = read_metrics(out / name)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARITY))
def test_fsdp_ep_and_pp_reproduce_one_process(parity_runs, name):
    """Loss, grad norm, aux loss (fp32: 1e-5) and every sparse layer's expert loads, step by step;
    no routed token dropped; it learns."""
    base, rows = parity_runs["one"], parity_runs[name]
    assert [r["step"] for r in rows] == list(range(1, PARITY_STEPS + 1))
    for key in ("loss", "grad_norm", "moe/aux_loss"):
        diff = max(abs(a[key] - b[key]) for a, b in zip(rows, base))
        assert diff <= 1e-5, f"{name}: max |d {key}| {diff:.2e}"
    for a, b in zip(rows, base):
        loads = {k: v for k, v in a.items() if k.startswith("moe/layer")}
        assert sorted(loads) == sorted(
            f"moe/layer{i}/{k}" for i in (1, 2) for k in ("max_load", "mean_load", "imbalance")
        )  # layer 0 dense (first_k_dense_replace = 1)
        assert loads == {k: b[k] for k in loads} and a["moe/tokens_dropped"] == 0
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3


def test_the_16b_recipe_plans_the_flavor_on_fsdp8_ep8():
    from support import RECIPES

    from meshforge.recipe import load_recipe
    from meshforge.run.rank.plan import make_plan

    recipe = load_recipe(RECIPES / "deepseek_v3_16b.toml", [])
    plan = make_plan(recipe)
    assert (recipe.mesh.dp_shard, recipe.mesh.ep) == (8, 8)
    assert plan.n_params == COUNTS["16b"][0]
    shape = dict(plan.rows(recipe))["shape"]
    assert "MLA 16 heads (plain q, kv_lora 512, qk 128+64, v 128)" in shape and "2 shared" in shape


def test_torchtitans_16b_job_file_imports_to_the_16b_flavor_and_plans(tmp_path):
    from support import REPO

    from meshforge.migrate import ImportRefused, import_config
    from meshforge.recipe import load_recipe
    from meshforge.run.rank.plan import make_plan

    job = REPO / "tests" / "interop" / "configs" / "torchtitan_0.2" / "deepseek_v3_16b.toml"
    imported = import_config(job, tmp_path / "r.toml", 8)
    recipe = load_recipe(tmp_path / "r.toml", world_size=8)
    assert (recipe.model.name, recipe.model.flavor, recipe.mesh.dp_shard) == ("deepseek_v3", "16b", 8)
    assert make_plan(recipe).args == SPEC.flavors["16b"]  # no field overridden: the same model
    assert any("aux_free" in note for note in imported.notes)

    # the same job at 8192 tokens: TorchTitan's YaRN, which the flavor does not carry, is refused
    longer = tmp_path / "long.toml"
    longer.write_text(job.read_text().replace("seq_len = 4096", "seq_len = 8192"))
    with pytest.raises(ImportRefused) as e:
        import_config(longer, tmp_path / "r2.toml", 8)
    (refused,) = [s for s in e.value.imported.unsupported if s.key == "training.seq_len"]
    assert refused.value == 8192 and "YaRN" in refused.why


def test_the_jax_twin_is_refused_by_name():
    pytest.importorskip("jax", reason="the jax extra")
    from meshforge.jax.bridge import jax_twin

    with pytest.raises(UnsupportedConfig, match="model.name = 'deepseek_v3': the JAX twin"):
        jax_twin(SPEC.flavors["debug"]).forward({}, None, SPEC.flavors["debug"])


def test_mla_attention_flops_count_the_value_heads_at_their_own_width():
    """MFU's attention term for MLA: query/key heads of 192, value heads of 128 (TorchTitan's
    6 L H (qk + v) T), not the 12 L H Q T of heads whose values are as wide as their keys."""
    from meshforge.run.observe.flops import flops_per_token

    args = SPEC.flavors["16b"]
    assert (args.head_dim, args.v_head_dim) == (192, 128)
    attention = flops_per_token(args, 4096, 0) - flops_per_token(args, 0, 0)
    assert attention == 6 * 27 * 16 * (192 + 128) * 4096
