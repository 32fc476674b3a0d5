"""The optimizer registry (meshforge.run.optimizers/): each optimizer against torch's own
(or, for Lion, which torch lacks, against the paper's equations written here), the parameter
groups, and the refusals of settings an optimizer does not read."""

from __future__ import annotations

import pytest
import torch

from meshforge.configs import RecipeError
from meshforge.configs.schema import OptimizerConfig
from meshforge.recipe import load_recipe
from meshforge.run.optimizers import OPTIMIZERS
from meshforge.run.optimizers.muon import adamw_reason
from meshforge.run.train.optim import build_optimizer, parameter_groups

STEPS = 20


def named_params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.nn.Parameter]]:
    """A toy model's parameters as a transformer names them: an embedding, hidden matrices (one tall,
    one wide), a norm, a bias, an output projection and a router."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "tok_embeddings.weight": (32, 16),
        "layers.0.attention.wq.weight": (24, 16),
        "layers.0.feed_forward.w2.weight": (16, 40),
        "layers.0.attention_norm.weight": (16,),
        "layers.0.feed_forward.w1.bias": (40,),
        "layers.0.moe.router.gate.weight": (4, 16),
        "output.weight": (32, 16),
    }
    return [(n, torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype))) for n, s in shapes.items()]


def grads(params, step: int) -> None:
    """The same pseudo-random gradients for every copy of the parameters, step by step."""
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def run(opt: torch.optim.Optimizer, params, steps: int = STEPS) -> list[torch.Tensor]:
    for step in range(steps):
        grads(params, step)
        opt.step()
    return [p.detach().clone() for p in params]


def assert_all_close(got, want, atol: float) -> None:
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)


def test_registry_is_the_schemas_list_of_optimizers():
    from meshforge.configs.training import OPTIMIZER_READS

    assert list(OPTIMIZERS) == list(OPTIMIZER_READS) == ["adamw", "sgd", "lion", "muon"]


def test_adamw_is_torchs_adamw_bit_for_bit():
    cfg = OptimizerConfig(lr=1e-2)
    ours, theirs = named_params(), named_params()
    got = run(build_optimizer(ours, cfg), [p for _, p in ours])
    ref = torch.optim.AdamW(
        [p for _, p in theirs], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True
    )
    want = run(ref, [p for _, p in theirs])
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_equals_torchs_sgd_over_20_steps(nesterov):
    cfg = OptimizerConfig(name="sgd", lr=0.05, weight_decay=0.01)
    cfg.sgd.momentum, cfg.sgd.nesterov = 0.9, nesterov
    ours, theirs = named_params(), named_params()
    got = run(build_optimizer(ours, cfg), [p for _, p in ours])
    ref = torch.optim.SGD([p for _, p in theirs], lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=0.01)
    assert_all_close(got, run(ref, [p for _, p in theirs]), atol=1e-6)
    assert got[0].sub(named_params()[0][1]).abs().max() > 0.1  # it moved


def lion_from_the_paper(params, lr, beta1, beta2, wd, steps: int) -> list[torch.Tensor]:
    """Chen et al. 2023, Algorithm 2, line by line."""
    theta = [p.detach().clone() for p in params]
    m = [torch.zeros_like(t) for t in theta]
    for step in range(steps):
        grads(params, step)
        for i, p in enumerate(params):
            g = p.grad
            c = beta1 * m[i] + (1 - beta1) * g  # update interpolation
            theta[i] = theta[i] - lr * (torch.sign(c) + wd * theta[i])  # update parameters
            m[i] = beta2 * m[i] + (1 - beta2) * g  # update momentum
    return theta


def test_lion_equals_the_papers_update_over_20_steps():
    """In float64: float32 rounds 1 - lr * wd, which the two forms of the decay meet differently."""
    cfg = OptimizerConfig(name="lion", lr=1e-3, weight_decay=0.5)
    ours, theirs = named_params(dtype=torch.float64), named_params(dtype=torch.float64)
    got = run(build_optimizer(ours, cfg), [p for _, p in ours])
    want = lion_from_the_paper([p for _, p in theirs], 1e-3, 0.9, 0.99, 0.5, STEPS)
    assert_all_close(got, want, atol=1e-6)
    assert all(len(s) == 1 for s in build_optimizer(ours, cfg).state.values())  # one state: the momentum


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_muon_equals_torchs_muon_on_matrices_and_adamw_elsewhere(adjust_lr):
    """Hidden matrices step as torch.optim.Muon; the embedding, norm, bias, output and router as
    torch.optim.AdamW at muon.adamw_lr."""
    cfg = OptimizerConfig(name="muon", lr=0.02, weight_decay=0.1)
    cfg.muon.adjust_lr, cfg.muon.adamw_lr = adjust_lr, 3e-3
    ours, theirs = named_params(), named_params()
    got = run(build_optimizer(ours, cfg), [p for _, p in ours])
    matrices = [p for n, p in theirs if adamw_reason(n, p) is None]
    assert len(matrices) == 2  # wq and w2, of the seven
    others = [p for n, p in theirs if adamw_reason(n, p) is not None]
    muon = torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust_lr)
    adamw = torch.optim.AdamW(others, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(STEPS):
        grads([p for _, p in theirs], step)
        muon.step()
        adamw.step()
    assert_all_close(got, [p for _, p in theirs], atol=1e-6)


def test_muon_orthogonalises_each_expert_of_a_grouped_weight():
    cfg = OptimizerConfig(name="muon", lr=0.02)
    experts = torch.nn.Parameter(torch.randn(3, 8, 12))
    alone = [torch.nn.Parameter(experts.detach()[i].clone()) for i in range(3)]
    run(build_optimizer([("layers.1.moe.experts.w1", experts)], cfg), [experts], steps=3)
    ref = torch.optim.Muon(alone, lr=0.02, weight_decay=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(1000 + step)
        grad = torch.randn((3, 8, 12), generator=g)
        for i, p in enumerate(alone):
            p.grad = grad[i].clone()
        ref.step()
    assert_all_close(list(experts.detach()), [p.detach() for p in alone], atol=1e-6)


def test_parameter_groups_by_rule():
    cfg = OptimizerConfig(lr=1e-3, weight_decay=0.1, no_decay=["norm", "bias", "embedding"])
    cfg.lr_multipliers = {"embedding": 0.5}
    groups = parameter_groups(named_params(), cfg)
    got = {tuple(g["kinds"]): (g["weight_decay"], g["lr"], len(g["params"])) for g in groups}
    assert got == {
        ("embedding",): (0.0, 5e-4, 1),
        ("matrix", "router", "output"): (0.1, 1e-3, 4),
        ("norm", "bias"): (0.0, 1e-3, 2),
    }
    opt = build_optimizer(named_params(), cfg)
    assert sorted((g["weight_decay"], g["lr"]) for g in opt.param_groups) == [
        (0.0, 5e-4),
        (0.0, 1e-3),
        (0.1, 1e-3),
    ]


@pytest.mark.parametrize(
    "overrides, field, words",
    [
        (["optimizer.name=moun"], "optimizer.name", "did you mean muon?"),
        (["optimizer.name=lion", "optimizer.betas=[0.8,0.9]"], "optimizer.betas", "set optimizer.name=adamw"),
        (["optimizer.name=sgd", "optimizer.muon.momentum=0.9"], "optimizer.muon.momentum", "read by muon"),
        (["optimizer.lion.betas=[0.9,0.9]"], "optimizer.lion.betas", "set optimizer.name=lion"),
        (
            ["optimizer.name=sgd", "optimizer.sgd.momentum=0", "optimizer.sgd.nesterov=true"],
            "nesterov",
            "momentum > 0",
        ),
        (["optimizer.no_decay=[norms]"], "optimizer.no_decay", "kinds are embedding"),
        (
            ["optimizer.name=muon", "optimizer.muon.adjust_lr=rms"],
            "optimizer.muon.adjust_lr",
            "match_rms_adamw",
        ),
        (["optimizer.name=muon", "backend=jax"], "optimizer.name", "backend=jax trains with optax's adamw"),
    ],
)
def test_refused_with_field_value_and_fix(overrides, field, words):
    with pytest.raises(RecipeError) as err:
        load_recipe("debug_cpu", overrides)
    line = next(line for line in str(err.value).splitlines() if field in line)
    assert words in line, line


@pytest.mark.parametrize("decay", ["linear", "sqrt", "cosine"])
@pytest.mark.parametrize("steps, warmup, ratio", [(100, 10, 0.2), (37, 5, 0.5), (20, 3, 0.9), (50, 0, None)])
def test_wsd_equals_torchtitans_own_schedule(decay, steps, warmup, ratio):
    """lr per step against the function TorchTitan 0.3 builds (torchtitan/components/optimizer/
    lr_scheduler.py, from the installed package); 0.9 of 20 steps overlaps warmup: TorchTitan cuts it."""
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    from meshforge.configs.schema import LRSchedulerConfig
    from meshforge.run.train.optim import lr_multiplier

    cfg = LRSchedulersContainer.Config(
        warmup_steps=warmup, decay_ratio=ratio, decay_type=decay, min_lr_factor=0.1
    )
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = cfg.build(optimizers=[opt], training_steps=steps).schedulers[0].lr_lambdas[0]
    ours = LRSchedulerConfig(warmup_steps=warmup, decay=decay, decay_ratio=ratio, min_lr_ratio=0.1)
    got = [lr_multiplier(s, steps, ours) for s in range(steps)]
    assert got == pytest.approx([theirs(s) for s in range(steps)], abs=1e-12)
    if ratio is not None:
        assert got[steps - min(round(steps * ratio), steps - warmup) - 1] == 1.0  # the last stable step


def test_torchtitan_job_file_with_decay_ratio_imports_as_wsd(tmp_path):
    from meshforge.migrate import import_config

    job = tmp_path / "job.toml"
    job.write_text(
        '[model]\nname = "llama3"\nflavor = "debugmodel"\n[training]\nsteps = 100\n'
        '[lr_scheduler]\nwarmup_steps = 10\ndecay_ratio = 0.2\ndecay_type = "sqrt"\nmin_lr_factor = 0.1\n'
    )
    import_config(job, tmp_path / "x.toml", 1)
    text = (tmp_path / "x.toml").read_text()
    assert "decay_ratio = 0.2" in text and 'decay = "sqrt"' in text


@pytest.mark.parametrize("name, states", [("adamw", 2), ("sgd", 1), ("lion", 1), ("muon", None)])
def test_estimated_optimizer_state_is_the_real_state(name, states):
    """The analytic estimate's optimizer bytes against the state tensors a step leaves (debug llama3)."""
    from meshforge.models import count_params, get_model_spec
    from meshforge.run.rank.analytic import optimizer_states

    spec = get_model_spec("llama3")
    args = spec.flavors["debug"]
    model = spec.build(args)
    n = count_params(model)
    opt = build_optimizer(model.named_parameters(), OptimizerConfig(name=name))
    grads(list(model.parameters()), 0)
    opt.step()
    real = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.ndim > 0)
    estimate = 4 * n * optimizer_states(OptimizerConfig(name=name), args, n)
    assert estimate == pytest.approx(real, rel=0.01), (estimate, real)
    if states is not None:
        assert real == 4 * states * n


def test_a_muon_run_records_its_parameter_groups_in_run_json_and_wandb(tmp_path):
    """One process, 3 steps, through the CLI: the groups in run.json and in W&B's offline config."""
    import json

    from support import RECIPES, cli_env, run_cli

    from meshforge.run.observe import wandb_files as wf

    args = [str(RECIPES / "debug_cpu.toml"), "mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1", "train.steps=3"]
    args += [
        "optimizer.name=muon",
        "optimizer.lr=0.02",
        "optimizer.weight_decay=0.1",
        "optimizer.no_decay=[norm,embedding]",
    ]
    args += [f"output_dir={tmp_path}", "run_name=m", "logging.wandb=true", "logging.wandb_mode=offline"]
    proc = run_cli(args, cwd=tmp_path, env=cli_env(WANDB_MODE="offline"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads((tmp_path / "m" / "run.json").read_text())
    groups = {tuple(g["kinds"]): g for g in info["optimizer_groups"]}
    assert (
        groups[("embedding", "norm")]["weight_decay"] == 0.0
        and groups[("embedding", "norm")]["muon_tensors"] == 0
    )
    hidden = groups[("matrix", "output")]  # debug llama3: 4 layers x 7 matrices on Muon, output on AdamW
    assert hidden["weight_decay"] == 0.1 and hidden["n_tensors"] == 29 and hidden["muon_tensors"] == 28
    config = wf.config(wf.run_files(tmp_path / "m")[-1])
    assert config["optimizer_groups"] == info["optimizer_groups"]
    assert config["optimizer"]["name"] == "muon"


def test_traced_estimate_counts_each_optimizers_state_on_fsdp2_and_tp2():
    """The traced estimate (a rank run under fake tensors) holds the state each optimizer's step
    leaves: its optimizer bytes are the analytic states x 4 bytes x the rank's share of parameters."""
    from meshforge.models import args_from_config, count_params, get_model_spec
    from meshforge.run.rank.analytic import optimizer_states
    from meshforge.simulate.estimate import trace_pool, traced_estimate

    with trace_pool() as pool:
        cases = [(name, ["mesh.dp_shard=2", "mesh.tp=1"]) for name in OPTIMIZERS]
        for name, mesh in [*cases, ("muon", ["mesh.dp_shard=1", "mesh.tp=2"])]:
            r = load_recipe("debug_cpu", [*mesh, "mesh.pp=1", f"optimizer.name={name}"])
            args = args_from_config(r.model)
            with torch.device("meta"):
                n = count_params(get_model_spec(r.model.name).build(args))
            want = 4 * optimizer_states(r.optimizer, args, n) * n / 2
            got = traced_estimate(r, pool)["optimizer"]
            assert got == pytest.approx(want, rel=0.01), (name, mesh, got, want)


@pytest.mark.slow
def test_a_muon_checkpoint_from_fsdp2_resumes_on_one_process(tmp_path):
    """Muon's state (momentum per matrix, AdamW's moments for the rest) saved by 2 FSDP ranks at
    step 3 and resumed by one process: steps 4-6 as the uninterrupted run's (NS in float32). The
    groups keep their own lr and weight decay (a resume had set the recipe's optimizer.lr and
    weight_decay in every group: AdamW's half at Muon's lr)."""
    import json

    from support import QUICK, RECIPES, run_recipe

    base = [str(RECIPES / "debug_cpu.toml"), *QUICK, "train.steps=6", "mesh.tp=1", "mesh.pp=1"]
    base += [
        "optimizer.name=muon",
        "optimizer.lr=0.02",
        "optimizer.muon.ns_dtype=float32",
        "optimizer.muon.adamw_lr=3e-3",
        "optimizer.weight_decay=0.1",
        "optimizer.no_decay=[norm]",
        f"output_dir={tmp_path}",
    ]
    saved = [*base, "mesh.dp_shard=2", "run_name=ck", "checkpoint.enabled=true", "checkpoint.interval=3"]
    assert run_recipe(saved, cwd=tmp_path).returncode == 0
    step3 = tmp_path / "ck" / "checkpoints" / "step-00000003"
    resumed = [*base, "mesh.dp_shard=1", "run_name=res", f"checkpoint.load={step3}"]
    proc = run_recipe(resumed, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    def losses(name: str) -> dict[int, float]:
        rows = map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    straight, res = losses("ck"), losses("res")
    assert sorted(res) == [4, 5, 6]
    assert all(abs(res[s] - straight[s]) < 1e-5 for s in res), (res, straight)
