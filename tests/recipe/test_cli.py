"""The command line as a user meets it: plans, printed configs, and clear errors (exit 2)."""

from __future__ import annotations

from support import RECIPES, run_cli


def test_dry_run_plans_llm_1b_without_allocating_it(tmp_path):
    proc = run_cli([str(RECIPES / "llm_1b.toml"), "--dry-run"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "1,235,814,400 parameters" in proc.stdout
    assert "global 16 = micro 2 x accum 1 x dp 8" in proc.stdout
    assert "world size 8" in proc.stdout
    # its real corpus and tokenizer are named, checked as far as possible, and not downloaded
    assert "HF dataset HuggingFaceFW/fineweb-edu (config 'sample-10BT', split 'train')" in proc.stdout
    assert "tokenizer meta-llama/Llama-3.2-1B: from the hub at start" in proc.stdout
    assert not (tmp_path / "outputs").exists()  # nothing was run


def test_dry_run_shows_the_pipeline_layout(tmp_path):
    proc = run_cli(["debug_cpu", "--dry-run"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "1F1B, 4 microbatches" in proc.stdout and "0: 0-1; 1: 2-3" in proc.stdout


def test_print_config_resolves_every_field(tmp_path):
    proc = run_cli([str(RECIPES / "llm_8b.toml"), "--print-config", "train.steps=7"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "steps = 7" in proc.stdout and 'flavor = "8b"' in proc.stdout and "dp_shard = 8" in proc.stdout


def test_a_malformed_recipe_lists_its_problems_without_a_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[mesh]\ndp_shard = 1\ntp = 3\n[train]\nsteps = "ten"\nseqlen = 4\n[optimizer]\nlr = 0\n')
    proc = run_cli([str(bad)], cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "train.steps" in proc.stderr and "expected int" in proc.stderr
    assert "did you mean train.seq_len?" in proc.stderr
    # after the key/type problems are fixed, the cross-field ones are reported together
    bad.write_text("[mesh]\ndp_shard = 1\ntp = 3\n[train]\nseq_len = 32\n[optimizer]\nlr = 0\n")
    proc = run_cli([str(bad)], cwd=tmp_path)
    assert proc.returncode == 2 and "mesh.tp" in proc.stderr and "optimizer.lr" in proc.stderr


def test_invalid_toml_and_missing_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 1\n")
    proc = run_cli([str(bad)], cwd=tmp_path)
    assert proc.returncode == 2 and "not valid TOML" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli(["debug_cpux"], cwd=tmp_path)
    assert proc.returncode == 2 and "did you mean debug_cpu?" in proc.stderr


def test_a_recipe_this_machine_cannot_run_is_refused_before_starting(tmp_path):
    proc = run_cli([str(RECIPES / "llm_1b.toml")], cwd=tmp_path)  # wants 8 GPUs; this machine has none
    assert proc.returncode == 2
    assert (
        "no GPU is visible" in proc.stderr
        and "train.device=cpu" in proc.stderr
        and "--dry-run" in proc.stderr
    )
    proc = run_cli([str(RECIPES / "llm_1b.toml"), "train.device=cpu"], cwd=tmp_path)
    assert proc.returncode == 2 and "shrink the model" in proc.stderr
    assert not (tmp_path / "outputs").exists()


def test_explain_documents_fields(tmp_path):
    proc = run_cli(["explain", "mesh"], cwd=tmp_path, program="meshforge")
    assert proc.returncode == 0 and "mesh.dp_shard" in proc.stdout and "the rest" in proc.stdout
    proc = run_cli(["explain", "mesh.nope"], cwd=tmp_path, program="meshforge")
    assert proc.returncode == 2 and "fields: dp_replicate" in proc.stderr
    proc = run_cli(["explain", "train.stepz"], cwd=tmp_path, program="meshforge")
    assert proc.returncode == 2 and "did you mean train.steps?" in proc.stderr
    proc = run_cli(["explain", "sed"], cwd=tmp_path, program="meshforge")
    assert (
        proc.returncode == 2 and "did you mean seed?" in proc.stderr and "fields: model, mesh" in proc.stderr
    )
    proc = run_cli(["--help"], cwd=tmp_path)
    # run_recipe --help lists every field with its doc, the top-level ones too
    for field in ("train.micro_batch_size", "  seed:", "  output_dir:", "  run_name:", "  backend:"):
        assert field in proc.stdout, field


def test_print_config_is_toml_that_loads_back_to_the_same_recipe(tmp_path):
    from meshforge.recipe import load_recipe

    args = [
        "debug_cpu",
        "mesh.dp_shard=-1",
        "--nproc",
        "8",
        "pp.schedule=GPipe",
        "model.n_layers=6",
        "sweep.axes={pp.schedule: [1F1B, GPipe]}",
        "logging.wandb_tags=[a,b]",
        "run_name=x",
    ]
    proc = run_cli([*args, "--print-config"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (tmp_path / "printed.toml").write_text(proc.stdout)
    original = load_recipe("debug_cpu", [a for a in args[1:] if "=" in a], world_size=8)
    assert load_recipe(tmp_path / "printed.toml", world_size=8) == original
    assert 'schedule = "GPipe"' in proc.stdout and "[pp]" in proc.stdout


def test_estimate_every_mesh_of_a_world(tmp_path):
    proc = run_cli(
        [
            "estimate",
            str(RECIPES / "llm_8b.toml"),
            "--world",
            "16",
            "--all-meshes",
            "--analytic",
            "--device-memory",
            "80GiB",
        ],
        cwd=tmp_path,
        program="meshforge",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = {line.split("│")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("│ ")}
    assert "7.48" in lines["dp8-tp2"] and "yes" in lines["dp8-tp2"]  # 16 B/param / 16 shards of 8.03B
    assert "119.66" in lines["dprep16"] and "no" in lines["dprep16"]  # replicas shard nothing
    assert "pp16: refused: " in proc.stdout  # refusals are listed under the table, with the reason


def test_a_stopped_rank_exits_130_and_only_rank_0_says_why(monkeypatch, capsys):
    """Under torchrun every rank of a preempted run raises Interrupted: each exits 130, and the
    terminal gets the one line once (from rank 0), with no `error:` prefix and no traceback."""
    from meshforge.cli import main
    from meshforge.core.errors import Interrupted

    line = "stopped by SIGTERM after step 3; checkpoint saved in c/step-00000003; resume: ..."

    def stopped(args):
        raise Interrupted(line)

    said = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        assert main(stopped, None) == 130
        said[rank] = capsys.readouterr().err.strip()
    assert said == {"0": line, "1": ""}


def test_only_a_multi_rank_cpu_run_forks_its_ranks_from_the_rank_server(monkeypatch):
    """The rank server (run/launch/rank_server.py) is started early only for what will fork from it."""
    from meshforge.configs import load_config
    from meshforge.run.launch.rank_server import forks_cpu_ranks

    def forks(*overrides: str) -> bool:
        return forks_cpu_ranks(load_config("debug_cpu", list(overrides))[0])

    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    assert forks()  # the default: 8 CPU ranks
    assert not forks("train.device=cuda") and not forks("train.device=auto")  # CUDA ranks are spawned
    assert not forks("mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1")  # one process trains in place
    assert not forks("mesh.dp_shard=-1")  # sized by the world: known only after validation
    assert not forks("backend=jax")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert not forks()  # under torchrun the workers exist already
