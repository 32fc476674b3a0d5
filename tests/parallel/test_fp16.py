"""fp16 with dynamic loss scaling: the scale's rule, a forced overflow that skips the update,
parity with fp32 on dp 2, tp 2 and pp 2, the scale in every logger and across a resume."""

from __future__ import annotations

import json
import math

import pytest
import torch
from support import QUICK, RECIPES, cli_env, read_metrics, run_cli, run_recipe

from meshforge.configs.schema import LossScaleConfig
from meshforge.run.observe import wandb_files as wf
from meshforge.run.train.loss_scale import LossScaler

ONE_RANK = ["mesh.dp_replicate=1", "mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1"]
FP16 = ["fsdp.param_dtype=float16"]


def test_scale_backs_off_on_overflow_grows_after_clean_steps_and_stops_at_its_floor():
    s = LossScaler(LossScaleConfig(initial=1024.0, growth_interval=2, min_scale=256.0), enabled=True)
    assert (
        s.judge(loss_finite=True, grads_finite=False) == "overflow" and s.scale == 512.0 and s.overflows == 1
    )
    assert s.judge(loss_finite=True, grads_finite=True) == "ok" and s.scale == 512.0
    assert (
        s.judge(loss_finite=True, grads_finite=True) == "ok" and s.scale == 1024.0
    )  # two clean steps: grown
    assert s.judge(loss_finite=True, grads_finite=False) == "overflow" and s.scale == 512.0
    assert s.judge(loss_finite=True, grads_finite=False) == "overflow" and s.scale == 256.0
    assert (
        s.judge(loss_finite=True, grads_finite=False) == "bad" and s.scale == 256.0
    )  # at the floor: a bad step
    assert (
        s.overflows == 4 and s.judge(loss_finite=False, grads_finite=True) == "bad" and s.overflows == 4
    )  # no overflow
    restored = LossScaler(LossScaleConfig(), enabled=True)
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == {"scale": 256.0, "clean_steps": 0, "overflows": 4}

    fixed = LossScaler(LossScaleConfig(dynamic=False, initial=128.0, growth_interval=1), enabled=True)
    assert (
        fixed.judge(loss_finite=True, grads_finite=True) == "ok"
        and fixed.judge(loss_finite=True, grads_finite=False) == "bad"
        and fixed.scale == 128.0
    )
    off = LossScaler(LossScaleConfig(initial=1024.0), enabled=False)
    assert (
        off.scale == 1.0
        and off.judge(loss_finite=True, grads_finite=False) == "bad"
        and off.metrics(1.0) == {}
    )


def test_a_forced_overflow_skips_the_update_and_halves_the_scale(tmp_path):
    """One process, fp16 autocast, a loss scale no fp16 gradient survives: the step applies
    nothing (weights, AdamW state, lr schedule untouched); at a sane scale the next one does."""
    from meshforge.recipe import load_recipe
    from meshforge.run.train.trainer import Trainer

    overrides = [*ONE_RANK, *QUICK, *FP16, "loss_scale.initial=1e12", f"output_dir={tmp_path}"]
    trainer = Trainer(load_recipe(str(RECIPES / "debug_cpu.toml"), overrides))
    try:
        before = [p.detach().clone() for p in trainer.params]
        out = trainer.train_step(1)
        assert out.overflow and not out.finite and math.isnan(float(out.grad_norm))
        assert math.isfinite(float(out.loss)) and out.loss_scale == {"loss_scale": 1e12, "overflow_steps": 1}
        assert trainer.scaler.scale == 5e11
        assert all(torch.equal(a, p) for a, p in zip(before, trainer.params))  # no update applied
        assert not trainer.optimizers[0].state  # AdamW never stepped
        assert trainer.schedulers[0].last_epoch == 0

        trainer.scaler.scale = 1024.0
        out = trainer.train_step(3)  # (not logging.memory_breakdown_step, 2)
        assert out.finite and not out.overflow and math.isfinite(float(out.grad_norm))
        assert not all(torch.equal(a, p) for a, p in zip(before, trainer.params))
    finally:
        trainer.loader.close()


# --- launched as a user launches them ------------------------------------------------------

STEPS = 20
LOSS_TOL = 1e-3  # fp16 vs fp32 over 20 steps, measured: 4e-5 (tp 2, pp 2), 2.3e-4 (FSDP 2)


def _launch(out, name: str, overrides: list[str], env: dict | None = None):
    """One run: the program when the test sets its environment, else support.run_recipe."""
    args = [str(RECIPES / "debug_cpu.toml"), *ONE_RANK, *QUICK, f"output_dir={out}", f"run_name={name}"]
    if env is None:
        proc = run_recipe([*args, *overrides], cwd=out)
    else:
        proc = run_cli([*args, *overrides], cwd=out, env=env, timeout=600)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return read_metrics(out / name), proc


@pytest.fixture(scope="module")
def fp32_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp16")
    return out, _launch(out, "fp32", [f"train.steps={STEPS}"])[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,mesh",
    [
        ("dp2", ["mesh.dp_shard=2"]),  # FSDP2's fp16 MixedPrecisionPolicy
        ("tp2", ["mesh.tp=2"]),  # autocast over DTensors, loss parallel
        ("pp2", ["mesh.pp=2", "pp.schedule=1F1B"]),  # the scale rides in the schedule's loss
    ],
)
def test_fp16_follows_fp32(name, mesh, fp32_rows):
    out, base = fp32_rows
    rows, _ = _launch(out, name, [*mesh, *FP16, f"train.steps={STEPS}"])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    dloss = max(abs(a["loss"] - b["loss"]) for a, b in zip(rows, base))
    dnorm = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(rows, base))
    assert 1e-6 < dloss < LOSS_TOL and dnorm < LOSS_TOL, (
        f"{name}: |dloss| {dloss:.2e}, rel |dnorm| {dnorm:.2e}"
    )
    assert all(r["loss_scale"] == 65536.0 and r["overflow_steps"] == 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.05  # it trained


@pytest.mark.slow
def test_overflows_are_skipped_on_every_stage_logged_everywhere_and_the_scale_resumes(tmp_path):
    """pp 2 with a loss scale too large at first: the steps that overflow are skipped by both
    stages, the scale halves each time and grows back after clean steps; TensorBoard and W&B
    show it, and a resume from step 5 continues the very same scale and losses."""
    common = [
        "mesh.pp=2",
        *FP16,
        "loss_scale.initial=16777216",  # 2**24: overflows on this model until ~2**20
        "loss_scale.growth_interval=3",
        "train.steps=10",
        "checkpoint.enabled=true",
        "checkpoint.interval=5",
        "logging.tensorboard=true",
        "logging.wandb=true",
        "logging.progress=true",  # the terminal as a user sees it
    ]
    env = cli_env(WANDB_MODE="offline")
    rows, proc = _launch(tmp_path, "a", common, env)
    scales = [r["loss_scale"] for r in rows]
    overflowed = [r["step"] for r in rows if not math.isfinite(r["grad_norm"])]
    assert overflowed and overflowed[0] == 1, scales
    assert rows[-1]["overflow_steps"] == len(overflowed) < 10
    for prev, row in zip(rows, rows[1:]):
        if prev["step"] in overflowed:  # halved after every overflow, and the schedule waited
            assert row["loss_scale"] == prev["loss_scale"] / 2 and row["lr"] == prev["lr"]
        else:  # an applied step: the warmup moved on, the scale kept or (clean stretch) doubled
            assert row["lr"] > prev["lr"] and row["loss_scale"] in (
                prev["loss_scale"],
                2 * prev["loss_scale"],
            )
    assert any(b == 2 * a for a, b in zip(scales, scales[1:]))  # grown back after 3 clean steps
    assert "fp16 gradients overflowed at loss scale 1.67772e+07" in proc.stdout + proc.stderr

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "a" / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss_scale")] == scales
    history = [h for h in wf.history(wf.run_files(tmp_path / "a")) if "loss_scale" in h]
    assert [h["loss_scale"] for h in history] == scales
    assert [h["overflow_steps"] for h in history] == [r["overflow_steps"] for r in rows]
    summary = json.loads((tmp_path / "a" / "run.json").read_text())["summary"]
    assert summary["overflow_steps"] == len(overflowed) and summary["loss_scale"] > 0
    meta = json.loads((tmp_path / "a" / "checkpoints" / "step-00000005" / "meta.json").read_text())
    assert meta["loss_scale"]["scale"] == scales[5]  # the scale step 6 ran with

    ckpt = tmp_path / "a" / "checkpoints" / "step-00000005"
    resumed, _ = _launch(tmp_path, "b", [*common, "logging.wandb=false", f"checkpoint.load={ckpt}"], env)
    assert [r["step"] for r in resumed] == list(range(6, 11))
    for a, b in zip(rows[5:], resumed):
        assert (a["loss_scale"], a["overflow_steps"]) == (b["loss_scale"], b["overflow_steps"])
        assert abs(a["loss"] - b["loss"]) < 1e-6
