"""One-process training through the real CLI: it learns, and its records read back."""

from __future__ import annotations

import json

import pytest
from support import RECIPES, cli_env, read_metrics, run_cli

SINGLE = ["mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The default recipe on one process, with TensorBoard and offline W&B (no key, no network)."""
    out = tmp_path_factory.mktemp("single")
    home = out / "home"  # no ~/.netrc: meshforge must pick offline by itself, and never prompt
    home.mkdir()
    env = cli_env(HOME=str(home))
    env.pop("WANDB_MODE")
    env.pop("WANDB_API_KEY", None)
    proc = run_cli(
        [str(RECIPES / "debug_cpu.toml"), *SINGLE, f"output_dir={out}", "run_name=learn"],
        cwd=out,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "learn", proc


def test_loss_falls_to_near_the_source_floor(trained):
    run_dir, _ = trained
    rows = read_metrics(run_dir)
    floor = json.loads((run_dir / "run.json").read_text())["summary"]["loss_floor"]
    first, last5 = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert first > 5.0  # about log(256): it starts knowing nothing
    # the default run's own 30 steps (about two minutes on 8 processes) end close to what can be known
    assert last5 < floor + 0.45 and (first - last5) / (first - floor) > 0.85, (first, last5, floor)


def test_metrics_jsonl_has_every_step_and_key(trained):
    rows = read_metrics(trained[0])
    assert [r["step"] for r in rows] == list(range(1, 31))
    for key in (
        "loss",
        "grad_norm",
        "lr",
        "tokens_per_sec",
        "tokens_per_sec_per_device",
        "step_time",
        "memory/rss_gib",
        "memory/max_rss_gib",
        "memory/max_rss_pct",
        "memory_min/max_rss_gib",
        "memory/state_gib",
        "memory_rank/rss_gib",
        "time",  # wall clock: in the record, never charted
    ):
        assert key in rows[0], key
    assert (
        rows[0]["tokens_per_sec"] > 0 and rows[0]["memory/rss_gib"] > 0.05
    )  # GiB: a real process measurement
    assert rows[0]["tokens_per_sec_per_device"] == rows[0]["tokens_per_sec"]  # one process
    # fp32 parameters, gradients and AdamW's two moments: 16 bytes each of the 229,952
    assert rows[-1]["memory/state_gib"] * 2**30 == 16 * 229_952
    assert (
        rows[-1]["tflops_per_device"] > 0 and 0 < rows[-1]["mfu"] < 1
    )  # against this CPU's measured matmul rate
    recipe = json.loads((trained[0] / "run.json").read_text())["recipe"]
    warmup, peak = recipe["lr_scheduler"]["warmup_steps"], recipe["optimizer"]["lr"]
    assert rows[warmup - 2]["lr"] < peak and rows[warmup - 1]["lr"] == pytest.approx(peak)  # end of warmup
    assert rows[-1]["lr"] < rows[10]["lr"]  # cosine decay


def test_run_json_records_recipe_versions_and_status(trained):
    info = json.loads((trained[0] / "run.json").read_text())
    assert info["status"] == "finished" and info["end_time"] >= info["start_time"]
    assert info["recipe"]["train"]["steps"] == 30 and info["mesh"]["dp_shard"] == 1
    assert info["versions"]["torch"].startswith("2.") and info["n_params"] == 229_952
    assert info["summary"]["final_loss"] == read_metrics(trained[0])[-1]["loss"]


def test_summary_throughput_is_tokens_over_time_of_the_steady_steps(trained):
    """The summary's tokens/s is total tokens / total time over the steps it counts (every
    step is logged here, so the rows recompute it); warm-up and the memory-tracking step are
    named, not averaged in; the terminal says which steps it covers."""
    from meshforge.run.observe.record import steady_throughput, step_times_of_rows

    run_dir, proc = trained
    rows, summary = read_metrics(run_dir), json.loads((run_dir / "run.json").read_text())["summary"]
    assert summary["throughput_steps"] == {"counted": 28, "excluded": {"warmup": [1, 2]}}
    counted = rows[2:]
    tokens = sum(r["tokens_per_sec"] * r["step_time"] for r in counted)
    assert summary["tokens_per_sec"] == pytest.approx(tokens / sum(r["step_time"] for r in counted), rel=1e-6)
    assert steady_throughput(step_times_of_rows(rows, 2))["tokens_per_sec"] == pytest.approx(
        summary["tokens_per_sec"], rel=1e-6
    )
    mean_of_rates = sum(r["tokens_per_sec"] for r in counted) / len(counted)
    assert summary["tokens_per_sec"] <= mean_of_rates  # the old average of rates overstated it
    assert "over 28 steps (left out: warmup 1, 2)" in proc.stdout


def test_tensorboard_events_read_back(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(trained[0] / "tensorboard"))
    acc.Reload()
    losses = acc.Scalars("loss")
    assert [e.step for e in losses] == list(range(1, 31))
    assert losses[-1].value == pytest.approx(read_metrics(trained[0])[-1]["loss"], rel=1e-6)
    assert "memory/rss_gib" in acc.Tags()["scalars"] and "time" not in acc.Tags()["scalars"]
    assert "recipe/text_summary" in acc.Tags()["tensors"]  # the resolved recipe as text


def test_wandb_went_offline_by_itself(trained):
    run_dir, proc = trained
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb"))  # the offline run file `wandb sync` uploads later
    assert "offline" in proc.stdout


def test_terminal_shows_progress_and_summary(trained):
    out = trained[1].stdout
    assert "loss floor" in out and "final loss" in out and "step 30/30" in out


def test_same_seed_same_losses_bit_for_bit(tmp_path):
    from meshforge.recipe import load_recipe
    from meshforge.run.train.trainer import train

    common = [
        *SINGLE,
        "train.steps=5",
        f"output_dir={tmp_path}",
        "logging.tensorboard=false",
        "logging.wandb=false",
        "logging.progress=false",
    ]
    a = train(load_recipe(RECIPES / "debug_cpu.toml", [*common, "run_name=a"]))
    b = train(load_recipe(RECIPES / "debug_cpu.toml", [*common, "run_name=b"]))
    c = train(load_recipe(RECIPES / "debug_cpu.toml", [*common, "run_name=c", "seed=1"]))
    assert a.losses == b.losses  # exact equality, not approx
    assert a.losses != c.losses


def test_bf16_autocast_trains_close_to_fp32(tmp_path):
    from meshforge.recipe import load_recipe
    from meshforge.run.train.trainer import train

    common = [
        *SINGLE,
        "train.steps=5",
        f"output_dir={tmp_path}",
        "logging.tensorboard=false",
        "logging.wandb=false",
        "logging.progress=false",
    ]
    fp32 = train(load_recipe(RECIPES / "debug_cpu.toml", [*common, "run_name=f"]))
    bf16 = train(
        load_recipe(RECIPES / "debug_cpu.toml", [*common, "run_name=b", "fsdp.param_dtype=bfloat16"])
    )
    diffs = [abs(x - y) for x, y in zip(fp32.losses, bf16.losses)]
    assert max(diffs) < 2e-2 and max(diffs) > 0  # really ran in bf16, and stayed close


def test_a_second_run_of_the_same_name_keeps_the_first(tmp_path):
    args = [
        str(RECIPES / "debug_cpu.toml"),
        *SINGLE,
        "train.steps=2",
        f"output_dir={tmp_path}",
        "run_name=twice",
        "logging.wandb=false",
        "logging.tensorboard=false",
    ]
    assert run_cli(args, cwd=tmp_path).returncode == 0
    assert run_cli(args, cwd=tmp_path).returncode == 0
    runs = sorted(p.name for p in tmp_path.iterdir())
    assert len(runs) == 2 and runs[0] == "twice"
    assert all(len(read_metrics(tmp_path / r)) == 2 for r in runs)


def test_cpu_offload_on_one_process_wraps_the_model_in_fsdp(tmp_path):
    """fsdp.cpu_offload on one process is FSDP2 on a 1-rank mesh (as TorchTitan does), not
    silently nothing: the parameters are sharded DTensors on the CPU, the model an FSDPModule."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from meshforge.recipe import load_recipe
    from meshforge.run.train.trainer import Trainer

    overrides = [*SINGLE, "fsdp.cpu_offload=true", f"output_dir={tmp_path}", "logging.wandb=false"]
    trainer = Trainer(load_recipe(str(RECIPES / "debug_cpu.toml"), overrides))
    try:
        assert isinstance(trainer.pmodel.parts[0], FSDPModule) and dist.get_world_size() == 1
        assert all(isinstance(p, DTensor) and p.to_local().device.type == "cpu" for p in trainer.params)
        assert trainer.optimizers[0].defaults["fused"]
    finally:
        trainer.loader.close()
        dist.destroy_process_group()


def test_tied_embeddings_stay_one_parameter_after_materializing(tmp_path):
    """`to_empty` (meta -> CPU) gives each module its own tensor: without re-tying, a tied
    model trained two weights (llm_1b: 1.5B parameters, not 1.24B). One parameter, once in the
    optimizer; and the run's own guard refuses a model that came apart."""
    import sys

    import pytest

    from meshforge.recipe import load_recipe
    from meshforge.run.train.trainer import Trainer

    overrides = [*SINGLE, "model.tie_embeddings=true", f"output_dir={tmp_path}", "logging.wandb=false"]
    trainer = Trainer(load_recipe(str(RECIPES / "debug_cpu.toml"), overrides))
    model = trainer.pmodel.parts[0]
    assert model.output.weight is model.tok_embeddings.weight
    in_optimizer = sum(p.numel() for g in trainer.optimizers[0].param_groups for p in g["params"])
    assert in_optimizer == trainer.n_params == 213_568
    trainer.loader.close()

    materialize = sys.modules["meshforge.parallelisms.materialize"]
    retie = materialize.retie
    materialize.retie = lambda model, shared: None  # as before the fix
    try:
        with pytest.raises(RuntimeError, match="trains 229,952 parameters, the model has 213,568"):
            Trainer(load_recipe(str(RECIPES / "debug_cpu.toml"), overrides))
    finally:
        materialize.retie = retie
