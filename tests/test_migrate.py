"""`meshforge import-config`: DeepSpeed JSON and TorchTitan 0.2 job files (as those projects
ship them, in tests/configs/) -> recipes that validate, carry the math over, list every key
that did not map, and refuse what meshforge cannot do with exit 2 and no file written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tomllib
from conftest import REPO, read_metrics, run_cli, run_recipe

from meshforge.configs import RecipeError
from meshforge.core.errors import UsageError
from meshforge.migrate import ImportRefused, import_config
from meshforge.models import args_from_config
from meshforge.recipe import load_recipe

DS = REPO / "tests" / "configs" / "deepspeed"
TITAN = REPO / "tests" / "configs" / "torchtitan_0.2"


def _import(tmp_path, src: Path, world: int | None, **kw):
    out = tmp_path / (src.stem + ".toml")
    imported = import_config(src, out, world, **kw)
    return imported, load_recipe(out, world_size=world), out.read_text()


def test_the_seeds_example_pipeline_fp16_zero0(tmp_path):
    imported, r, text = _import(tmp_path, DS / "seeds_pipeline_fp16.json", 3, model="llama3:debug")
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
    _, r, text = _import(tmp_path, DS / "zero2_bf16_warmup_decay.json", 4, model="llama3:debug")
    assert (r.mesh.dp_shard, r.fsdp.reshard_after_forward) == (4, False)  # ZeRO 2: kept after forward
    assert (r.train.global_batch_size, r.train.micro_batch_size, r.train.grad_accum_steps) == (64, 8, 2)
    assert r.fsdp.param_dtype == "bfloat16" and r.train.max_norm == 1.0
    assert (r.lr_scheduler.decay, r.lr_scheduler.warmup_steps, r.train.steps) == ("linear", 100, 2000)
    assert r.lr_scheduler.min_lr_ratio == 0.0 and r.optimizer.lr == 3e-4 and r.logging.log_every == 10
    assert "zero_optimization.overlap_comm = True: a ZeRO tuning knob" in text

    imported, r, text = _import(tmp_path, DS / "zero3_offload_fp16_cosine.json", 4, base="debug_cpu")
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

    _, r, text = _import(tmp_path, DS / "zero1_adam_monitors.json", 2, model="llama3:debug")
    assert (r.mesh.dp_shard, r.fsdp.reshard_after_forward) == (2, False)
    assert "ZeRO 1 shards only the optimizer state" in text
    assert (r.train.micro_batch_size, r.train.grad_accum_steps) == (4, 2)  # 16 = 4 x 2 x dp 2
    assert r.optimizer.betas == [0.9, 0.98] and r.optimizer.eps == 1e-6 and r.fsdp.reduce_dtype == "float32"
    assert r.logging.tensorboard and r.logging.wandb and r.logging.wandb_project == "ds-project"
    assert (r.logging.wandb_entity, r.logging.wandb_group) == ("ds-team", "ds-group")
    assert r.activation_checkpoint.mode == "full"

    _, r, _ = _import(tmp_path, DS / "static_loss_scale.json", 8, model="llama3:debug")
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


def test_files_that_are_not_configs_are_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(UsageError, match="is not JSON"):
        import_config(bad, tmp_path / "x.toml", 2, model="llama3:debug")
    other = tmp_path / "other.json"
    other.write_text('{"name": "my-package", "version": "1.0"}')
    with pytest.raises(UsageError, match="does not look like a DeepSpeed config"):
        import_config(other, tmp_path / "x.toml", 2, model="llama3:debug")
    with pytest.raises(UsageError, match="names no model"):
        import_config(DS / "static_loss_scale.json", tmp_path / "x.toml", 8)
    toml = tmp_path / "x.toml"
    toml.write_text('[tool.poetry]\nname = "x"\n')
    with pytest.raises(UsageError, match="does not look like a TorchTitan job file"):
        import_config(toml, tmp_path / "y.toml", 2)


def test_torchtitan_job_files_map_with_titan_s_defaults(tmp_path):
    imported, r, text = _import(tmp_path, TITAN / "debug_model.toml", 8)
    assert (r.model.dim, r.model.n_layers, r.model.n_heads, r.model.vocab_size) == (256, 6, 16, 2048)
    assert r.model.rope_scaling_factor == 8.0 and r.model.rope_theta == 500000.0
    assert (r.mesh.dp_shard, r.mesh.tp, r.mesh.pp) == (8, 1, 1) and r.fsdp.reshard_after_forward
    assert (r.train.micro_batch_size, r.train.seq_len, r.train.steps) == (8, 2048, 10)
    assert (r.lr_scheduler.warmup_steps, r.lr_scheduler.decay, r.lr_scheduler.min_lr_ratio) == (
        2,
        "linear",
        0.0,
    )
    assert (
        r.optimizer.lr == 8e-4 and r.optimizer.weight_decay == 0.1
    )  # TorchTitan's default decay, written out
    assert r.fsdp.param_dtype == "bfloat16"  # TorchTitan's default mixed precision under FSDP
    assert (r.activation_checkpoint.mode, r.activation_checkpoint.selective_every) == ("selective", 2)
    assert "training.dataset = 'c4_test'" in text and not imported.unsupported
    assert r.train.gc_every == 50  # TorchTitan's gc_freq default: its collector paced as theirs

    _, r, text = _import(tmp_path, TITAN / "llama3_8b.toml", 64)
    assert r.model.flavor == "8b" and r.model.dim is None  # meshforge's 8b is TorchTitan's 8B: no overrides
    assert set(tomllib.loads(text)["model"]) == {"name", "flavor", "max_seq_len"}
    assert r.activation_checkpoint.mode == "op" and "meshforge's per-op AC, TorchTitan's policy" in text
    assert (r.train.seq_len, r.train.steps, r.lr_scheduler.warmup_steps) == (8192, 1000, 200)

    _, r, _ = _import(tmp_path, TITAN / "llama3_70b.toml", 64)
    assert r.model.flavor == "70b" and args_from_config(r.model).n_layers == 80

    # without data parallelism TorchTitan trains in fp32: so does the import
    _, r, text = _import(tmp_path, TITAN / "debug_model.toml", 1)
    assert r.mesh.dp_shard == 1 and r.fsdp.param_dtype == "float32"
    assert "applies only under FSDP in TorchTitan" in text


def test_deepspeed_ulysses_maps_to_mesh_cp_alltoall(tmp_path):
    """sequence_parallel_size: DeepSpeed-Ulysses is cp.method = alltoall; the batch divides by the
    data-parallel ranks without sp (DeepSpeed's rule), ZeRO 3's partitions become FSDP over dp x cp."""
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    src = tmp_path / "ulysses.json"
    src.write_text(json.dumps({**cfg, "zero_optimization": {"stage": 3}, "sequence_parallel_size": 2}))
    imported, r, text = _import(tmp_path, src, 8, model="llama3:debug")
    assert (r.mesh.dp_shard, r.mesh.cp, r.cp.method, r.train.global_batch_size) == (4, 2, "alltoall", 8)
    assert "cp.method = alltoall (Ulysses)" in text and not imported.unsupported
    src.write_text(json.dumps({**cfg, "sequence_parallel_size": 3}))
    with pytest.raises(UsageError, match="sequence_parallel_size = 3 must be a positive divisor of 8 ranks"):
        import_config(src, tmp_path / "x.toml", 8, model="llama3:debug")


def test_torchtitan_context_parallel_maps_to_mesh_cp(tmp_path):
    """TorchTitan's own debug job with its context-parallel degree raised to 2 (that one line
    changed, and a rotate method added): FSDP takes the rest of the world after cp, and both rotate
    methods (K/V gathered, or passed around a ring) map to allgather."""
    text = (TITAN / "debug_model.toml").read_text()
    assert text.count("context_parallel_degree = 1") == 1
    text = text.replace("context_parallel_degree = 1", "context_parallel_degree = 2")
    (tmp_path / "titan").mkdir()
    job = tmp_path / "titan" / "cp_job.toml"
    job.write_text(text)
    _, r, _ = _import(tmp_path, job, 8)
    assert (r.mesh.dp_shard, r.mesh.cp, r.mesh.tp, r.cp.method) == (4, 2, 1, "allgather")
    rotate = 'context_parallel_rotate_method = "alltoall"\n'
    job.write_text(text.replace("context_parallel_degree = 2\n", "context_parallel_degree = 2\n" + rotate))
    _, r, written = _import(tmp_path, job, 8)
    assert r.cp.method == "allgather" and "the same attention, other traffic" in written
    job.write_text(text.replace("[training]\n", "[training]\ngc_freq = 7\n"))
    assert _import(tmp_path, job, 8)[1].train.gc_every == 7  # a job's own gc_freq is kept


@pytest.mark.parametrize(
    "model, says",
    [("nope:debug", "no model family 'nope'; families: llama3"), ("llama3:nope", "no flavor 'nope'")],
)
def test_an_unknown_model_is_named_with_the_choices(tmp_path, model, says):
    with pytest.raises(UsageError, match=says):  # was a KeyError's traceback
        import_config(DS / "seeds_pipeline_fp16.json", tmp_path / "x.toml", 3, model=model)


def test_torchtitan_float8_maps_to_the_float8_section(tmp_path):
    """TorchTitan's own debug job with its commented converters line turned on, as a user would:
    its [quantize.linear.float8] section (filter_fqns = ["output"], no float8 all-gather) becomes
    [float8]: tensorwise (torchao's default, recipe_name unset), the output kept; the float8
    all-gather, which meshforge does not implement, is refused when asked for."""
    text = (TITAN / "debug_model.toml").read_text()
    assert text.count('# converters = ["float8"]') == 1
    text = text.replace('# converters = ["float8"]', 'converters = ["float8"]')
    (tmp_path / "titan").mkdir()
    job = tmp_path / "titan" / "f8_job.toml"
    job.write_text(text)
    _, r, written = _import(tmp_path, job, 8)
    assert (r.float8.enabled, r.float8.recipe, r.float8.exclude) == (True, "tensorwise", ["output"])
    assert "name is or ends in it" in written
    job.write_text(
        text.replace("enable_fsdp_float8_all_gather = false", "enable_fsdp_float8_all_gather = true")
    )
    with pytest.raises(ImportRefused) as e:
        import_config(job, tmp_path / "x.toml", 8)
    assert [s.key for s in e.value.imported.unsupported] == [
        "quantize.linear.float8.enable_fsdp_float8_all_gather"
    ]


def test_torchtitan_refusals(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(
        '[model]\nname = "llama3"\nflavor = "debugmodel"\nconverters = ["mx"]\n'
        "[training]\nsteps = 100\n[parallelism]\nexpert_parallel_degree = 2\n"
        '[lr_scheduler]\nwarmup_steps = 10\ndecay_ratio = 0.5\ndecay_type = "step"\n[made_up]\nkey = 1\n'
    )
    with pytest.raises(ImportRefused) as e:
        import_config(job, tmp_path / "x.toml", 8)
    why = {s.key: s.why for s in e.value.imported.unsupported}
    assert set(why) == {
        "model.converters",
        "lr_scheduler.decay_type",
        "made_up.key",
    }
    assert "linear, sqrt or cosine" in why["lr_scheduler.decay_type"]  # decay_ratio imports (WSD)
    # expert parallel of a dense model: TorchTitan builds the mesh and nothing uses it
    inert = {s.key: s.why for s in e.value.imported.not_mapped}
    assert "the model has no experts" in inert["parallelism.expert_parallel_degree"]


def _titan_moe_job(tmp_path, flavor: str = "debugmodel_moe", training: str = "", **parallelism) -> Path:
    """TorchTitan's Qwen3 MoE debug job with its flavor line and the given [parallelism] lines
    changed (each replaces the file's own line of that key), and lines added to [training]."""
    text = (TITAN / "qwen3_moe_debug.toml").read_text()
    assert text.count('flavor = "debugmodel_moe"') == 1
    text = text.replace('flavor = "debugmodel_moe"', f'flavor = "{flavor}"')
    text = text.replace("[training]\n", f"[training]\n{training}")
    for key, value in parallelism.items():
        text, n = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
        assert n == 1, key
    job = tmp_path / "titan" / f"{flavor}.toml"
    job.parent.mkdir(exist_ok=True)
    job.write_text(text)
    return job


def test_torchtitan_qwen3_moe_debug_job_imports_as_written(tmp_path):
    """TorchTitan's own Qwen3 MoE job (torchtitan/models/qwen3/train_configs/qwen3_moe_debug.toml at
    v0.2.0, verbatim): its debugmodel_moe (64 experts, top-8, every block sparse) becomes meshforge's
    qwen3_moe with every difference from its debug flavor overridden, balanced as 0.2 trains it (an
    expert bias that nothing moves: aux_free at rate 0, no aux loss)."""
    imported, r, text = _import(tmp_path, TITAN / "qwen3_moe_debug.toml", 8)
    a = args_from_config(r.model)
    assert (r.model.name, r.model.flavor, r.mesh.ep, r.mesh.dp_shard) == ("qwen3_moe", "debug", 1, 8)
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim, a.vocab_size) == (
        256,
        8,
        16,
        8,
        128,
        2048,
    )
    assert (a.num_experts, a.num_experts_per_tok, a.moe_dim, a.n_moe_layers) == (64, 8, 768, 8)
    assert a.norm_topk_prob and not a.tie_embeddings and a.rope_theta == 1e6
    assert (a.load_balance, a.bias_update_rate) == ("aux_free", 0.0)
    assert "never moves" in text and "pytorch/torchtitan#3666" in text
    assert r.activation_checkpoint.mode == "op"  # selective AC by op: meshforge's per-op AC (ep 1)
    assert not imported.unsupported and "quantize.linear.float8.filter_fqns" in text


def test_torchtitan_expert_parallel_maps_to_mesh_ep(tmp_path):
    """expert_parallel_degree is mesh.ep (both borrow the inner ranks of dp_shard x cp); TorchTitan's
    30B-A3B and 235B-A22B are meshforge's flavors of the same shape. With tp > 1, expert tensor
    parallel = tp imports ep as it is and etp = 1 (ep across the tp ranks too) as ep / tp: meshforge
    runs the MoE whole on every tp rank, the same math either way, noted."""
    job = _titan_moe_job(tmp_path, "30B-A3B", expert_parallel_degree=4)
    imported, r, text = _import(tmp_path, job, 8)
    assert (r.model.flavor, r.mesh.ep, r.mesh.dp_shard, r.mesh.tp) == ("30b-a3b", 4, 8, 1)
    model = tomllib.loads(text)["model"]
    assert model == {
        "name": "qwen3_moe",
        "flavor": "30b-a3b",
        "load_balance": "aux_free",
        "bias_update_rate": 0.0,
        "max_seq_len": 4096,
    }
    assert not imported.unsupported

    job = _titan_moe_job(
        tmp_path,
        "30B-A3B",
        tensor_parallel_degree=2,
        expert_parallel_degree=4,
        expert_tensor_parallel_degree=2,
    )
    _, r, text = _import(tmp_path, job, 16)
    assert (r.mesh.ep, r.mesh.dp_shard, r.mesh.tp) == (4, 8, 2)
    assert "TorchTitan splits every expert over the tp ranks" in text

    job = _titan_moe_job(tmp_path, "30B-A3B", tensor_parallel_degree=2, expert_parallel_degree=4)
    _, r, text = _import(tmp_path, job, 16)  # etp = 1, TorchTitan's default
    assert (r.mesh.ep, r.mesh.dp_shard, r.mesh.tp) == (2, 8, 2)
    assert "mesh.ep = 4 / tp 2 = 2" in text

    job = _titan_moe_job(tmp_path, "235B-A22B", expert_parallel_degree=8)
    _, r, _ = _import(tmp_path, job, 16)
    a = args_from_config(r.model)
    assert (r.model.flavor, r.mesh.ep, a.n_layers, a.moe_dim) == ("235b-a22b", 8, 94, 1536)
    assert a.rope_theta == 5e6  # TorchTitan's flavor, not the published config's 1e6


def test_torchtitan_moe_refusals(tmp_path):
    """What meshforge's MoE does not do is listed by key and value; TorchTitan's own ep rules are
    its errors; a Qwen3 flavor without experts or another MoE family is not imported."""
    job = _titan_moe_job(tmp_path, training="debug_moe_force_load_balance = true\n")
    with pytest.raises(ImportRefused) as e:
        import_config(job, tmp_path / "x.toml", 8)
    [refused] = e.value.imported.unsupported
    assert (refused.key, refused.value) == ("training.debug_moe_force_load_balance", True)
    assert "round-robin" in refused.why

    for flavor in ("0.6B", "debugmodel"):  # TorchTitan's dense Qwen3 flavors
        with pytest.raises(ImportRefused) as e:
            import_config(_titan_moe_job(tmp_path, flavor), tmp_path / "x.toml", 8)
        [refused] = e.value.imported.unsupported
        assert (refused.key, refused.value) == ("model.flavor", f"qwen3/{flavor}")
        assert "qwen3's (debugmodel_moe, 30B-A3B, 235B-A22B)" in refused.why

    job = _titan_moe_job(
        tmp_path, tensor_parallel_degree=2, expert_parallel_degree=4, expert_tensor_parallel_degree=4
    )
    with pytest.raises(UsageError, match="TorchTitan supports only ETP=TP or ETP=1"):
        import_config(job, tmp_path / "x.toml", 16)
    job = _titan_moe_job(tmp_path, expert_parallel_degree=3)
    with pytest.raises(UsageError, match="must be a multiple of cp = 1 and divide dp_shard x cp = 8"):
        import_config(job, tmp_path / "x.toml", 8)
    job = _titan_moe_job(tmp_path, tensor_parallel_degree=4, expert_parallel_degree=2)  # etp = 1
    with pytest.raises(UsageError, match="multiple of cp x tp = 4 and divide dp_shard x cp x tp = 8"):
        import_config(job, tmp_path / "x.toml", 8)
    # mesh.ep must still divide the experts: meshforge's own rule, from the recipe check
    job = _titan_moe_job(tmp_path, expert_parallel_degree=128)
    with pytest.raises(RecipeError, match="mesh.ep"):
        import_config(job, tmp_path / "x.toml", 128)
    assert not (tmp_path / "x.toml").exists()


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
    return _import(tmp_path, src, world, model=model)


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
    imported, r, text = _import(tmp_path, src, 8, model="qwen3_moe:debug")
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


@pytest.mark.slow
def test_imported_recipes_run(tmp_path):
    """The seeds' DeepSpeed example (3 pipeline stages, fp16), TorchTitan's debug job and its Qwen3
    MoE job with expert parallel 2, imported and run as a user would, on CPU processes (sizes
    overridden for the laptop)."""
    small_moe = ["model.num_experts=8", "model.num_experts_per_tok=2", "model.moe_dim=64"]
    cases = [
        (DS / "seeds_pipeline_fp16.json", ["--world", "3", "--model", "llama3:debug"], 3, []),
        (TITAN / "debug_model.toml", ["--world", "2"], 2, []),
        (_titan_moe_job(tmp_path, expert_parallel_degree=2), ["--world", "2"], 2, small_moe),
    ]
    for src, flags, world, sizes in cases:
        out = tmp_path / f"{src.stem}.toml"
        proc = run_cli(
            ["import-config", str(src), *flags, "--out", str(out)], cwd=tmp_path, program="meshforge"
        )
        assert proc.returncode == 0, proc.stderr
        run = run_recipe(
            [str(out), "train.steps=4", "train.seq_len=32", "logging.wandb=false", f"output_dir={tmp_path}"]
            + sizes,
            cwd=tmp_path,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        rows = read_metrics(tmp_path / src.stem)
        assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["loss"] > 0 for r in rows)
        assert f"on {world} x cpu" in run.stdout
    assert all(r["moe/tokens_dropped"] == 0 for r in rows)  # the MoE job's, on mesh.ep = 2


@pytest.mark.slow
def test_titan_flavors_import_as_torchtitan_builds_them():
    """The imported TorchTitan flavors (Llama 3 and Qwen3 MoE) have TorchTitan's own parameter counts
    (0.3.0's builders)."""
    pytest.importorskip("triton")  # TorchTitan imports on the CPU build only with triton
    pytest.importorskip("torchtitan", reason="the titan extra (installed by .[all], as CI does)")
    import torch
    from torchtitan.models.llama3 import llama3_configs

    from meshforge.models import count_params, get_model_spec
    from meshforge.models.llama3.adapter import TORCHTITAN_FLAVORS as LLAMA3_FLAVORS
    from meshforge.models.llama3.model import LlamaArgs

    for flavor in ("debugmodel", "8B", "70B"):
        with torch.device("meta"):
            titan = llama3_configs[flavor](attn_backend="flex").build()
            ours = get_model_spec("llama3").build(LlamaArgs(**LLAMA3_FLAVORS[flavor], max_seq_len=2048))
        titan_n = sum(p.numel() for n, p in titan.named_parameters())
        assert count_params(ours) == titan_n, flavor

    from torchtitan.models.qwen3 import qwen3_configs

    from meshforge.models.qwen3_moe.adapter import TORCHTITAN_FLAVORS as QWEN3_MOE_FLAVORS
    from meshforge.models.qwen3_moe.model import Qwen3MoeArgs

    for flavor, args in QWEN3_MOE_FLAVORS.items():  # the same shapes in 0.2.0 and 0.3.0
        args = dict(args, mlp_only_layers=tuple(args["mlp_only_layers"]), max_seq_len=2048)
        with torch.device("meta"):
            titan = qwen3_configs[flavor](attn_backend="flex").build()
            ours = get_model_spec("qwen3_moe").build(Qwen3MoeArgs(**args))
        assert count_params(ours) == sum(p.numel() for p in titan.parameters()), flavor


# DeepSpeed's three warmup schedules as configs write them, each compared step by step below
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


def test_torchtitan_validation_maps_to_the_eval_loop(tmp_path):
    """validation.enable runs meshforge's eval loop: every `freq` steps, over the same held-out samples
    (`steps` batches of local_batch_size per dp rank = eval.batches global batches)."""
    job = tmp_path / "job.toml"
    base = "[training]\nlocal_batch_size = 4\nglobal_batch_size = 64\nseq_len = 256\nsteps = 20\n"
    job.write_text(
        base
        + "[validation]\nenable = true\nfreq = 5\nsteps = 8\nlocal_batch_size = 4\nseq_len = 256\n"
        + 'dataset = "c4_validation"\n'
    )
    imported, r, text = _import(tmp_path, job, 8)
    # 8 steps x 4 samples x dp 8 = 256 held-out samples = 4 global batches of 64
    assert (r.eval.every, r.eval.batches) == (5, 4) and not imported.unsupported
    assert "TorchTitan also validates at step 1" in text and "validation.dataset = 'c4_validation'" in text

    # off (TorchTitan's default): no evaluation, its other keys listed as inert
    imported, r, text = _import(tmp_path, TITAN / "debug_model.toml", 8)
    assert r.eval.every == 0 and "validation.freq = 5: validation is off" in text

    # what meshforge's loop does not do is refused by name
    job.write_text(base + "[validation]\nenable = true\nseq_len = 128\n")
    with pytest.raises(ImportRefused) as e:
        import_config(job, tmp_path / "x.toml", 8)
    why = {s.key: s.why for s in e.value.imported.unsupported}
    assert (
        set(why) == {"validation.seq_len", "validation.steps"} and "fixed number" in why["validation.steps"]
    )
    job.write_text(base + "[validation]\nenable = true\nsteps = 3\nlocal_batch_size = 1\nseq_len = 256\n")
    with pytest.raises(ImportRefused) as e:
        import_config(job, tmp_path / "x.toml", 8)
    assert "24 samples are not whole global batches of 64" in e.value.imported.unsupported[0].why


def test_torchtitan_memory_budget_ac_maps_with_compile_and_is_refused_without(tmp_path):
    """TorchTitan's memory_budget AC is meshforge's (the compiler's partitioner, both need compile)."""
    job = tmp_path / "job.toml"
    base = '[model]\nname = "llama3"\nflavor = "debugmodel"\n[training]\nsteps = 10\n'
    ac = '[activation_checkpoint]\nmode = "memory_budget"\nmemory_budget = 0.3\n'
    job.write_text(base + ac + '[compile]\nenable = true\ncomponents = ["model"]\n')
    _, r, _ = _import(tmp_path, job, 1)
    assert (r.activation_checkpoint.mode, r.activation_checkpoint.memory_budget) == ("memory_budget", 0.3)
    assert r.compile.enabled
    job.write_text(base + ac)
    with pytest.raises(ImportRefused) as e:
        import_config(job, tmp_path / "x.toml", 1)
    assert (
        "compile.enable" in {s.key: s.why for s in e.value.imported.unsupported}["activation_checkpoint.mode"]
    )
