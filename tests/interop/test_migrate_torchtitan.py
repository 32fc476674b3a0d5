"""`meshforge import-config` of TorchTitan 0.2 job files: titan's defaults, context parallel,
float8, the Qwen3 MoE job and expert parallel, the eval loop and memory-budget AC map, with
TorchTitan's own parameter counts; what meshforge cannot do is refused by key."""

from __future__ import annotations

import pytest
import tomllib
from support.import_configs import TITAN, import_and_load, titan_moe_job

from meshforge.configs import RecipeError
from meshforge.core.errors import UsageError
from meshforge.migrate import ImportRefused, import_config
from meshforge.models import args_from_config


def test_torchtitan_job_files_map_with_titan_s_defaults(tmp_path):
    imported, r, text = import_and_load(tmp_path, TITAN / "debug_model.toml", 8)
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

    _, r, text = import_and_load(tmp_path, TITAN / "llama3_8b.toml", 64)
    assert r.model.flavor == "8b" and r.model.dim is None  # meshforge's 8b is TorchTitan's 8B: no overrides
    assert set(tomllib.loads(text)["model"]) == {"name", "flavor", "max_seq_len"}
    assert r.activation_checkpoint.mode == "op" and "meshforge's per-op AC, TorchTitan's policy" in text
    assert (r.train.seq_len, r.train.steps, r.lr_scheduler.warmup_steps) == (8192, 1000, 200)

    _, r, _ = import_and_load(tmp_path, TITAN / "llama3_70b.toml", 64)
    assert r.model.flavor == "70b" and args_from_config(r.model).n_layers == 80

    # without data parallelism TorchTitan trains in fp32: so does the import
    _, r, text = import_and_load(tmp_path, TITAN / "debug_model.toml", 1)
    assert r.mesh.dp_shard == 1 and r.fsdp.param_dtype == "float32"
    assert "applies only under FSDP in TorchTitan" in text


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
    _, r, _ = import_and_load(tmp_path, job, 8)
    assert (r.mesh.dp_shard, r.mesh.cp, r.mesh.tp, r.cp.method) == (4, 2, 1, "allgather")
    rotate = 'context_parallel_rotate_method = "alltoall"\n'
    job.write_text(text.replace("context_parallel_degree = 2\n", "context_parallel_degree = 2\n" + rotate))
    _, r, written = import_and_load(tmp_path, job, 8)
    assert r.cp.method == "allgather" and "the same attention, other traffic" in written
    job.write_text(text.replace("[training]\n", "[training]\ngc_freq = 7\n"))
    assert import_and_load(tmp_path, job, 8)[1].train.gc_every == 7  # a job's own gc_freq is kept


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
    _, r, written = import_and_load(tmp_path, job, 8)
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


def test_torchtitan_qwen3_moe_debug_job_imports_as_written(tmp_path):
    """TorchTitan's own Qwen3 MoE job (torchtitan/models/qwen3/train_configs/qwen3_moe_debug.toml at
    v0.2.0, verbatim): its debugmodel_moe (64 experts, top-8, every block sparse) becomes meshforge's
    qwen3_moe with every difference from its debug flavor overridden, balanced as 0.2 trains it (an
    expert bias that nothing moves: aux_free at rate 0, no aux loss)."""
    imported, r, text = import_and_load(tmp_path, TITAN / "qwen3_moe_debug.toml", 8)
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
    job = titan_moe_job(tmp_path, "30B-A3B", expert_parallel_degree=4)
    imported, r, text = import_and_load(tmp_path, job, 8)
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

    job = titan_moe_job(
        tmp_path,
        "30B-A3B",
        tensor_parallel_degree=2,
        expert_parallel_degree=4,
        expert_tensor_parallel_degree=2,
    )
    _, r, text = import_and_load(tmp_path, job, 16)
    assert (r.mesh.ep, r.mesh.dp_shard, r.mesh.tp) == (4, 8, 2)
    assert "TorchTitan splits every expert over the tp ranks" in text

    job = titan_moe_job(tmp_path, "30B-A3B", tensor_parallel_degree=2, expert_parallel_degree=4)
    _, r, text = import_and_load(tmp_path, job, 16)  # etp = 1, TorchTitan's default
    assert (r.mesh.ep, r.mesh.dp_shard, r.mesh.tp) == (2, 8, 2)
    assert "mesh.ep = 4 / tp 2 = 2" in text

    job = titan_moe_job(tmp_path, "235B-A22B", expert_parallel_degree=8)
    _, r, _ = import_and_load(tmp_path, job, 16)
    a = args_from_config(r.model)
    assert (r.model.flavor, r.mesh.ep, a.n_layers, a.moe_dim) == ("235b-a22b", 8, 94, 1536)
    assert a.rope_theta == 5e6  # TorchTitan's flavor, not the published config's 1e6


def test_torchtitan_moe_refusals(tmp_path):
    """What meshforge's MoE does not do is listed by key and value; TorchTitan's own ep rules are
    its errors; a Qwen3 flavor without experts or another MoE family is not imported."""
    job = titan_moe_job(tmp_path, training="debug_moe_force_load_balance = true\n")
    with pytest.raises(ImportRefused) as e:
        import_config(job, tmp_path / "x.toml", 8)
    [refused] = e.value.imported.unsupported
    assert (refused.key, refused.value) == ("training.debug_moe_force_load_balance", True)
    assert "round-robin" in refused.why

    for flavor in ("0.6B", "debugmodel"):  # TorchTitan's dense Qwen3 flavors
        with pytest.raises(ImportRefused) as e:
            import_config(titan_moe_job(tmp_path, flavor), tmp_path / "x.toml", 8)
        [refused] = e.value.imported.unsupported
        assert (refused.key, refused.value) == ("model.flavor", f"qwen3/{flavor}")
        assert "qwen3's (debugmodel_moe, 30B-A3B, 235B-A22B)" in refused.why

    job = titan_moe_job(
        tmp_path, tensor_parallel_degree=2, expert_parallel_degree=4, expert_tensor_parallel_degree=4
    )
    with pytest.raises(UsageError, match="TorchTitan supports only ETP=TP or ETP=1"):
        import_config(job, tmp_path / "x.toml", 16)
    job = titan_moe_job(tmp_path, expert_parallel_degree=3)
    with pytest.raises(UsageError, match="must be a multiple of cp = 1 and divide dp_shard x cp = 8"):
        import_config(job, tmp_path / "x.toml", 8)
    job = titan_moe_job(tmp_path, tensor_parallel_degree=4, expert_parallel_degree=2)  # etp = 1
    with pytest.raises(UsageError, match="multiple of cp x tp = 4 and divide dp_shard x cp x tp = 8"):
        import_config(job, tmp_path / "x.toml", 8)
    # mesh.ep must still divide the experts: meshforge's own rule, from the recipe check
    job = titan_moe_job(tmp_path, expert_parallel_degree=128)
    with pytest.raises(RecipeError, match="mesh.ep"):
        import_config(job, tmp_path / "x.toml", 128)
    assert not (tmp_path / "x.toml").exists()


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
    imported, r, text = import_and_load(tmp_path, job, 8)
    # 8 steps x 4 samples x dp 8 = 256 held-out samples = 4 global batches of 64
    assert (r.eval.every, r.eval.batches) == (5, 4) and not imported.unsupported
    assert "TorchTitan also validates at step 1" in text and "validation.dataset = 'c4_validation'" in text

    # off (TorchTitan's default): no evaluation, its other keys listed as inert
    imported, r, text = import_and_load(tmp_path, TITAN / "debug_model.toml", 8)
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
    _, r, _ = import_and_load(tmp_path, job, 1)
    assert (r.activation_checkpoint.mode, r.activation_checkpoint.memory_budget) == ("memory_budget", 0.3)
    assert r.compile.enabled
    job.write_text(base + ac)
    with pytest.raises(ImportRefused) as e:
        import_config(job, tmp_path / "x.toml", 1)
    assert (
        "compile.enable" in {s.key: s.why for s in e.value.imported.unsupported}["activation_checkpoint.mode"]
    )
