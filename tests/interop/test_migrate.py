"""`meshforge import-config` whatever the source: files that are not configs and unknown models
are refused, and imported recipes (DeepSpeed's and TorchTitan's) run as a user runs them. The
per-format mappings: test_migrate_deepspeed.py, test_migrate_torchtitan.py."""

from __future__ import annotations

import pytest
from support import read_metrics, run_cli, run_recipe
from support.import_configs import DS, TITAN, titan_moe_job

from meshforge.core.errors import UsageError
from meshforge.migrate import import_config


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


@pytest.mark.parametrize(
    "model, says",
    [("nope:debug", "no model family 'nope'; families: llama3"), ("llama3:nope", "no flavor 'nope'")],
)
def test_an_unknown_model_is_named_with_the_choices(tmp_path, model, says):
    with pytest.raises(UsageError, match=says):  # was a KeyError's traceback
        import_config(DS / "seeds_pipeline_fp16.json", tmp_path / "x.toml", 3, model=model)


@pytest.mark.slow
def test_imported_recipes_run(tmp_path):
    """The seeds' DeepSpeed example (3 pipeline stages, fp16), TorchTitan's debug job and its Qwen3
    MoE job with expert parallel 2, imported and run as a user would, on CPU processes (sizes
    overridden for the laptop)."""
    small_moe = ["model.num_experts=8", "model.num_experts_per_tok=2", "model.moe_dim=64"]
    cases = [
        (DS / "seeds_pipeline_fp16.json", ["--world", "3", "--model", "llama3:debug"], 3, []),
        (TITAN / "debug_model.toml", ["--world", "2"], 2, []),
        (titan_moe_job(tmp_path, expert_parallel_degree=2), ["--world", "2"], 2, small_moe),
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
