"""`meshforge tune` end to end: the caveats and refusals it prints, bad input, one tune on 2 ranks
(calibrate, predict every layout, confirm the best as Slurm jobs, write the winner) read by the
tests that follow, and `--calibrate-from`'s fit of a profile to measured runs."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from support import QUICK, RECIPES, run_cli, slurm_env
from support.tune_inputs import CPU, LAYOUTS, debug

from meshforge.core.topology import ParallelDims
from meshforge.experiments.grid import Point
from meshforge.experiments.tune_caveats import untraced_caveats, untraced_reason
from meshforge.recipe import load_recipe
from meshforge.run.observe import wandb_files as wf
from meshforge.simulate.core_sharing import counts_to_measure
from meshforge.simulate.estimate import trace_pool
from meshforge.simulate.hardware import Link
from meshforge.simulate.profile_toml import SHIPPED, load_profile, save_profile
from meshforge.simulate.step_time import predict_step
from meshforge.simulate.trace import trace_rank


def test_refining_a_profile_recovers_measured_steps():
    """`--calibrate-from`'s fit: steps 'measured' on a machine 2x slower at matmuls, 3x at host
    work per op and 4x at link latency than the profile says, which the profile alone misses by
    40% or more: the fitted profile halves every run's error at least, and misses the median run
    by under 10% (not 0: the pull towards the calibrated constants weighs against the runs' mean
    square, and soft L1 counts the largest misses less than squared)."""
    from meshforge.experiments.refine import MeasuredRun, fit_factors, scaled

    layouts = {**LAYOUTS, "pp2": ["mesh.pp=2"], "fsdp2_tp2": ["mesh.dp_shard=2", "mesh.tp=2"]}
    with trace_pool() as pool:
        traces = {}
        for name, o in layouts.items():
            recipe = debug(*o)
            dims = ParallelDims.from_config(recipe.mesh)
            traces[name] = (
                dims,
                {dims.coordinate(r)["pp"]: pool.submit(trace_rank, recipe, r) for r in dims.role_ranks()},
            )
        traced = {n: (d, {pp: f.result()["work"] for pp, f in t.items()}) for n, (d, t) in traces.items()}
    profile = dataclasses.replace(
        CPU, op_overhead_s=1e-5, dtensor_op_overhead_s=3e-5, links={2: Link(5e-4, 1e9)}, kind_links={}
    )
    truth = {
        "matmul": 0.5,
        "memory": 1.0,
        "op_host": 3.0,
        "dtensor_host": 1.0,
        "latency": 4.0,
        "bandwidth": 1.0,
    }
    machine = scaled(profile, truth)
    runs = [MeasuredRun(n, w, d, 1, predict_step(w, d, 1, machine).step_s, 1) for n, (d, w) in traced.items()]
    before = [abs(r.predict(profile) / r.step_s - 1) for r in runs]
    factors = fit_factors(runs, profile)
    after = [abs(r.predict(scaled(profile, factors)) / r.step_s - 1) for r in runs]
    assert min(before) > 0.4, before
    assert all(a <= b / 2 for a, b in zip(after, before)) and sorted(after)[2] < 0.1, (before, after, factors)
    # the runs weigh as one against the pull: three copies of each run move no constant further
    tripled = fit_factors(runs * 3, profile)
    assert all(abs(tripled[k] / factors[k] - 1) < 0.02 for k in factors), (tripled, factors)


def test_the_fits_soft_l1_residuals_square_to_scipys_loss():
    """refine._soft_l1(m)^2 is scipy's soft_l1 of the miss at ROBUST_SCALE: ~m^2 for small misses,
    growing linearly for large ones (a layout missed by 60% weighs ~12x one missed by 10%, not 36x)."""
    from meshforge.experiments.refine import ROBUST_SCALE, _soft_l1

    m = np.array([-0.6, -0.1, -1e-9, 0.0, 1e-9, 0.01, 0.1, 0.6])
    c = ROBUST_SCALE
    assert np.allclose(_soft_l1(m) ** 2, c * c * 2 * (np.sqrt(1 + (m / c) ** 2) - 1), rtol=1e-9, atol=1e-18)
    assert np.allclose(_soft_l1(-m), -_soft_l1(m)) and abs(_soft_l1(np.array([1e-9]))[0] / 1e-9 - 1) < 1e-6
    assert 10 < (_soft_l1(np.array([0.6])) / _soft_l1(np.array([0.1])))[0] ** 2 < 15


def test_a_refined_profiles_file_name_takes_no_quotes():
    """A GPU's calibrated profile is named for its device ("NVIDIA H200"): the refined file's name
    has no space a shell would split on, and keeps what names it."""
    from meshforge.experiments.refine import profile_file_stem

    assert profile_file_stem("NVIDIA H200+runs") == "NVIDIA-H200+runs"
    assert profile_file_stem("vm-01.local+runs") == "vm-01.local+runs"
    assert profile_file_stem("a / b (c)") == "a-b-c"


def test_a_tune_says_when_the_recipe_asks_what_the_eager_trace_does_not_model():
    """On one H200 tune predicted compiled llm_1b 11-16% long, float8 68-97% long and CPU offload
    85% short: the table says so, and refuses them as axes."""
    recipe, dp = str(RECIPES / "debug_cpu.toml"), ["mesh.tp=1", "mesh.pp=1", "mesh.dp_shard=2"]
    assert untraced_caveats(load_recipe(recipe, dp)) == []
    (compiled,) = untraced_caveats(load_recipe(recipe, [*dp, "compile.enabled=true"]))
    assert compiled.startswith("compile.enabled = true: each step is predicted as eager")
    budget = [*dp, "compile.enabled=true", "activation_checkpoint.mode=memory_budget"]
    assert [line.split(":")[0] for line in untraced_caveats(load_recipe(recipe, budget))] == [
        "compile.enabled = true",
        "activation_checkpoint.mode = memory_budget",
    ]
    offload = untraced_caveats(load_recipe(recipe, [*dp, "fsdp.cpu_offload=true"]))
    assert offload == [
        "fsdp.cpu_offload = true: step times are not to be trusted: the host's optimizer step and the "
        "copies to and from it are not modelled"
    ]
    (per_op,) = untraced_caveats(load_recipe(recipe, [*dp, "activation_checkpoint.mode=op"]))
    assert per_op.startswith("activation_checkpoint.mode = op: priced as full AC's hooks per block")
    by_op = Point("dp2-mode=op", {"dp_shard": 2}, {"activation_checkpoint.mode": "op"})
    assert untraced_caveats(load_recipe(recipe, dp), [by_op]) == [per_op]  # a point's mode, as an axis
    # an MoE block's checkpointing hooks are priced at a dense block's: said where a point checkpoints
    moe = load_recipe(RECIPES / "qwen3_30b_a3b.toml", ["activation_checkpoint.mode=none"])
    no_ac = Point("dp8", {"dp_shard": 8}, {})
    assert untraced_caveats(moe, [no_ac]) == []
    (moe_ac,) = untraced_caveats(
        moe, [no_ac, Point("dp8-full", {"dp_shard": 8}, {"activation_checkpoint.mode": "full"})]
    )
    assert moe_ac.startswith("checkpointed MoE blocks: their hooks are priced at a dense block's")
    moe_full = load_recipe(RECIPES / "qwen3_30b_a3b.toml")  # its own mode: full
    assert untraced_caveats(moe_full) == [moe_ac]
    none_axis = [Point(f"dp8-{m}", {"dp_shard": 8}, {"activation_checkpoint.mode": "none"}) for m in "ab"]
    assert untraced_caveats(moe_full, none_axis) == []  # every point overrides the recipe's full
    # a profile without checkpointing's price (a shipped GPU one) says so in its own line instead
    assert untraced_caveats(moe_full, block_hooks_priced=False) == []
    (float8,) = untraced_caveats(load_recipe(recipe, [*dp, "float8.enabled=true"]))
    assert float8.startswith("float8.enabled = true: step times are not to be trusted: float8's matmuls")
    # as axes they are refused (a key, a float8.* key by its prefix, the budget among AC modes)
    for key, values in [
        ("float8.exclude", ["[output]", "[]"]),
        ("float8.enabled", ["true", "false"]),
        ("fsdp.cpu_offload", ["true", "false"]),
        ("compile.enabled", ["true", "false"]),
        ("activation_checkpoint.mode", ["full", "memory_budget"]),
    ]:
        assert untraced_reason(key, values), key
    assert untraced_reason("activation_checkpoint.mode", ["none", "full", "op"]) is None
    assert untraced_reason("fsdp.reshard_after_forward", ["true", "false"]) is None


@pytest.mark.slow
def test_a_tune_plan_says_an_moe_blocks_checkpointing_hooks_are_priced_as_a_dense_blocks(tmp_path):
    """The shrunk Qwen3 MoE recipe (its own AC: full) over 2 ranks with a profile that prices
    checkpointing's hooks: tune says, under its table, that an MoE block's are priced short."""
    priced = tmp_path / "priced.toml"
    text = SHIPPED["h100"].read_text()
    priced.write_text(text.replace("checkpoint_overhead_s = 0.0", "checkpoint_overhead_s = 1e-4"))
    # as the recipe's header shrinks it for 8 CPU processes
    shrunk = "model.n_layers=2 model.dim=128 model.n_heads=4 model.n_kv_heads=2 model.head_dim=32 "
    shrunk += "model.moe_dim=64 model.num_experts=16 model.vocab_size=1024 train.seq_len=128"
    args = ["tune", str(RECIPES / "qwen3_30b_a3b.toml"), "--world", "2", "--plan", "--profile", str(priced)]
    axis = ["--axis", "activation_checkpoint.mode=none,full"]
    proc = run_cli(
        [*args, *axis, *shrunk.split(), "fsdp.param_dtype=float32"], cwd=tmp_path, program="meshforge"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = " ".join(proc.stdout.split())
    assert "checkpointed MoE blocks: their hooks are priced at a dense block's" in said, proc.stdout
    # piped, the table is as wide as it needs: in rich's 80 columns its step cells read "0.041…"
    assert "…" not in proc.stdout and re.search(r"│ cp2-ep2-mode=full\s+│ 0\.\d{3,}", proc.stdout), (
        proc.stdout
    )
    assert "does not price FSDP's hooks per unit" in said and "checkpointing's hooks" not in said


def test_a_tune_plan_says_when_layouts_change_the_global_batch(tmp_path):
    """A fixed micro batch (2 sequences of 32 tokens): dp2 trains on twice the tokens of tp2 per step."""
    batch = ["train.global_batch_size=-1", "train.micro_batch_size=2", "train.grad_accum_steps=1"]
    args = ["tune", str(RECIPES / "debug_cpu.toml"), "--world", "2", "--plan", "--profile", "h100"]
    proc = run_cli([*args, *QUICK, *batch], cwd=tmp_path, program="meshforge")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "highest tokens/s first" in proc.stdout
    assert "train on 64 to 128 tokens per step" in " ".join(proc.stdout.split()), proc.stdout
    # the shipped profile never measured its host's FSDP hooks: said before the table
    said = " ".join(proc.stdout.split())
    assert "profile h100 does not price FSDP's hooks per unit" in said
    assert "--calibrate --world 1 --profile-out gpu.toml` on a GPU node" in said  # what a GPU can run
    # 4 of the 5 layouts of 2 ranks ranked; pp2 refused (its 4 microbatches need 4 samples), said so
    assert re.search(r"^predicted 4 of 5 points in \d+ s \(1 refused\)$", proc.stdout, re.MULTILINE)


def test_bad_tune_input_is_refused_naming_it(tmp_path):
    recipe = str(RECIPES / "debug_cpu.toml")
    proc = run_cli(
        ["tune", recipe, "--world", "2", "--plan", "--profile", "h10"], cwd=tmp_path, program="meshforge"
    )
    assert (
        proc.returncode == 2 and "did you mean h100?" in proc.stderr and "shipped: h100, h200" in proc.stderr
    )
    proc = run_cli(
        [
            "tune",
            recipe,
            "--world",
            "2",
            "--plan",
            "--profile",
            "h100",
            "--axis",
            "compile.enabled=true,false",
        ],
        cwd=tmp_path,
        program="meshforge",
    )
    assert (
        proc.returncode == 2 and "--axis compile.enabled" in proc.stderr and "trace runs eager" in proc.stderr
    )
    assert "in the recipe" not in proc.stderr  # an axis is the command line's
    bad = tmp_path / "p.toml"
    bad.write_text(SHIPPED["h100"].read_text().replace("memory_Bps", "memory_bps"))
    proc = run_cli(
        ["tune", recipe, "--world", "2", "--plan", "--profile", str(bad)], cwd=tmp_path, program="meshforge"
    )
    assert proc.returncode == 2 and "memory_bps" in proc.stderr and "did you mean memory_Bps?" in proc.stderr
    assert "problem(s) in the recipe" not in proc.stderr
    missing = tmp_path / "no-such-sweep"  # a typo in --calibrate-from is named, not skipped
    proc = run_cli(
        ["tune", recipe, "--world", "2", "--plan", "--profile", "h100", "--calibrate-from", str(missing)],
        cwd=tmp_path,
        program="meshforge",
    )
    assert proc.returncode == 2 and f"--calibrate-from {missing}: no such folder" in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """`meshforge tune` end to end on 2 ranks: calibrate this machine, predict every layout, run
    the best predicted and the recipe's own (dp2) as Slurm jobs (support/fake_slurm.py runs them here),
    W&B offline."""
    out = tmp_path_factory.mktemp("tune")
    args = [
        "tune",
        str(RECIPES / "debug_cpu.toml"),
        "--world",
        "2",
        "--top",
        "1",
        "--calibrate",
        "--profile-out",
        str(out / "profile.toml"),
        "mesh.dp_shard=2",
        "mesh.tp=1",
        "mesh.pp=1",
        *QUICK,
        "sweep.steps=5",
        f"output_dir={out}",
        "logging.wandb=true",
        "logging.wandb_mode=offline",
        "sweep.launcher=slurm",
        "sweep.slurm.poll_s=0.5",
    ]
    proc = run_cli(args, cwd=out, program="meshforge", timeout=900, env=slurm_env(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


@pytest.mark.slow
def test_tune_predicts_confirms_and_writes_the_winner(tuned):
    out, stdout = tuned
    folder = out / "tune-debug_cpu-w2"
    rows = {r["label"]: r for r in map(json.loads, (folder / "tune.jsonl").read_text().splitlines())}
    assert set(rows) == {"dprep2", "dp2", "cp2", "tp2", "pp2"}  # every layout of 2 ranks
    planned = [r for r in rows.values() if r["status"] != "skipped" and "predicted" in r]
    assert len(planned) == 5 and all(r["predicted"]["step_s"] > 0 for r in planned)
    assert rows["pp2"]["predicted"]["bubble"] > 0 and rows["dp2"]["predicted"]["bubble"] == 0
    best = max(planned, key=lambda r: r["predicted"]["tokens_per_sec_per_device"])
    confirmed = {label for label, r in rows.items() if "measured" in r}
    assert confirmed == {best["label"], "dp2"}  # the top 1 and the recipe's own
    jobs = [json.loads(line) for line in (folder / "confirm.jsonl").read_text().splitlines()]
    assert {r["label"] for r in jobs if r["status"] == "queued"} == confirmed  # each one a Slurm job
    assert all((folder / "jobs" / f"{label}.sbatch").is_file() for label in confirmed)
    for label in confirmed:
        assert rows[label]["status"] == "finished" and rows[label]["measured"]["step_time"] > 0
        assert f"{label}" in stdout
    assert "predicted vs measured" in stdout and "fastest measured:" in stdout
    winner = max(confirmed, key=lambda label: rows[label]["measured"]["tokens_per_sec"])
    recipe = load_recipe(str(folder / "tune-best.toml"), [], world_size=2)
    assert ParallelDims.from_config(recipe.mesh).label() == winner
    assert load_profile(out / "profile.toml").calibrated_world == 2
    (table_run,) = wf.run_files(folder)  # the predicted-vs-measured table, as W&B wrote it offline
    assert wf.run_record(table_run).job_type == "tune-summary"


@pytest.mark.slow
def test_the_tunes_calibration_measured_plausible_numbers(tuned, tmp_path):
    """The profile `--calibrate` measured for the tune (2 ranks, the cores split between them): rates
    in range, one link per group size, a collective dearer for more bytes, and the file round-trips."""
    out, stdout = tuned
    profile = load_profile(out / "profile.toml")
    assert 1e8 < profile.matmul_rate("float32") < 1e13 and profile.matmul_rate("bfloat16") > 0
    # flash attention on a CPU: slower than the matmuls, not by orders of magnitude in fp32
    assert sorted(profile.attention_flops) == ["bfloat16", "float32"]
    assert 0.05 < profile.attention_rate("float32") / profile.matmul_rate("float32") < 2
    assert profile.memory_Bps > 0 and 0 < profile.op_overhead_s < profile.fsdp_unit_overhead_s < 0.1
    assert profile.op_overhead_s < profile.checkpoint_overhead_s < 0.1 and "per checkpointed block" in stdout
    # 2 ranks on this machine's cores: sharing measured only where they outnumber the cores
    assert set(profile.sharing_slowdown) == set(counts_to_measure(2, 1, profile.shared_cores))
    assert 0.3 < profile.model_rate_share < 1.2 and profile.unpriced(2) == []
    assert "model rate share" in stdout  # its row in the printed table
    # the pair's wait for its last rank, a share and its bound, measured and printed
    assert list(profile.arrival_skew) == list(profile.arrival_skew_cap) == [2]
    assert profile.arrival_skew_cap[2] < 0.25 and "that wait at most" in stdout
    assert list(profile.links) == [2] and profile.calibrated_world == 2 and profile.shared_cores >= 1
    link = profile.link(2, False)
    assert 0 <= link.latency_s < 0.1 and link.bandwidth_Bps > 0
    assert profile.collective_time("all_gather", 4 << 20, 2) > profile.collective_time(
        "all_gather", 4 << 10, 2
    )
    save_profile(profile, tmp_path / "again.toml")
    assert load_profile(tmp_path / "again.toml") == profile
    assert "hardware profile" in stdout and "calibrated in" in stdout  # its summary, on the terminal


@pytest.mark.slow
def test_calibrate_from_refines_the_profile_by_the_tunes_runs(tuned, tmp_path):
    """`--calibrate-from` the tune's folder: its 2 measured points traced again and fitted, the fit
    printed run by run, the refined profile written where the next tune reads it, then used."""
    out, _ = tuned
    args = [
        "tune",
        str(RECIPES / "debug_cpu.toml"),
        "--world",
        "2",
        "--plan",
        "--profile",
        str(out / "profile.toml"),
    ]
    proc = run_cli(
        [*args, *QUICK, "--calibrate-from", str(out / "tune-debug_cpu-w2")], cwd=tmp_path, program="meshforge"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    base = load_profile(out / "profile.toml")
    (written,) = tmp_path.glob("meshforge-profile-*+runs.toml")
    refined = load_profile(written)
    assert refined.name == f"{base.name}+runs" and "refined by 2 measured runs" in refined.source
    assert f"profile {base.name} refined by 2 runs" in proc.stdout and "factors: matmul x" in proc.stdout
    assert f"profile {refined.name}" in proc.stdout  # the tune then predicts with it
    # the fit moved the constants: not every rate as it was
    assert (refined.matmul_flops, refined.op_overhead_s) != (base.matmul_flops, base.op_overhead_s)
