"""`meshforge import-config` of DeepSpeed JSON (as DeepSpeed and its examples ship it): ZeRO
stages, pipelines, fp16/bf16, Ulysses, AutoEP and the lr schedules (exact lr of every step) map;
DeepSpeed's own errors are reproduced; what meshforge cannot do is refused with exit 2."""

from __future__ import annotations

import json

import pytest
import tomllib
from support import REPO, run_cli
from support.import_configs import DS, import_and_load

from meshforge.core.errors import UsageError
from meshforge.migrate import ImportRefused, import_config
from meshforge.models import args_from_config
from meshforge.recipe import load_recipe


def test_the_seeds_example_pipeline_fp16_zero0(tmp_path):
    imported, r, text = import_and_load(tmp_path, DS / "seeds_pipeline_fp16.json", 3, model="llama3:debug")
    assert (r.mesh.pp, r.mesh.dp_replicate, r.mesh.dp_shard, r.mesh.tp) == (3, 1, 1, 1)
    # DeepSpeed's 8 accumulation steps of 4 are the pipeline's 8 microbatches of one 32-sample batch
    assert (r.train.global_batch_size, r.train.micro_batch_size, r.train.grad_accum_steps) == (32, 32, 1)
    assert r.pp.microbatches == 8 and r.pp.schedule == "1F1B"
    assert r.fsdp.param_dtype == "float16" and r.loss_scale.dynamic and r.loss_scale.initial == 65536.0
    assert r.loss_scale.growth_interval == 1000  # DeepSpeed's loss_scale_window default, not torch's 2000
    assert r.train.max_norm == 0.0  # DeepSpeed's default: no clipping (meshforge's is 1.0)
    assert r.lr_scheduler.decay == "constant" and r.lr_scheduler.warmup_steps == 0  # no scheduler: constant
    assert "ZeRO 0 -> plain data parallel" in text and "hysteresis = 2" in text
    assert not imported.unsupported and [s.key for s in imported.not_mapped] == ["pipeline.stage_id"]


@pytest.mark.parametrize(
    "name,world,not_mapped",
    [
        # the seeds' file as they wrote it: `stage_id` names the process's own stage
        ("seeds_pipeline_fp16.json", 3, "pipeline.stage_id = 0: this process's stage: meshforge derives"),
        # DeepSpeedExamples' pipeline tutorial (training/pipeline_parallelism/ds_config.json, verbatim)
        (
            "deepspeedexamples_pipeline_ds_config.json",
            2,
            "wall_clock_breakdown = False: a DeepSpeed profiler",
        ),
    ],
)
def test_the_deepspeed_pipeline_examples_import_as_written_through_the_cli(tmp_path, name, world, not_mapped):
    proc = run_cli(
        ["import-config", str(DS / name), f"--world={world}", "--model=llama3:debug", "--out=x.toml"],
        cwd=tmp_path,
        program="meshforge",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listed = proc.stdout.split("not mapped (no effect on the math here):")[1].split("recipe:")[0]
    assert not_mapped in listed and "UNSUPPORTED" not in proc.stdout
    r = load_recipe(tmp_path / "x.toml", world_size=world)
    if name.startswith("seeds"):
        assert (r.mesh.pp, r.pp.microbatches, r.train.global_batch_size) == (3, 8, 32)
    else:  # no stages in the file (the tutorial passes them to PipelineModule): data parallel over 2
        assert (r.mesh.pp, r.mesh.dp_replicate, r.train.grad_accum_steps) == (1, 2, 16)
        assert (r.train.global_batch_size, r.train.micro_batch_size, r.optimizer.lr) == (256, 8, 1e-3)


def test_zero_stages_offload_optimizers_and_schedules_map(tmp_path):
    _, r, text = import_and_load(tmp_path, DS / "zero2_bf16_warmup_decay.json", 4, model="llama3:debug")
    assert (r.mesh.dp_shard, r.fsdp.reshard_after_forward) == (4, False)  # ZeRO 2: kept after forward
    assert (r.train.global_batch_size, r.train.micro_batch_size, r.train.grad_accum_steps) == (64, 8, 2)
    assert r.fsdp.param_dtype == "bfloat16" and r.train.max_norm == 1.0
    assert (r.lr_scheduler.decay, r.lr_scheduler.warmup_steps, r.train.steps) == ("linear", 100, 2000)
    assert r.lr_scheduler.min_lr_ratio == 0.0 and r.optimizer.lr == 3e-4 and r.logging.log_every == 10
    assert "zero_optimization.overlap_comm = True: a ZeRO tuning knob" in text

    imported, r, text = import_and_load(tmp_path, DS / "zero3_offload_fp16_cosine.json", 4, base="debug_cpu")
    assert (r.mesh.dp_shard, r.mesh.pp, r.fsdp.reshard_after_forward, r.fsdp.cpu_offload) == (
        4,
        1,
        True,
        True,
    )
    assert (r.train.global_batch_size, r.train.micro_batch_size, r.train.grad_accum_steps) == (32, 2, 4)
    assert (r.loss_scale.initial, r.loss_scale.growth_interval, r.loss_scale.min_scale) == (4096.0, 500, 0.5)
    assert (
        r.optimizer.betas == [0.9, 0.999] and r.optimizer.weight_decay == 0.01
    )  # Adam's defaults + AdamW mode
    assert (r.lr_scheduler.decay, r.lr_scheduler.min_lr_ratio, r.lr_scheduler.warmup_steps) == (
        "cosine",
        0.1,
        50,
    )
    assert r.model.flavor == "debug" and r.data.source == "synthetic"  # the rest from the base recipe
    assert tomllib.loads(text)["extends"] == str((REPO / "recipes" / "debug_cpu.toml").resolve())

    _, r, text = import_and_load(tmp_path, DS / "zero1_adam_monitors.json", 2, model="llama3:debug")
    assert (r.mesh.dp_shard, r.fsdp.reshard_after_forward) == (2, False)
    assert "ZeRO 1 shards only the optimizer state" in text
    assert (r.train.micro_batch_size, r.train.grad_accum_steps) == (4, 2)  # 16 = 4 x 2 x dp 2
    assert r.optimizer.betas == [0.9, 0.98] and r.optimizer.eps == 1e-6 and r.fsdp.reduce_dtype == "float32"
    assert r.logging.tensorboard and r.logging.wandb and r.logging.wandb_project == "ds-project"
    assert (r.logging.wandb_entity, r.logging.wandb_group) == ("ds-team", "ds-group")
    assert r.activation_checkpoint.mode == "full"

    _, r, _ = import_and_load(tmp_path, DS / "static_loss_scale.json", 8, model="llama3:debug")
    assert (r.mesh.dp_replicate, r.train.micro_batch_size) == (8, 1)  # ZeRO 0 by default; 8 / dp 8
    assert not r.loss_scale.dynamic and r.loss_scale.initial == 128.0
    assert (r.optimizer.lr, r.lr_scheduler.decay, r.lr_scheduler.warmup_steps) == (1e-3, "constant", 10)


def test_what_meshforge_cannot_do_is_refused_with_each_key_and_nothing_written(tmp_path):
    with pytest.raises(ImportRefused) as e:
        import_config(DS / "zeropp_ulysses_moe.json", tmp_path / "x.toml", 16, model="llama3:debug")
    keys = {s.key for s in e.value.imported.unsupported}
    assert {"zero_optimization.zero_quantized_weights", "zero_optimization.zero_hpz_partition_size"} <= keys
    assert "moe.enabled" in keys and e.value.exit_code == 2
    assert "sequence_parallel_size" not in keys  # DeepSpeed-Ulysses imports as mesh.cp (below)
    assert not (tmp_path / "x.toml").exists()

    with pytest.raises(ImportRefused) as e:
        import_config(DS / "log_warmup_default.json", tmp_path / "x.toml", 2, model="llama3:debug")
    why = {s.key: s.why for s in e.value.imported.unsupported}
    assert list(why) == ["zero_optimizaton.stage"]  # the log warmup imports; a typo never passes silently
    assert "check its spelling" in why["zero_optimizaton.stage"]

    # --allow-unmapped writes the recipe, with what was left out at its top
    imported = import_config(
        DS / "log_warmup_default.json", tmp_path / "x.toml", 2, model="llama3:debug", allow_unmapped=True
    )
    text = (tmp_path / "x.toml").read_text()
    assert "# UNSUPPORTED, left out" in text and "zero_optimizaton.stage = 2" in text
    assert len(imported.unsupported) == 1


@pytest.mark.parametrize(
    "name,world,message",
    [
        (
            "inconsistent_batch.json",
            4,
            "micro_batch_per_gpu * gradient_acc_step * world_size 32 != 4 * 3 * 4",
        ),
        ("hf_trainer_auto.json", 4, "'auto' is filled in by the HF Trainer"),
        ("seeds_pipeline_fp16.json", 4, "pipeline.stages = 3 must be a positive divisor of --world 4"),
    ],
)
def test_deepspeed_s_own_errors_are_reproduced(tmp_path, name, world, message):
    with pytest.raises(UsageError) as e:
        import_config(DS / name, tmp_path / "x.toml", world, model="llama3:debug")
    assert message in str(e.value)


def test_deepspeed_ulysses_maps_to_mesh_cp_alltoall(tmp_path):
    """sequence_parallel_size: DeepSpeed-Ulysses is cp.method = alltoall; the batch divides by the
    data-parallel ranks without sp (DeepSpeed's rule), ZeRO 3's partitions become FSDP over dp x cp."""
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    src = tmp_path / "ulysses.json"
    src.write_text(json.dumps({**cfg, "zero_optimization": {"stage": 3}, "sequence_parallel_size": 2}))
    imported, r, text = import_and_load(tmp_path, src, 8, model="llama3:debug")
    assert (r.mesh.dp_shard, r.mesh.cp, r.cp.method, r.train.global_batch_size) == (4, 2, "alltoall", 8)
    assert "cp.method = alltoall (Ulysses)" in text and not imported.unsupported
    src.write_text(json.dumps({**cfg, "sequence_parallel_size": 3}))
    with pytest.raises(UsageError, match="sequence_parallel_size = 3 must be a positive divisor of 8 ranks"):
        import_config(src, tmp_path / "x.toml", 8, model="llama3:debug")


AUTOEP = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 2,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2},
}


def _autoep(tmp_path, world: int, model: str = "qwen3_moe:debug", stage: int = 2, **autoep):
    src = tmp_path / "autoep.json"
    section = {"enabled": True, **autoep}
    src.write_text(json.dumps({**AUTOEP, "zero_optimization": {"stage": stage}, "expert_parallel": section}))
    return import_and_load(tmp_path, src, world, model=model)


def test_deepspeed_autoep_maps_to_mesh_ep(tmp_path):
    """DeepSpeed 0.19's AutoEP section: autoep_size is mesh.ep (consecutive ranks of a stage, as
    meshforge's inner ep of dp_shard x cp), top_k / route_norm / use_grouped_mm the model's fields;
    under ZeRO 0 ep takes FSDP's ranks (ZeRO-2-like), and a disabled section is listed as inert."""
    imported, r, text = _autoep(
        tmp_path,
        8,
        autoep_size=4,
        preset_model="qwen3_moe",
        top_k=4,
        route_norm=False,
        use_grouped_mm=False,
        comm_backend="comm",
        load_balance_coeff=None,
    )
    a = args_from_config(r.model)
    assert (r.mesh.ep, r.mesh.dp_shard, r.mesh.dp_replicate) == (4, 8, 1) and not imported.unsupported
    assert (a.num_experts_per_tok, a.norm_topk_prob, a.grouped_mm, a.num_experts) == (4, False, False, 8)
    assert "expert_parallel.comm_backend = 'comm': the all-to-all's backend" in text
    assert "output_router_logits" in text  # the aux loss is the model's, not the JSON's

    _, r, text = _autoep(tmp_path, 8, stage=0, autoep_size=4)
    assert (r.mesh.ep, r.mesh.dp_shard, r.mesh.dp_replicate, r.fsdp.reshard_after_forward) == (4, 4, 2, False)
    assert "autoep_size = 4 under ZeRO 0" in text

    src = tmp_path / "off.json"
    src.write_text(json.dumps({**AUTOEP, "expert_parallel": {"enabled": False, "autoep_size": 4}}))
    imported, r, text = import_and_load(tmp_path, src, 8, model="qwen3_moe:debug")
    assert r.mesh.ep == 1 and "expert_parallel.autoep_size = 4: AutoEP is off" in text


def test_deepspeed_autoep_refusals(tmp_path):
    """Routing meshforge's MoE does not do is listed by key and value; AutoEP of a dense model is
    refused; DeepSpeed's own AutoEP errors are reproduced."""
    with pytest.raises(ImportRefused) as e:
        _autoep(
            tmp_path,
            8,
            autoep_size=2,
            preset_model="mixtral",
            score_func="sigmoid",
            route_scale=2.5,
            num_expert_groups=4,
            has_shared_experts=True,
            expert_activation="gelu",
        )
    refused = {s.key: s.value for s in e.value.imported.unsupported}
    assert refused == {
        "expert_parallel.preset_model": "mixtral",
        "expert_parallel.score_func": "sigmoid",
        "expert_parallel.route_scale": 2.5,
        "expert_parallel.num_expert_groups": 4,
        "expert_parallel.has_shared_experts": True,
        "expert_parallel.expert_activation": "gelu",
    }
    with pytest.raises(ImportRefused) as e:
        _autoep(tmp_path, 8, model="llama3:debug", autoep_size=2)
    [refused] = e.value.imported.unsupported
    assert refused.key == "expert_parallel.enabled" and "no experts" in refused.why
    for autoep, message in (
        ({"autoep_size": 2, "expert_tensor_parallel_size": 2}, "expert_tensor_parallel_size=2 is reserved"),
        ({"autoep_size": 3}, "(3 * 1 = 3) must divide the stage size (world_size=8 / pp_size=1 = 8)"),
        ({"load_balance_coeff": 0.001}, "load_balance_coeff=0.001 is not supported in this AutoEP build"),
    ):
        with pytest.raises(UsageError) as e:
            _autoep(tmp_path, 8, **autoep)
        assert message in str(e.value)


def test_the_cli_prints_every_unmapped_key_and_exits_2(tmp_path):
    proc = run_cli(
        [
            "import-config",
            str(DS / "zeropp_ulysses_moe.json"),
            "--world=16",
            "--model=llama3:debug",
            "--out=x.toml",
        ],
        cwd=tmp_path,
        program="meshforge",
    )
    assert proc.returncode == 2 and not (tmp_path / "x.toml").exists()
    assert "zero_optimization.zero_quantized_weights = True: ZeRO++ quantized weights" in proc.stdout
    assert "no recipe written" in proc.stderr


SCHEDULES = {
    "cosine, only the two required params (log warmup)": {
        "type": "WarmupCosineLR",
        "params": {"total_num_steps": 40, "warmup_num_steps": 10},
    },
    "cosine, linear from a min ratio": {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": 30,
            "warmup_num_steps": 8,
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.05,
            "warmup_type": "linear",
        },
    },
    "decay, log from a min lr": {
        "type": "WarmupDecayLR",
        "params": {
            "total_num_steps": 30,
            "warmup_num_steps": 7,
            "warmup_min_lr": 1e-4,
            "warmup_max_lr": 2e-3,
        },
    },
    "warmup only, peak from the optimizer, one warmup step (DeepSpeed takes 2)": {
        "type": "WarmupLR",
        "params": {"warmup_num_steps": 1, "warmup_min_lr": 5e-4},
    },
    "warmup only, linear": {
        "type": "WarmupLR",
        "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-3, "warmup_type": "linear"},
    },
}


def _lrs_of_steps(opt, scheduler, steps: int) -> list[float]:
    """The lr each optimizer step runs at, the scheduler stepped after each (both engines' order)."""
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_deepspeed_schedules_import_exactly_lr_of_every_step(tmp_path, name):
    """The imported recipe's lr at every step equals DeepSpeed's own scheduler's, driven as its
    engine drives it (constructed, then stepped after every optimizer step), past the last step."""
    ds = pytest.importorskip("deepspeed.runtime.lr_schedules", reason="the deepspeed extra (.[all])")
    import json

    import torch

    from meshforge.run.train.optim import build_lr_scheduler

    sched = SCHEDULES[name]
    config = {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "scheduler": sched,
    }
    (tmp_path / "ds.json").write_text(json.dumps(config))
    imported = import_config(tmp_path / "ds.json", tmp_path / "x.toml", 2, model="llama3:debug")
    r = load_recipe(tmp_path / "x.toml", world_size=2)
    assert not imported.unsupported and r.lr_scheduler.convention == "deepspeed"
    steps = sched["params"].get("total_num_steps", 20) + 5

    def opt(lr: float):
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)

    # meshforge's optimizer at the recipe's lr (as the trainer builds it), DeepSpeed's at the file's
    ours = _lrs_of_steps(
        o := opt(r.optimizer.lr), build_lr_scheduler(o, r.train.steps, r.lr_scheduler), steps
    )
    theirs = _lrs_of_steps(o := opt(3e-3), getattr(ds, sched["type"])(o, **sched["params"]), steps)
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-18)
    assert len(set(theirs)) > 1  # the schedule moves (not a constant compared with itself)
