"""Sweeps over 4-rank meshes of the debug recipe (every dimension, a refusal, a failure), and the
offline comparison of their records."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from support import QUICK, RECIPES, TRACKED, cli_env, run_cli, running

from meshforge.core.errors import UsageError
from meshforge.core.topology import LAYOUT_DIMS, ParallelDims
from meshforge.core.units import GiB
from meshforge.experiments import compare
from meshforge.experiments.grid import mesh_shapes, sweep_points
from meshforge.run.observe import wandb_files as wf

# the pp=4 point fails at its first step, on purpose: it must be recorded, not fatal
FAIL_PP4 = """
import meshforge.run.train.trainer as t
original = t.Trainer.train_step
def step(self, n):
    if self.dims.pp == 4:
        raise RuntimeError("deliberate failure of the pp4 point")
    return original(self, n)
t.Trainer.train_step = step
"""


def test_every_mesh_of_a_world_is_enumerated():
    shapes = mesh_shapes(8)
    assert len(shapes) == 35 and len({tuple(s.values()) for s in shapes}) == 35  # 5 dims: C(3 + 4, 4)
    assert all(s["dp_replicate"] * s["dp_shard"] * s["cp"] * s["tp"] * s["pp"] == 8 for s in shapes)
    # the dim order has one owner: ParallelDims' fields are the layout's dims (the mesh's, then ep,
    # borrowed, no factor of the world), and shapes come in sweep order
    assert {f.name for f in dataclasses.fields(ParallelDims)} == set(LAYOUT_DIMS) and list(shapes[0]) == list(
        LAYOUT_DIMS
    )
    assert [tuple(s.values()) for s in shapes[:3]] == [
        (8, 1, 1, 1, 1, 1),
        (4, 1, 1, 1, 2, 1),
        (2, 1, 1, 1, 4, 1),
    ]
    assert {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2, "ep": 1} in shapes
    # a model with experts crosses each shape with every ep that divides its dp_shard x cp (whose ranks
    # ep borrows) and the experts (split whole): with 4 experts, ep 1, 2 or 4
    with_ep = mesh_shapes(8, experts=4)
    assert {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2, "ep": 4} in with_ep
    assert {"pp": 1, "dp_replicate": 1, "dp_shard": 8, "cp": 1, "tp": 1, "ep": 8} not in with_ep
    assert len(with_ep) == sum(sum(s["dp_shard"] * s["cp"] % e == 0 for e in (1, 2, 4)) for s in shapes)
    assert ParallelDims.from_degrees({**shapes[1], "label": "x"}).label() == "tp2-pp4"
    # a record written before cp was a dimension (run.json's "mesh", a sweep row) reads as cp 1
    before_cp = {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 2}
    assert ParallelDims.from_degrees(before_cp) == ParallelDims(dp_shard=4, tp=2)
    with pytest.raises(KeyError):  # but a record without a dim it always had is not guessed
        ParallelDims.from_degrees({"pp": 1, "dp_replicate": 1, "tp": 2})
    # a policy is crossed with the meshes that read it: pp.schedule with the pipelines only (on pp=1
    # each value would be the same run again under another name), activation checkpointing with all
    axes = {"pp.schedule": ["1F1B", "GPipe"], "activation_checkpoint.mode": ["none", "full"]}
    points = sweep_points(4, axes)
    pipelines = sum(m["pp"] > 1 for m in mesh_shapes(4))
    assert pipelines == 5 and len(points) == 2 * 15 + 2 * pipelines == 40
    labels = {p.label for p in points}
    assert {"dp2-pp2-schedule=GPipe-mode=full", "dp2-tp2-mode=none"} <= labels and len(labels) == len(points)
    assert not any("schedule" in p.label for p in points if p.mesh["pp"] == 1)
    assert (
        sweep_points(4, {"tp.sequence_parallel": ["true", "false"], "cp.method": ["allgather", "alltoall"]})[
            0
        ].policy
        == {}
    )  # dp_replicate 4: neither is read


def test_the_policies_a_sweep_leaves_out_on_degree_1_are_unread_there():
    """What the sweep relies on to leave a policy out on a mesh: every field of that section says,
    in the doc `meshforge explain` shows, that its dimension at degree 1 does not read it."""
    from meshforge.configs import Recipe
    from meshforge.recipe.inert import UNREAD_AT_DEGREE_1

    for dim, section in UNREAD_AT_DEGREE_1.items():
        cfg = getattr(Recipe(), section.rstrip("."))
        for f in dataclasses.fields(cfg):
            assert f"unread with mesh.{dim} = 1" in f.metadata["doc"], (section, f.name)


def test_compare_errors_say_what_to_pass_and_exit_2(tmp_path):
    with pytest.raises(UsageError, match="expected <run>/run.json") as e:
        compare.find_runs([tmp_path])
    assert e.value.exit_code == 2
    runs = [compare.Run(name, tmp_path / name, {}, []) for name in ("dp4", "dp2-tp2")]
    with pytest.raises(UsageError, match="--baseline 'dp8' is not among the runs; use one of: dp4, dp2-tp2"):
        compare.parity(runs, "dp8", 1e-5)


# six of the ten 4-rank layouts: every mesh dimension, the refused tp4 and the failing pp4 (all ten
# are planned by test_slurm_sweep's --plan test; each launch here costs ~25 s of the suite)
LAYOUTS = ["dp4", "dp2-tp2", "dp2-pp2", "dprep2-dp2", "tp4", "pp4"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    hook = out / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FAIL_PP4)
    env = cli_env(PYTHONPATH=str(hook))
    args = [
        str(RECIPES / "debug_cpu.toml"),
        "--sweep",
        "--world",
        "4",
        *QUICK,
        TRACKED,  # each point's step-2 peak by category, against the estimate
        "sweep.steps=3",
        f"sweep.only=[{','.join(LAYOUTS)}]",
        f"output_dir={out}",
        "logging.wandb=true",
        "logging.wandb_mode=offline",
    ]
    first = run_cli(args, cwd=out, env=env, timeout=1200)
    assert first.returncode == 0, first.stderr[-3000:]
    sweep_dir = out / "sweep-debug_cpu-w4"
    mtimes = {p: p.stat().st_mtime for p in sweep_dir.glob("*/metrics.jsonl") if p.parent.name != "pp4"}
    second = run_cli(args, cwd=out, env=env, timeout=1200)  # resumable: finished points are kept
    assert second.returncode == 0, second.stderr[-3000:]
    return sweep_dir, first.stdout, second.stdout, mtimes


# a point as a sweep runs one: its launcher (which records each stop signal, and passes the first on
# to its rank and exits 130, or ignores it) and a rank in its process group (which records what
# reaches it and stops); each says it is ready with its pid
POINT = """
import os, signal, sys, time
path, leave = sys.argv[1], sys.argv[2] == "exit"
def record(where, signum):
    with open(where, "a") as f:
        f.write(signal.Signals(signum).name + "\\n")
rank = os.fork()
if rank == 0:
    def stop(signum, frame):
        record(path + ".rank", signum)
        os._exit(0)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, stop)
    with open(path + ".rank", "w") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(60)
    os._exit(1)
def launcher_stop(signum, frame):
    record(path, signum)
    if leave:
        os.kill(rank, signum)
        os.waitpid(rank, 0)
        sys.exit(130)
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, launcher_stop)
while not os.path.isfile(path + ".rank") or not open(path + ".rank").read().endswith("\\n"):
    time.sleep(0.01)
with open(path, "w") as f:
    f.write(f"{os.getpid()}\\n")
time.sleep(60)
"""


@pytest.mark.parametrize(
    "signals, point, rc",
    [(["SIGINT"], "exit", 130), (["SIGTERM"], "exit", 130), (["SIGINT", "SIGINT"], "stay", -9)],
)
def test_a_stopped_sweep_stops_its_running_point(tmp_path, signals, point, rc):
    """A point runs in its own session, out of a terminal's Ctrl-C: a SIGINT or SIGTERM to the sweep
    (or tune) goes to the point's launcher alone (a SIGTERM to its group would kill its ranks' fork
    server), which stops its ranks; the point is waited for and the sweep stops naming the signal;
    a second signal kills the point's whole group. Before, the sweep exited and its point trained on
    alone."""
    import threading

    from meshforge.core.errors import Interrupted
    from meshforge.experiments.point_process import run_point

    seen = tmp_path / "seen"

    def signal_the_sweep() -> None:
        while not seen.is_file() or not seen.read_text().endswith("\n"):
            time.sleep(0.05)
        for name in signals:
            os.kill(os.getpid(), getattr(signal, name))
            time.sleep(0.5)

    threading.Thread(target=signal_the_sweep, daemon=True).start()
    with pytest.raises(
        Interrupted, match=rf"stopped by {signals[0]}: its running point stopped too \(exit code {rc};"
    ):
        run_point([sys.executable, "-c", POINT, str(seen), point], 60, tmp_path / "point.log")
    launcher, *launcher_got = seen.read_text().split()
    rank, *rank_got = (tmp_path / "seen.rank").read_text().split()
    assert launcher_got == signals[:1]  # a second is SIGKILL, which nothing records
    assert rank_got == (signals[:1] if point == "exit" else [])  # once, from its launcher; or killed
    deadline = time.monotonic() + 10  # an orphaned rank's zombie waits for whoever adopted it
    while running(int(launcher)) or running(int(rank)):
        assert time.monotonic() < deadline, "the point or its rank still runs"
        time.sleep(0.1)


def test_a_stop_asked_while_the_point_starts_reaches_it_once_started(tmp_path):
    """A Ctrl-C between the point's fork and the sweep knowing its pid is not lost: it is passed on
    as soon as the point has started, and the point's launcher stops as it would have."""
    from meshforge.experiments.point_process import PassStop

    seen = tmp_path / "seen"
    with PassStop() as stop:
        stop._pass(signal.SIGINT, None)  # as the handler runs when the signal lands
        point = subprocess.Popen([sys.executable, "-c", POINT, str(seen), "exit"], start_new_session=True)
        while not seen.is_file() or not seen.read_text().endswith("\n"):
            assert point.poll() is None, "the point was stopped before it could handle a stop"
            time.sleep(0.05)
        stop.started(point)
        assert point.wait(timeout=30) == 130
    assert stop.name == "SIGINT" and seen.read_text().split()[1:] == ["SIGINT"]


@pytest.mark.slow
def test_sweep_records_every_point(sweep):
    sweep_dir, out, _, _ = sweep
    rows = {}
    for line in (sweep_dir / "sweep.jsonl").read_text().splitlines():
        rows[json.loads(line)["label"]] = json.loads(line)
    assert set(rows) == set(LAYOUTS)  # one row per point, whatever became of it
    status = {k: r["status"] for k, r in rows.items()}
    assert status["tp4"] == "refused" and "n_kv_heads=2" in rows["tp4"]["error"]  # debug model: 2 kv heads
    assert status["pp4"] == "failed" and "deliberate failure of the pp4 point" in rows["pp4"]["error"]
    finished = [r for r in rows.values() if r["status"] == "finished"]
    assert len(finished) == 4
    for r in finished:
        assert r["tokens_per_sec"] > 0 and r["peak_gib_max"] >= r["peak_gib_min"] > 0
        assert r["estimate_gib"] > 0 and r["final_loss"] > 0
        # the traced estimate that decides skips: within 5% of the peak the point measured on step 2
        per_rank = json.loads((sweep_dir / r["label"] / "run.json").read_text())["summary"][
            "memory_breakdown"
        ]["per_rank"]
        assert abs(r["estimate_bytes"] / GiB / max(p["total_gib"] for p in per_rank) - 1) <= 0.05, r["label"]
        assert set(r["mesh"]) == set(LAYOUT_DIMS)  # cp and ep included
    best = max(finished, key=lambda r: r["tokens_per_sec"])
    assert f"fastest layout that fits: {best['label']}" in out
    assert " ".join(best["overrides"]) in out  # the overrides that reproduce it


@pytest.mark.slow
def test_sweep_is_resumable(sweep):
    sweep_dir, _, second, mtimes = sweep
    assert second.count("finished earlier, kept") == 4 and "refused earlier, kept" in second
    assert all(p.stat().st_mtime == t for p, t in mtimes.items())  # finished points were not rerun
    # the failed one was tried again (point 1 of 6: pp4 comes first), not kept
    assert "[1/6] pp4: failed" in second and "pp4: failed earlier" not in second


@pytest.mark.slow
def test_points_are_grouped_runs_in_wandb(sweep):
    sweep_dir, _, _, _ = sweep
    offline = list(sweep_dir.glob("dp2-tp2/wandb/offline-run-*"))
    assert offline  # each point is its own W&B run (offline here), in the sweep's group
    info = json.loads((sweep_dir / "dp2-tp2" / "run.json").read_text())
    assert info["recipe"]["logging"]["wandb_group"] == "debug_cpu/sweep-debug_cpu-w4"
    assert "sweep" in info["recipe"]["logging"]["wandb_tags"]
    # as W&B itself recorded it: a sweep point, in the group, the nested recipe with its layout
    (point,) = wf.run_files(sweep_dir / "dp2-tp2")
    run = wf.run_record(point)
    assert run.job_type == "sweep-point" and run.run_group == "debug_cpu/sweep-debug_cpu-w4"
    config = wf.config(point)
    assert (
        config["mesh"]["tp"] == 2 and config["mesh"]["dp_shard"] == 2 and config["pp"]["schedule"] == "1F1B"
    )
    assert config["layout"] == "dp2-tp2" and config["world_size"] == 4
    summaries = wf.run_files(sweep_dir)  # a summary table run per sweep command, in the sweep folder
    assert len(summaries) == 2 and {wf.run_record(s).job_type for s in summaries} == {"sweep-summary"}


@pytest.mark.slow
def test_compare_renders_table_and_plots(sweep, tmp_path):
    sweep_dir, _, _, _ = sweep
    proc = run_cli(
        [
            "compare",
            str(sweep_dir),
            "--out",
            str(tmp_path / "plots"),
            "--metrics",
            "loss,grad_norm",
            "--align",
            "tokens",
        ],
        cwd=tmp_path,
        program="meshforge",
    )
    assert proc.returncode == 0, proc.stderr
    assert "dp2-tp2" in proc.stdout and "1F1B x4" in proc.stdout and "loss @ step 3" in proc.stdout
    for name in (
        "loss_vs_tokens.png",
        "grad_norm_vs_tokens.png",
        "tokens_per_sec.png",
        "peak_memory_per_rank.png",
    ):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    runs = compare.find_runs([sweep_dir])
    assert len(runs) == 5  # 4 finished + the failed pp4 (refused tp4 never ran)
    fig = compare.plot_metric(runs, "loss")
    assert len(fig.axes[0].get_lines()) == len(runs)  # one line per run
    mem = compare.plot_memory(runs)
    assert len(mem.axes[0].patches) == 4 * 4  # 4 ranks x 4 runs that logged memory


@pytest.mark.slow
def test_parity_mode_flags_a_perturbed_run(sweep, tmp_path):
    sweep_dir, _, _, _ = sweep
    runs = tmp_path / "runs"
    for name in ("dp4", "dp2-tp2"):
        shutil.copytree(sweep_dir / name, runs / name)
    shutil.copytree(sweep_dir / "dp2-pp2", runs / "perturbed")
    metrics = runs / "perturbed" / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    rows[1]["loss"] += 1e-3
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_cli(
        ["compare", str(runs), "--baseline", "dp4", "--out", str(tmp_path / "p")],
        cwd=tmp_path,
        program="meshforge",
    )
    assert proc.returncode == 1
    results = {p["run"]: p for p in compare.parity(compare.find_runs([runs]), "dp4", 1e-5)}
    assert results["dp2-tp2"]["ok"] and results["dp2-tp2"]["max_dloss"] < 1e-5
    assert not results["perturbed"]["ok"] and results["perturbed"]["max_dloss"] == pytest.approx(
        1e-3, rel=1e-3
    )


def test_an_axis_no_layout_reads_or_that_does_not_parse_is_refused():
    """Crossing a policy only with the meshes that read it must not hide a bad axis: one that no
    layout of the grid reads (no pipeline among 1 rank's layouts) changes nothing, and a value is
    checked as its field."""
    from meshforge.configs import RecipeError
    from meshforge.experiments.grid import grid_points

    recipe = str(RECIPES / "debug_cpu.toml")
    with pytest.raises(RecipeError) as e:
        grid_points(recipe, [], 1, {"pp.schedule": ["1F1B", "GPipe"]}, [], 0)
    assert [str(p) for p in e.value.problems] == [
        "axis pp.schedule = ['1F1B', 'GPipe']: no layout of this grid reads it (degree 1)"
    ]
    with pytest.raises(RecipeError) as e:
        grid_points(recipe, [], 4, {"pp.schedul": ["1F1B"], "tp.sequence_parallel": ["maybe"]}, [], 0)
    said = [str(p) for p in e.value.problems]
    assert "pp.schedul = '1F1B': unknown key; did you mean pp.schedule?" in said
    assert "tp.sequence_parallel = 'maybe': wrong type: expected bool" in said
    points = grid_points(recipe, [], 4, {"pp.schedule": ["1F1B", "GPipe"]}, ["dp2-pp2", "dp4"], 0)
    assert [p.label for p in points] == ["dp2-pp2-schedule=1F1B", "dp2-pp2-schedule=GPipe", "dp4"]
