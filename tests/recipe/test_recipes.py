"""The schema, loader and validation: each rule gives its message, all at once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support import RECIPES, REPO, run_cli

from meshforge.configs import RecipeError
from meshforge.configs.schema import Recipe, field_doc, sections
from meshforge.core.topology import ParallelDims
from meshforge.recipe import load_recipe


def write(tmp_path: Path, text: str, name: str = "r.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def problems(tmp_path: Path, text: str = "", overrides=(), world: int | None = None) -> dict[str, str]:
    """field -> its messages (joined) for every problem of a recipe (must fail)."""
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, text), overrides, world_size=world)
    out: dict[str, str] = {}
    for p in e.value.problems:
        out[p.field] = f"{out[p.field]} | {p.message}" if p.field in out else p.message
    return out


SINGLE = "[mesh]\ndp_shard = 1\n"


def test_every_shipped_recipe_validates():
    found = sorted(RECIPES.rglob("*.toml"))  # recursive: recipes in sub-folders count too
    assert {p.stem for p in found} >= {"debug_cpu", "llm_1b", "llm_8b"}
    for path in found:
        r = load_recipe(path)
        assert r.mesh.dp_shard > 0 and r.train.global_batch_size > 0
        assert path.read_text().startswith("#"), f"{path} must open with purpose, hardware, command"


def test_every_field_is_documented():
    for sec, cls in sections().items():
        for name in cls.__dataclass_fields__:
            assert field_doc(sec, name), f"{sec}.{name} has no doc"
    assert field_doc(None, "seed")


def test_defaults_overrides_and_derived_batch(tmp_path):
    r = load_recipe(
        write(tmp_path, SINGLE + "[train]\nsteps = 7\nmicro_batch_size = 4\ngrad_accum_steps = 3\n"),
        ["train.steps=9", "optimizer.lr=0.01"],
    )
    assert isinstance(r, Recipe)
    assert (r.train.steps, r.optimizer.lr, r.train.global_batch_size) == (9, 0.01, 12)
    assert r.fsdp.reshard_after_forward is True  # schema default


def test_a_text_field_takes_an_override_as_written(tmp_path):
    """YAML would read run_name=off as False (a run folder named 'False') and 1e3 as 1000.0."""
    over = ["run_name=off", "output_dir=1e3", "checkpoint.load=null", "sweep.slurm.partition=0123"]
    r = load_recipe(write(tmp_path, SINGLE), over)
    assert (r.run_name, r.output_dir, r.checkpoint.load) == ("off", "1e3", None)
    assert r.sweep.slurm.partition == "0123"  # a nested section's text field too (YAML: the number 83)
    assert load_recipe(write(tmp_path, SINGLE), ["run_name='off'"]).run_name == "off"  # quoting still works
    assert load_recipe(write(tmp_path, SINGLE), ["train.steps=7"]).train.steps == 7  # numbers stay numbers


def test_minus_one_takes_the_rest_of_the_world(tmp_path):
    r = load_recipe(write(tmp_path, "[mesh]\ndp_shard = -1\ntp = 2\n[train]\nseq_len = 32\n"), world_size=8)
    assert (r.mesh.dp_shard, r.mesh.tp) == (4, 2)
    derived = load_recipe(
        write(
            tmp_path,
            "[mesh]\ndp_shard = 4\n[train]\nglobal_batch_size = 32\n"
            "micro_batch_size = -1\ngrad_accum_steps = 2\n",
        ),
        world_size=4,
    )
    assert derived.train.micro_batch_size == 4


def test_extends_merges_over_a_base(tmp_path):
    write(tmp_path, SINGLE + "[train]\nsteps = 3\nseq_len = 16\n", "base.toml")
    r = load_recipe(write(tmp_path, 'extends = "base.toml"\n[train]\nsteps = 5\n'))
    assert (r.train.steps, r.train.seq_len) == (5, 16)
    write(tmp_path, 'extends = "b.toml"\n', "a.toml")
    write(tmp_path, 'extends = "a.toml"\n', "b.toml")
    with pytest.raises(RecipeError, match="cycle"):
        load_recipe(tmp_path / "a.toml")


def test_unknown_keys_suggest_the_right_one(tmp_path):
    p = problems(
        tmp_path, SINGLE + "[trian]\nsteps = 3\n[train]\nstep = 3\n[optimizer]\nlearning_rate = 1.0\n"
    )
    assert "did you mean train?" in p["trian"]
    assert "did you mean train.steps?" in p["train.step"]
    assert "optimizer.learning_rate" in p


def test_wrong_types_name_the_expected_type(tmp_path):
    p = problems(tmp_path, SINGLE + '[train]\nsteps = "many"\n[fsdp]\nreshard_after_forward = "maybe"\n')
    assert "expected int" in p["train.steps"]
    assert "expected bool" in p["fsdp.reshard_after_forward"]


def test_a_table_where_a_list_goes_is_a_wrong_type_and_a_bug_is_not(tmp_path, monkeypatch):
    p = problems(tmp_path, SINGLE + "[optimizer]\nbetas = { first = 0.9 }\n")
    assert p["optimizer.betas"] == "wrong type: expected List[float] (the checks across fields left it out)"
    from meshforge.configs import loader

    def broken(*args, **kwargs):  # a bug while checking types is a bug, not a user's wrong type
        raise AttributeError("'NoneType' object has no attribute 'merge'")

    monkeypatch.setattr(loader.OmegaConf, "merge", broken)
    with pytest.raises(AttributeError, match="has no attribute 'merge'"):
        load_recipe(write(tmp_path, SINGLE + "[train]\nsteps = 3\n"))


def test_bad_override_syntax(tmp_path):
    p = problems(tmp_path, SINGLE, overrides=["train.steps"])
    assert "key=value" in p["override"]


def test_mesh_product_must_equal_world(tmp_path):
    p = problems(tmp_path, "[mesh]\ndp_shard = 2\ntp = 2\n[train]\nseq_len = 32\n", world=8)
    assert "= 4 but the world size is 8" in p["mesh"]
    p = problems(tmp_path, "[mesh]\ndp_shard = -1\ntp = 2\n[train]\nseq_len = 32\n", world=6 + 1)
    assert "not divisible" in p["mesh.dp_shard"]
    p = problems(tmp_path, "[mesh]\ndp_shard = -1\ntp = -1\n", world=4)
    assert "only one degree may be -1" in p["mesh"]
    p = problems(tmp_path, "[mesh]\ndp_shard = -1\n")
    assert "--nproc" in p["mesh.dp_shard"]
    with pytest.raises(RecipeError, match="needs 4 ranks, 2 are running") as e:  # a trainer's own check
        ParallelDims(dp_shard=2, tp=2).check_world(2)
    assert e.value.exit_code == 2


def test_heads_and_kv_heads_must_divide_by_tp(tmp_path):
    # debug flavor: 4 heads, 2 kv heads
    p = problems(tmp_path, "[mesh]\ndp_shard = 1\ntp = 4\n[train]\nseq_len = 32\n")
    assert (
        p["mesh.tp"] == "n_kv_heads=2 (each rank needs whole kv heads): not divisible by tp; valid tp: 1, 2"
    )
    p = problems(tmp_path, "[mesh]\ndp_shard = 1\ntp = 3\n[train]\nseq_len = 34\n")
    assert (
        p["mesh.tp"]
        == "n_heads=4, n_kv_heads=2 (each rank needs whole kv heads), vocab 256: not divisible by tp; "
        "valid tp: 1, 2"
    )
    assert "train.seq_len" not in p  # sequence parallel's split by a tp that cannot be is not offered
    p = problems(tmp_path, "[mesh]\ndp_shard = 1\ntp = 2\n[train]\nseq_len = 33\n")
    assert "multiple of 2" in p["train.seq_len"]  # sequence parallel shards seq_len


def test_context_parallel_rules_name_the_field_the_value_and_the_valid_choices(tmp_path):
    # debug flavor: 4 heads, 2 kv heads
    p = problems(tmp_path, "[mesh]\ndp_shard = 1\ncp = 4\n[train]\nseq_len = 36\n")
    assert (
        p["train.seq_len"]
        == "mesh.cp=4 needs seq_len 36: cp 4 cuts it in 8 equal chunks, so a multiple of 8, e.g. 32"
    )
    p = problems(tmp_path, "[mesh]\ndp_shard = 1\ncp = 4\n[cp]\nmethod = 'alltoall'\n[train]\nseq_len = 64\n")
    assert "4 heads and 2 kv heads must both divide by 4" in p["cp.method"]
    assert "use mesh.cp among [2] (with tp=1), or cp.method=allgather" in p["cp.method"]
    p = problems(
        tmp_path, "[mesh]\ndp_shard = 1\ncp = 2\ntp = 2\n[cp]\nmethod = 'alltoall'\n[train]\nseq_len = 64\n"
    )
    assert "2 heads and 1 kv heads must both divide by 2" in p["cp.method"] and "among none" in p["cp.method"]
    # 36 tokens: 4 chunks of 9, and sequence parallel splits each cp rank's 18 over tp 2
    load_recipe(write(tmp_path, "[mesh]\ndp_shard = 1\ncp = 2\ntp = 2\n[train]\nseq_len = 36\n"))
    p = problems(
        tmp_path, "[mesh]\ndp_shard = 1\ncp = 2\ntp = 4\n[model]\nn_kv_heads = 4\n[train]\nseq_len = 4\n"
    )
    assert (
        "sequence parallel shards each cp rank's 2 tokens over tp=4: use a multiple of "
        "lcm(2 x cp, cp x tp) = 8" in p["train.seq_len"]
    )
    # FSDP shards over dp_shard x cp: the zero-bubble refusal holds with dp_shard 1 under cp
    zbv = "[mesh]\ndp_shard = 1\ncp = 2\npp = 2\n[pp]\nschedule = 'ZBVZeroBubble'\nstages_per_rank = 2\n"
    p = problems(tmp_path, zbv + "[train]\nseq_len = 32\n")
    assert (
        "ZBVZeroBubble with FSDP resharding after forward gives wrong gradients"
        in p["fsdp.reshard_after_forward"]
    )
    # an odd tp: the suggestion keeps cp's 2 x cp chunks too (18 would not: 4 chunks of 4.5)
    six_heads = (
        "[model]\ndim = 96\nn_heads = 6\nn_kv_heads = 3\nvocab_size = 258\nmultiple_of = 96\n"  # tp 3 fits
    )
    p = problems(tmp_path, "[mesh]\ndp_shard = 1\ncp = 2\ntp = 3\n[train]\nseq_len = 20\n" + six_heads)
    assert (
        "each cp rank's 10 tokens over tp=3: use a multiple of lcm(2 x cp, cp x tp) = 12, e.g. 12"
        in (p["train.seq_len"])
    )
    p = problems(tmp_path, "backend = 'jax'\n[mesh]\ndp_shard = 1\ncp = 2\n[train]\nseq_len = 32\n")
    assert "context parallelism is torch-only: set mesh.cp=1" in p["mesh.cp"]
    p = problems(tmp_path, "[mesh]\ndp_shard = 1\ncp = 2\n[cp]\nmethod = 'ring'\n")
    assert p["cp.method"] == "must be one of allgather, alltoall"
    recipe = load_recipe(
        write(tmp_path, "[mesh]\ndp_shard = -1\ncp = 2\n[train]\nseq_len = 32\n"), world_size=8
    )
    assert ParallelDims.from_config(recipe.mesh).label() == "dp4-cp2"


def test_per_op_ac_names_ops_torch_has_and_is_read_only_in_its_mode(tmp_path):
    bad = "[activation_checkpoint]\nmode = 'op'\nop_save = ['aten.mm', 'aten.matmull', 'mm']\n"
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, SINGLE + bad))
    (problem,) = [p for p in e.value.problems if p.field == "activation_checkpoint.op_save"]
    assert problem.value == ["aten.matmull", "mm"] and "not ops of this torch" in problem.message
    p = problems(tmp_path, SINGLE + "[activation_checkpoint]\nmode = 'full'\nop_save = ['aten.mm']\n")
    assert (
        "is not read" in p["activation_checkpoint.op_save"]
        and "mode=op" in p["activation_checkpoint.op_save"]
    )
    load_recipe(write(tmp_path, SINGLE + "[activation_checkpoint]\nmode = 'op'\nop_save = ['aten.mm']\n"))


def test_layers_vs_pipeline_stages(tmp_path):
    p = problems(tmp_path, "[mesh]\ndp_shard = 1\npp = 8\n[train]\nmicro_batch_size = 8\n")
    assert "8 pipeline stages but only 4 layers" in p["mesh.pp"]
    p = problems(tmp_path, "[mesh]\ndp_shard = 1\npp = 2\n[pp]\nlayers_per_stage = [1, 2]\n")
    assert "summing to n_layers=4" in p["pp.layers_per_stage"]


def test_global_batch_arithmetic(tmp_path):
    p = problems(
        tmp_path,
        "[mesh]\ndp_shard = 2\n[train]\nglobal_batch_size = 10\nmicro_batch_size = 4\ngrad_accum_steps = 1\n",
        world=2,
    )
    assert "4 x 1 x 2 = 8" in p["train.global_batch_size"]
    p = problems(
        tmp_path,
        "[mesh]\ndp_shard = 2\n[train]\nglobal_batch_size = 10\nmicro_batch_size = -1\n"
        "grad_accum_steps = 2\n",
        world=2,
    )
    assert "nearest valid: 8, 12" in p["train.global_batch_size"]


def test_seq_len_and_ranges(tmp_path):
    p = problems(tmp_path, SINGLE + "[train]\nseq_len = 4096\nsteps = 0\n[optimizer]\nlr = -1.0\n")
    assert "max_seq_len=512" in p["train.seq_len"]
    assert "must be > 0" in p["train.steps"]
    assert "must be > 0" in p["optimizer.lr"]


def test_microbatches_vs_batch_and_stages(tmp_path):
    p = problems(
        tmp_path, "[mesh]\ndp_shard = 1\npp = 4\n[pp]\nmicrobatches = 3\n[train]\nmicro_batch_size = 8\n"
    )
    assert "must divide the local batch" in p["pp.microbatches"]
    p = problems(
        tmp_path,
        '[mesh]\ndp_shard = 1\npp = 4\n[pp]\nmicrobatches = 2\nschedule = "1F1B"\n'
        "[train]\nmicro_batch_size = 8\n",
    )
    assert "needs microbatches >= pp=4" in p["pp.microbatches"]
    p = problems(
        tmp_path,
        '[mesh]\ndp_shard = 1\npp = 2\n[pp]\nschedule = "DualPipeV"\nstages_per_rank = 2\n'
        "microbatches = 2\n[train]\nmicro_batch_size = 8\n",
    )
    assert "DualPipeV needs microbatches >= stages = pp x 2 = 4" in p["pp.microbatches"]
    p = problems(tmp_path, '[mesh]\ndp_shard = 1\npp = 2\n[pp]\nschedule = "ZBVZeroBubble"\n')
    assert "exactly 2 stages per rank" in p["pp.stages_per_rank"]
    p = problems(tmp_path, '[mesh]\ndp_shard = 1\npp = 2\n[pp]\nschedule = "GPipe"\nstages_per_rank = 2\n')
    assert "one stage per rank" in p["pp.stages_per_rank"]


def test_enums_list_the_choices(tmp_path):
    p = problems(
        tmp_path,
        SINGLE + '[pp]\nschedule = "2F2B"\n[fsdp]\nparam_dtype = "float8"\n[model]\nflavor = "tiny"\n',
    )
    assert "1F1B" in p["pp.schedule"] and "DualPipeV" in p["pp.schedule"]
    assert "float32, bfloat16, float16" in p["fsdp.param_dtype"]
    assert "debug" in p["model.flavor"]


def test_refused_combinations_say_why_and_what_instead(tmp_path):
    p = problems(
        tmp_path,
        '[mesh]\ndp_shard = 2\npp = 2\n[pp]\nschedule = "ZBVZeroBubble"\nstages_per_rank = 2\n',
        world=4,
    )
    assert "wrong gradients" in p["fsdp.reshard_after_forward"]
    assert "reshard_after_forward=false" in p["fsdp.reshard_after_forward"]
    p = problems(tmp_path, "[mesh]\ndp_shard = 1\ntp = 2\n[compile]\nenabled = true\n[train]\nseq_len = 32\n")
    assert "tok_embeddings gradient" in p["compile.enabled"]
    # tied embeddings run under TP and PP (parity matrix); a vocabulary TP cannot split is refused
    tied = "[mesh]\ndp_shard = 1\ntp = 2\npp = 2\n[model]\ntie_embeddings = true\n"
    assert load_recipe(write(tmp_path, tied), world_size=4).model.tie_embeddings
    p = problems(tmp_path, tied + "vocab_size = 255\n", world=4)
    assert "vocab 255 (the tied embedding and output shard it alike)" in p["mesh.tp"]
    assert "valid tp: 1" in p["mesh.tp"] and "model.tie_embeddings" not in p  # 3 splits no head
    p = problems(tmp_path, SINGLE + '[fsdp]\nparam_dtype = "bfloat16"\nreduce_dtype = "float16"\n')
    assert (
        "unscaled gradients underflow" in p["fsdp.reduce_dtype"] and "now bfloat16" in p["fsdp.reduce_dtype"]
    )
    p = problems(tmp_path, SINGLE + "[loss_scale]\ninitial = 8.0\nmin_scale = 16.0\nbackoff_factor = 2.0\n")
    assert (
        "(0, loss_scale.initial=8.0]" in p["loss_scale.min_scale"]
        and "(0, 1)" in p["loss_scale.backoff_factor"]
    )


def test_no_fix_ends_with_an_empty_list(tmp_path):
    """A batch that cannot be derived is reported alone, not with a pipeline rule over it."""
    p = problems(
        tmp_path, "[mesh]\ndp_shard = 1\npp = 2\n[train]\nglobal_batch_size = -1\nmicro_batch_size = -1\n"
    )
    assert "train" in p and "pp.microbatches" not in p
    assert not any(m.rstrip().endswith(("valid:", "valid tp:", "nearest valid:")) for m in p.values())


def test_every_violation_is_reported_at_once(tmp_path):
    p = problems(
        tmp_path,
        "[mesh]\ndp_shard = 1\ntp = 4\n[train]\nsteps = -2\nseq_len = 4098\n"
        "[optimizer]\nlr = 0.0\n[lrschedule]\nwarmup = 1\n",
    )
    # an unknown section and the rules across the other fields, in one pass
    assert {"lrschedule", "mesh.tp", "train.steps", "train.seq_len", "optimizer.lr"} <= set(p)
    assert "(the checks across fields left it out)" in p["lrschedule"]


def test_a_type_error_and_a_mesh_problem_are_reported_in_one_pass_by_the_cli(tmp_path):
    """As a user meets it: the type error and the mesh's problem together, exit 2, and one
    "valid tp" offered by one rule (not "1, 2" in one line and "2, 4" in the next)."""
    proc = run_cli(["recipes/debug_cpu.toml", "train.seq_len=abc", "mesh.tp=3"], cwd=REPO)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "2 problem(s)" in out, out
    assert "train.seq_len = 'abc': wrong type: expected int (the checks across fields left it out)" in out
    tp_lines = [line for line in out.splitlines() if "mesh.tp = 3" in line]
    assert tp_lines == [
        "  mesh.tp = 3: n_heads=4, n_kv_heads=2 (each rank needs whole kv heads), vocab 256: not divisible "
        "by tp; valid tp: 1, 2"
    ], out


def test_settings_the_chosen_source_does_not_read_are_refused(tmp_path):
    """Each names the field, the value, why it is unread and the override that fixes it."""
    p = problems(
        tmp_path,
        SINGLE
        + '[data]\ntokenizer = "meta-llama/Llama-3.2-1B"\nshuffle_windows = 256\ntext_column = "body"\n'
        'split = "validation"\ntext_sample_by = "line"\n',
    )
    assert set(p) == {
        f"data.{k}" for k in ("tokenizer", "shuffle_windows", "text_column", "split", "text_sample_by")
    }
    assert "the synthetic source draws token ids itself" in p["data.tokenizer"]
    assert (
        "set data.tokenizer=byte (its default) or change data.source (now 'synthetic')" in p["data.tokenizer"]
    )
    assert "set data.shuffle_windows=0" in p["data.shuffle_windows"]
    byte_vocab = SINGLE + "[model]\nvocab_size = 512\n"  # the byte tokenizer's 258 tokens fit
    files = byte_vocab + '[data]\nsource = "files"\npath = "c/*.jsonl"\n'
    p = problems(tmp_path, files + 'split = "test"\nmarkov_branching = 8\ntext_sample_by = "paragraph"\n')
    assert set(p) == {"data.split", "data.markov_branching", "data.text_sample_by"}
    assert "json and parquet records are documents already" in p["data.text_sample_by"]
    text_files = byte_vocab + '[data]\nsource = "files"\npath = "c/*.txt"\ntext_sample_by = "paragraph"\n'
    assert load_recipe(write(tmp_path, text_files)).data.text_sample_by == "paragraph"
    hf = byte_vocab + '[data]\nsource = "hf"\nhf_dataset = "org/name"\n'
    p = problems(tmp_path, hf + 'text_sample_by = "line"\nmarkov_branching = 2\n')
    assert set(p) == {"data.text_sample_by", "data.markov_branching"}
    assert load_recipe(write(tmp_path, hf + 'split = "train[:1%]"\ntext_column = "content"\n'))


def test_loss_scale_without_fp16_and_selective_every_without_selective_are_refused(tmp_path):
    p = problems(tmp_path, SINGLE + "[loss_scale]\ninitial = 1024.0\ngrowth_interval = 100\n")
    assert set(p) == {"loss_scale.initial", "loss_scale.growth_interval"}
    assert "only float16 compute runs a loss scale (fsdp.param_dtype = 'float32')" in p["loss_scale.initial"]
    assert (
        "set loss_scale.initial=65536.0 (its default) or set fsdp.param_dtype=float16"
        in p["loss_scale.initial"]
    )
    fp16 = load_recipe(
        write(tmp_path, SINGLE + '[fsdp]\nparam_dtype = "float16"\n[loss_scale]\ninitial = 1024.0\n')
    )
    assert fp16.loss_scale.initial == 1024.0
    p = problems(tmp_path, SINGLE + '[activation_checkpoint]\nmode = "full"\nselective_every = 3\n')
    assert "mode = 'full' checkpoints no Nth block" in p["activation_checkpoint.selective_every"]
    assert load_recipe(
        write(tmp_path, SINGLE + '[activation_checkpoint]\nmode = "selective"\nselective_every = 3\n')
    )


def test_settings_left_unread_by_a_switch_or_a_degree_of_1_say_so_in_explain():
    """Harmless, so accepted: the field's doc (meshforge explain) says when it is unread and why."""
    for section, name, condition in (
        ("pp", "schedule", "mesh.pp = 1"),
        ("pp", "microbatches", "mesh.pp = 1"),
        ("tp", "sequence_parallel", "mesh.tp = 1"),
        ("fsdp", "reduce_dtype", "no FSDP"),
        ("eval", "path", "eval.every = 0"),
        ("checkpoint", "interval", "checkpoint.enabled = false"),
        ("logging", "wandb_project", "logging.wandb = false"),
        ("compile", "backend", "compile.enabled = false"),
        ("lr_scheduler", "min_lr_ratio", "decay = constant"),
        ("data", "seed", "shuffle_windows = 0"),
    ):
        assert "unread with" in field_doc(section, name) and condition in field_doc(section, name)


COMMAND = re.compile(
    r"(?:run_recipe|meshforge (?:sweep|estimate|tune)|-m meshforge\.cli)((?:\s+[^\s#`|&]+)*)"
)
VALUED_FLAGS = {
    "--world",
    "--nproc",
    "--axis",
    "--device-memory",
    "--out",
    "--baseline",
    "--seeds",
    "--profile",
    "--profile-out",
    "--top",
}


def shipped_commands() -> list[tuple[str, list[str]]]:
    """Every command line a recipe's header, the README or a docs page gives, continuation lines joined."""
    from support import REPO

    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    texts = [p.read_text() for p in [*sorted(RECIPES.rglob("*.toml")), *docs]]
    lines = []
    for text in texts:
        joined = ""
        for line in text.splitlines():
            joined += " " + line.lstrip("# ").rstrip()
            if joined.endswith("\\"):
                joined = joined[:-1]
                continue
            lines.append(joined)
            joined = ""
    return [(line, m.group(1).split()) for line in lines for m in COMMAND.finditer(line)]


def test_every_command_in_the_recipe_headers_the_readme_and_the_docs_validates():
    """What a user copies must load: the CPU-shrink lines, the sweeps, the dry runs."""
    from support import REPO

    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    written = {out for page in docs for out in re.findall(r"--out (\S+)", page.read_text())}
    checked = 0
    for line, words in shipped_commands():
        placeholder = ("path/to", "$", "<", "outputs/")
        if any(p in w for w in words for p in placeholder) or any(w.isupper() for w in words):
            continue  # a placeholder the user fills in
        if any(w in written for w in words if not w.startswith("-") and "=" not in w):
            continue  # a recipe an earlier command of the page writes (import-config --out)
        recipe, overrides, world, skip = None, [], None, False
        for i, w in enumerate(words):
            if skip:
                skip = False
            elif w in VALUED_FLAGS:
                skip, world = True, int(words[i + 1]) if w in ("--world", "--nproc") else world
            elif "=" in w:
                overrides.append(w)
            elif not w.startswith("-") and recipe is None:
                recipe = REPO / w if (REPO / w).exists() else w
        load_recipe(recipe, overrides, world_size=world)  # raises, naming the field, if refused
        checked += 1
    print(f"{checked} commands validated")
    assert checked >= 75  # the headers', the README's and the docs' commands were found


def test_loading_a_recipe_twice_gives_two_recipes_and_every_problem_is_listed():
    """A launch loads its recipe twice, the second from what the first checked: each caller owns its
    copy, and an override that does not parse is listed beside the merged recipe's problems."""
    first = load_recipe(str(RECIPES / "debug_cpu.toml"), ["train.steps=7"])
    first.train.steps, first.mesh.tp = 99, 1
    second = load_recipe(str(RECIPES / "debug_cpu.toml"), ["train.steps=7"])
    assert (second.train.steps, second.mesh.tp) == (7, 2) and second is not first
    # a mesh degree of -1 is filled in per world size, on the caller's copy only
    derived = [
        load_recipe(str(RECIPES / "debug_cpu.toml"), ["mesh.dp_shard=-1"], world_size=w) for w in (4, 8)
    ]
    assert [r.mesh.dp_shard for r in derived] == [1, 2]
    with pytest.raises(RecipeError) as e:
        load_recipe(str(RECIPES / "debug_cpu.toml"), ["train.steps", "train.stepz=3"])
    assert {p.field for p in e.value.problems} == {"override", "train.stepz"}
