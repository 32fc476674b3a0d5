"""float8 training (#28): which layers torchao's Float8Linear takes, the recipe's refusals, and
real runs: numerics against high precision, a checkpoint in and out of float8, the estimate.
Its parity on every mesh is in test_parity_matrix.py."""

from __future__ import annotations

import json

import pytest
import torch
from support import QUICK, RECIPES, read_metrics, run_recipe

from meshforge.configs import RecipeError
from meshforge.configs.parallelism import Float8Config
from meshforge.core.units import GiB
from meshforge.models import args_from_config, get_model_spec
from meshforge.parallelisms.float8 import apply_float8, float8_layers
from meshforge.recipe import load_recipe

pytest.importorskip("torchao")
ONE = ["mesh.dp_replicate=1", "mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1"]
BLOCK_LINEARS = ["attention.wq", "attention.wk", "attention.wv", "attention.wo"]


def _model(overrides: list[str]):
    recipe = load_recipe(RECIPES / "debug_cpu.toml", [*ONE, *overrides])
    with torch.device("meta"):
        return get_model_spec(recipe.model.name).build(args_from_config(recipe.model))


def test_the_blocks_linears_are_converted_and_the_head_routers_and_small_dims_kept():
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    model = _model([])
    chosen = float8_layers(model, Float8Config(enabled=True))
    n_layers = len(model.layers)
    ffn = ["feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
    assert chosen == [f"layers.{i}.{x}" for i in range(n_layers) for x in [*BLOCK_LINEARS, *ffn]]
    assert apply_float8(model, Float8Config(enabled=True, recipe="tensorwise")) == chosen
    assert all(isinstance(model.get_submodule(f), Float8Linear) for f in chosen)
    assert type(model.output) is torch.nn.Linear  # float8.exclude's default
    config = model.get_submodule(chosen[0]).config
    assert config.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE
    rowwise = _model([])
    apply_float8(rowwise, Float8Config(enabled=True, recipe="rowwise"))
    assert rowwise.layers["0"].attention.wq.config.cast_config_input.scaling_granularity is (
        ScalingGranularity.AXISWISE
    )
    # a name in exclude matches a layer's own name or its ending: every block's w2, not its w1
    kept_ffn = float8_layers(_model([]), Float8Config(enabled=True, exclude=["output", "w2"]))
    assert not any(f.endswith("w2") for f in kept_ffn) and any(f.endswith("w1") for f in kept_ffn)
    # MoE: the router's gate stays (a routing decision must not flip on a rounding); experts are no Linears
    moe = float8_layers(_model(["model.name=qwen3_moe", "model.flavor=debug"]), Float8Config(enabled=True))
    assert moe and not any("router" in f for f in moe)  # (experts are grouped weights, not Linears)
    # dims not divisible by 16 (float8 matmuls need it): a 40-wide model keeps its attention's 40 x 40
    narrow = float8_layers(
        _model(["model.dim=40", "model.n_heads=2", "model.n_kv_heads=2"]), Float8Config(True)
    )
    assert not any("attention" in f for f in narrow)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["float8.recipe=mxfp8"], "float8.recipe"),
        (["backend=jax"], "backend"),
        (["fsdp.param_dtype=float16"], "fsdp.param_dtype"),
        (["float8.exclude=[output,wq,wk,wv,wo,w1,w2,w3]"], "float8.enabled"),  # nothing left
        (["float8.exclude=[ouptut]"], "float8.exclude"),  # a typo would put the head in float8
        (["float8.exclude=[attention]"], "float8.exclude"),  # a parent names no layer
    ],
)
def test_what_float8_cannot_do_is_refused_naming_the_field(overrides, field):
    with pytest.raises(RecipeError) as e:
        load_recipe(RECIPES / "debug_cpu.toml", [*ONE, "float8.enabled=true", *overrides])
    assert any(p.field == field for p in e.value.problems), e.value.problems


def _run(tmp_path, name: str, *overrides: str):
    proc = run_recipe(
        [str(RECIPES / "debug_cpu.toml"), *QUICK, f"output_dir={tmp_path}", f"run_name={name}", *overrides],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(tmp_path / name), proc


@pytest.mark.slow
def test_float8_trains_within_a_percent_of_high_precision_and_says_what_it_converted(tmp_path):
    """15 steps on one process: each recipe's loss within 1% of fp32's, and not equal to it (the
    matmuls did run in float8); the banner says what is kept in high precision."""
    steps = ["train.steps=15", "logging.memory_breakdown_step=0", *ONE]
    base, _ = _run(tmp_path, "fp32", *steps)
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        f8 = ["float8.enabled=true", f"float8.recipe={recipe}", "logging.progress=true"]
        rows, proc = _run(tmp_path, recipe, *steps, *f8)
        rel = max(abs(a["loss"] / b["loss"] - 1) for a, b in zip(rows, base))
        assert 0 < rel < 0.01, (recipe, rel)
        assert rows[-1]["loss"] < rows[0]["loss"] - 0.3  # it trained
        assert "Failed to load" not in proc.stderr  # torchao's CUDA kernels on a CPU build: not ours to say
        assert (
            f"float8 ({recipe} scaling, torchao; emulated on CPU" in proc.stdout
            and "kept in float32: output" in proc.stdout
        )


@pytest.mark.slow
def test_a_float8_checkpoint_resumes_without_float8_and_the_estimate_holds(tmp_path):
    """Float8Linear keeps its weight in high precision under the same name: a float8 run's
    checkpoint (FSDP 2 x TP 2) resumes with float8 off, continuing from step 3; the traced estimate
    of the float8 run is within 5% of its measured peak."""
    from meshforge.simulate.estimate import trace_pool, traced_estimate

    mesh = ["mesh.dp_shard=2", "mesh.tp=2", "mesh.pp=1"]
    ckpt = ["checkpoint.enabled=true", "checkpoint.interval=3", "logging.memory_breakdown_step=2"]
    f8 = ["float8.enabled=true", "float8.recipe=tensorwise"]
    rows, _ = _run(tmp_path, "f8", *mesh, *ckpt, *f8, "train.steps=3")
    step3 = tmp_path / "f8" / "checkpoints" / "step-00000003"
    later, _ = _run(tmp_path, "resumed", *mesh, f"checkpoint.load={step3}", "train.steps=5")
    assert [r["step"] for r in later] == [4, 5] and later[0]["loss"] < rows[0]["loss"]
    summary = json.loads((tmp_path / "f8" / "run.json").read_text())["summary"]
    measured = max(r["total_gib"] for r in summary["memory_breakdown"]["per_rank"]) * GiB
    with trace_pool() as pool:
        est = traced_estimate(load_recipe(RECIPES / "debug_cpu.toml", [*QUICK, *mesh, *f8]), pool)
    assert abs(est["total"] / measured - 1) <= 0.05, (est, measured)


def test_a_cpu_emulates_the_float8_matmuls_with_the_kernels_numbers():
    """On a CPU the Float8Linear matmuls are emulated (torchao's emulate: fp32 products of the same
    float8 operands); a GPU's are not. The emulated tensorwise forward equals CPU's `_scaled_mm`
    kernel but for rounding order, and differs from the fp32 layer by float8's rounding."""
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    layer, x = torch.nn.Linear(64, 32, bias=False), torch.randn(16, 64)
    models = {dev: torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)) for dev in ("cpu", "cuda")}
    outs = {}
    for dev, model in models.items():
        model[0].load_state_dict(layer.state_dict())
        apply_float8(model, Float8Config(enabled=True, recipe="tensorwise", exclude=[]), dev)
        assert isinstance(model[0], Float8Linear) and model[0].config.emulate == (dev == "cpu")
        with torch.no_grad():
            outs[dev] = model(x)  # the "cuda" model's kernel is CPU's _scaled_mm here: x is on the CPU
    exact = layer(x).detach()
    assert torch.allclose(outs["cpu"], outs["cuda"], rtol=0, atol=1e-5 * exact.abs().max())
    assert 1e-3 < (outs["cpu"] - exact).abs().max() / exact.abs().max() < 0.1
