"""One experiment, two frameworks: a torch checkpoint resumes under backend=jax, a JAX run's
checkpoint resumes in torch (pipelines included), and a JAX run stopped by SIGTERM resumes on
another mesh, each continuing the same losses as the run that never changed framework. The JAX
run from the torch run's init takes the same steps too, with the torch run's PartitionSpecs, and
`meshforge compare` reads both frameworks' records."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("jax", reason="the jax extra (installed by .[all], as CI does)")
from jax.sharding import PartitionSpec as P  # noqa: E402
from support import RECIPES, cli_env, read_metrics, run_cli  # noqa: E402

from meshforge.configs import recipe_to_dict  # noqa: E402
from meshforge.core.errors import CheckpointError  # noqa: E402
from meshforge.jax.checkpoint import model_refusal, read_torch_checkpoint, state_refusals  # noqa: E402
from meshforge.models import args_from_config  # noqa: E402
from meshforge.recipe import load_recipe  # noqa: E402
from meshforge.run.checkpoint.state import optimizer_changes  # noqa: E402

# every step inside warmup (lr = 3e-2 x (s+1)/100): the LR does not depend on train.steps, so runs
# of different lengths take the same steps
COMMON = [
    str(RECIPES / "debug_cpu.toml"),
    "optimizer.lr=3e-2",
    "optimizer.weight_decay=0.1",  # decoupled decay in both (debug_cpu has none)
    "lr_scheduler.warmup_steps=100",
    "logging.progress=false",
    "logging.wandb=false",
]
TORCH_FSDP_TP = ["mesh.pp=1", "mesh.dp_shard=2", "mesh.tp=2"]
TOL = 1e-5
REFERENCE_STEPS = 24  # the JAX run stopped by SIGTERM (at about step 4) must stop 3 steps before this


def _run(out: Path, name: str, *extra: str) -> None:
    proc = run_cli([*COMMON, f"output_dir={out}", f"run_name={name}", *extra], cwd=out, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]


def _env() -> dict:
    return cli_env(
        **{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    )  # the CLI sets the device count


def _sigterm_after(out: Path, name: str, lines: int, *extra: str) -> subprocess.CompletedProcess:
    """A run stopped by SIGTERM once its metrics hold `lines` steps."""
    exe = Path(sys.executable).parent / "run_recipe"
    args = [*COMMON, f"output_dir={out}", f"run_name={name}", *extra]
    proc = subprocess.Popen(
        [str(exe), *args], cwd=out, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics, deadline = out / name / "metrics.jsonl", time.monotonic() + 180
    while (not metrics.exists() or metrics.read_text().count("\n") < lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metrics.exists() and metrics.read_text().count("\n") >= lines, f"{name} never logged {lines} steps"
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _by_step(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir)}


def _worst(a: dict[int, dict], b: dict[int, dict], steps) -> float:
    """The largest loss or grad-norm difference over `steps`."""
    return max(abs(a[s][k] - b[s][k]) for s in steps for k in ("loss", "grad_norm"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The torch reference (16 steps), JAX from its step 5, a JAX run stopped by SIGTERM and
    resumed on another mesh, and torch on a pipeline from that JAX checkpoint."""
    out = tmp_path_factory.mktemp("jax_resume")
    _run(
        out,
        "torch",
        *TORCH_FSDP_TP,
        f"train.steps={REFERENCE_STEPS}",
        "checkpoint.enabled=true",
        "checkpoint.interval=5",
        "checkpoint.keep_latest=0",
        "eval.every=5",
    )
    torch5 = out / "torch" / "checkpoints" / "step-00000005"
    _run(
        out,
        "jax_from_torch",
        "backend=jax",
        *TORCH_FSDP_TP,
        "train.steps=10",
        f"checkpoint.load={torch5}",
        "eval.every=5",
    )
    stopped = _sigterm_after(
        out,
        "jax",
        3,
        "backend=jax",
        "mesh.pp=1",
        "mesh.dp_shard=4",
        "mesh.tp=1",
        "train.steps=100000",
        "checkpoint.enabled=true",
        "checkpoint.interval=100000",
        "checkpoint.save_at_end=false",
    )
    k = json.loads(next((out / "jax" / "checkpoints").glob("step-*/meta.json")).read_text())["step"]
    assert k + 3 <= REFERENCE_STEPS, f"the JAX run stopped at step {k}, past the torch reference"
    resumed = ["checkpoint.load=auto", f"train.steps={k + 3}"]
    _run(out, "jax", "backend=jax", *TORCH_FSDP_TP, *resumed)
    jax_k = out / "jax" / "checkpoints" / f"step-{k:08d}"
    _run(
        out,
        "torch_from_jax",
        "mesh.pp=2",
        "mesh.dp_shard=2",
        "mesh.tp=1",
        f"train.steps={k + 3}",
        f"checkpoint.load={jax_k}",
    )
    return out, stopped, k


@pytest.mark.slow
def test_a_torch_checkpoint_continues_in_jax_with_the_same_losses(runs):
    """torch FSDP 2 x TP 2 -> JAX dp 2 x tp 2 at step 5: steps 6-10 are the torch run's own, and so
    is the held-out evaluation at step 10."""
    out, _, _ = runs
    torch_rows, jax_rows = _by_step(out / "torch"), _by_step(out / "jax_from_torch")
    assert sorted(jax_rows) == list(range(6, 11))
    assert _worst(torch_rows, jax_rows, range(6, 11)) <= TOL
    assert [jax_rows[s]["lr"] for s in range(6, 11)] == [torch_rows[s]["lr"] for s in range(6, 11)]
    assert [s for s in jax_rows if "eval/loss" in jax_rows[s]] == [10]
    assert abs(jax_rows[10]["eval/loss"] - torch_rows[10]["eval/loss"]) <= TOL
    assert jax_rows[10]["eval/loss"] != torch_rows[5]["eval/loss"]  # evaluated now, not carried over
    info = json.loads((out / "jax_from_torch" / "run.json").read_text())
    assert info["backend"] == "jax" and info["status"] == "finished"
    assert info["param_specs"]["layers.0.attention.wq.weight"] == str(P(("tp", "dp_shard")))  # FSDP in TP
    plots = out / "plots"
    args = [
        "compare",
        str(out / "torch"),
        str(out / "jax_from_torch"),
        "--baseline",
        "torch",
        "--tol",
        "1e-5",
    ]
    proc = run_cli([*args, "--out", str(plots)], cwd=out, program="meshforge")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        "jax_from_torch │ 5 " in proc.stdout
        and "same" in proc.stdout
        and (plots / "loss_vs_step.png").exists()
    )


@pytest.mark.slow
def test_a_stopped_jax_run_resumes_on_another_mesh_and_in_torch_on_a_pipeline(runs):
    """JAX dp 4 stopped by SIGTERM at step k saves it; resumed on dp 2 x tp 2 its records go on from k, and
    torch pp 2 x dp 2 from the same checkpoint: both take the torch reference's steps k+1..k+3."""
    out, stopped, k = runs
    assert stopped.returncode == 130 and "stopped by SIGTERM after step" in stopped.stderr, stopped.stderr[
        -2000:
    ]
    reference = _by_step(out / "torch")
    jax_rows = read_metrics(out / "jax")
    assert [r["step"] for r in jax_rows] == list(range(1, k + 4))  # one record, continued
    jax_rows = {r["step"]: r for r in jax_rows}
    assert _worst(reference, jax_rows, range(1, k + 4)) <= TOL
    torch_rows = _by_step(out / "torch_from_jax")
    assert sorted(torch_rows) == list(range(k + 1, k + 4))
    assert _worst(reference, torch_rows, range(k + 1, k + 4)) <= TOL
    assert _worst(jax_rows, torch_rows, range(k + 1, k + 4)) <= TOL
    meta = json.loads((out / "jax" / "checkpoints" / f"step-{k:08d}" / "meta.json").read_text())
    assert meta["backend"] == "jax" and meta["lr_scheduler"]["last_epoch"] == k
    assert json.loads((out / "jax" / "run.json").read_text())["status"] == "finished"


def test_what_a_jax_run_cannot_continue_is_refused_and_changed_settings_are_said(tmp_path):
    """Another model, another optimizer, an fp16 run's loss scale: refused naming what differs.
    Changed AdamW settings are the recipe's from the resumed step on (as in torch), and listed."""
    recipe = load_recipe(
        str(RECIPES / "debug_cpu.toml"),
        ["backend=jax", "mesh.pp=1", "mesh.dp_shard=2", "mesh.tp=2"],
        world_size=4,
    )
    args = args_from_config(recipe.model)
    meta = {
        "step": 5,
        "recipe": recipe_to_dict(recipe),
        "model_args": dataclasses.asdict(args),
        "loss_scale": None,
        "lr_scheduler": {"last_epoch": 5},
    }
    assert model_refusal(meta, args) is None and state_refusals(meta, recipe) == []
    wider = {**meta, "model_args": {**meta["model_args"], "dim": args.dim * 2}}
    assert f"dim: {args.dim * 2} -> {args.dim}" in model_refusal(wider, args)
    (why,) = state_refusals({**meta, "loss_scale": {"scale": 1024.0}}, recipe)
    assert "fp16" in why and "checkpoint.init_from" in why
    saved = meta["recipe"]["optimizer"]
    assert optimizer_changes({**saved, "betas": [0.8, 0.9]}, recipe.optimizer) == [
        f"optimizer.betas: [0.8, 0.9] -> {list(recipe.optimizer.betas)!r}"
    ]
    assert optimizer_changes(saved, recipe.optimizer) == []
    other = {**meta, "recipe": {**meta["recipe"], "optimizer": {**saved, "name": "sgd"}}}
    (tmp_path / "meta.json").write_text(json.dumps(other))
    with pytest.raises(CheckpointError, match="optimizer is 'sgd' and the recipe's 'adamw'"):
        read_torch_checkpoint(tmp_path, recipe, args, {})


def test_the_mirror_holds_what_torch_s_adamw_and_schedule_hold_after_the_same_steps():
    """A JAX run's checkpoint is written from a torch mirror: its param groups' lr and initial_lr
    and its LR schedule's state are those a torch run has after the same number of steps."""
    import torch

    from meshforge.jax.checkpoint import scheduler_state, torch_mirror
    from meshforge.run.train.optim import build_lr_scheduler, build_optimizer, lr_multiplier

    recipe = load_recipe(str(RECIPES / "debug_cpu.toml"), ["mesh.pp=1", "mesh.dp_shard=1", "mesh.tp=1"])
    steps, args = 7, args_from_config(recipe.model)
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model.parameters(), recipe.optimizer)
    sched = build_lr_scheduler(opt, recipe.train.steps, recipe.lr_scheduler)
    for _ in range(steps):
        opt.step()
        sched.step()
    lr = recipe.optimizer.lr * lr_multiplier(steps, recipe.train.steps, recipe.lr_scheduler)
    assert scheduler_state(recipe, steps, lr) == {**sched.state_dict(), "lr_lambdas": [None]}
    _, mirror = torch_mirror(recipe, args, {}, {}, {}, steps, lr)
    for key in ("lr", "initial_lr", "betas", "eps", "weight_decay", "fused", "foreach"):
        assert mirror.param_groups[0][key] == opt.param_groups[0][key], key


def test_jax_runs_save_synchronously_and_start_from_meshforge_checkpoints_only(tmp_path):
    base = [str(RECIPES / "debug_cpu.toml"), "backend=jax", "mesh.pp=1", "--dry-run"]
    for extra, field in (
        (["checkpoint.enabled=true", "checkpoint.async_save=true"], "checkpoint.async_save"),
        ([f"checkpoint.init_from_hf={tmp_path}"], "checkpoint.init_from_hf"),
        (["fsdp.param_dtype=float16"], "loss scaling, which is torch-only"),
        (["fsdp.param_dtype=bfloat16", "fsdp.reduce_dtype=bfloat16"], "fsdp.reduce_dtype"),
        (["fsdp.param_dtype=bfloat16", "mesh.dp_shard=1", "mesh.tp=2"], "autocasts instead"),
    ):
        proc = run_cli([*base, *extra], cwd=tmp_path)
        assert proc.returncode == 2 and field in proc.stderr, proc.stderr


@pytest.mark.slow
def test_a_corpus_run_continues_in_jax_on_the_same_windows(tmp_path):
    """text_cpu (files + its tokenizer) on FSDP 2 x TP 2: JAX reads each dp rank's part of the
    corpus as the torch ranks do (one global batch of their windows), so from the torch run's step
    3 it takes the same steps 4-6 and evaluates the same held-out windows."""
    common = [
        str(RECIPES / "text_cpu.toml"),
        *TORCH_FSDP_TP,
        *[
            "train.steps=6",
            "eval.every=3",
            "logging.log_every=1",
            "logging.progress=false",
            "logging.wandb=false",
        ],
        f"output_dir={tmp_path}",
    ]
    env = _env()
    args = [
        *common,
        "run_name=torch",
        "checkpoint.enabled=true",
        "checkpoint.interval=3",
        "checkpoint.keep_latest=0",
    ]
    proc = run_cli(args, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch3 = tmp_path / "torch" / "checkpoints" / "step-00000003"
    assert "data_corpus" in json.loads((torch3 / "meta.json").read_text())  # every dp rank's position
    proc = run_cli(
        [*common, "run_name=jax", "backend=jax", f"checkpoint.load={torch3}"], cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch_rows, jax_rows = _by_step(tmp_path / "torch"), _by_step(tmp_path / "jax")
    assert sorted(jax_rows) == [4, 5, 6] and _worst(torch_rows, jax_rows, range(4, 7)) <= TOL
    assert abs(jax_rows[6]["eval/loss"] - torch_rows[6]["eval/loss"]) <= TOL
