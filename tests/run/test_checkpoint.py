"""Checkpoints and failures: nothing is lost, and a resumed run continues exactly, on any mesh."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from support import QUICK, RECIPES, cli_env, read_metrics, run_cli, run_recipe

from meshforge.core.errors import CheckpointNotFound
from meshforge.run.checkpoint.dcp import committed, resolve_load

ONE_RANK = ["mesh.dp_replicate=1", "mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1"]
CKPT = ["checkpoint.enabled=true", "checkpoint.interval=5", "checkpoint.keep_latest=0"]

# sitecustomize hooks, injected into every worker; RANK is read at call time
# rank 1 dies while the launcher is paused for half a second (as on a loaded machine), so the
# launcher wakes to its peers' broken collectives too and must still name rank 1
KILL_RANK1_AT_STEP7 = """
import os, signal, subprocess
import meshforge.run.train.trainer as t
original = t.Trainer.train_step
def step(self, n):
    if os.environ.get("RANK") == "1" and self.state.step == 6:
        with open(f"/proc/{os.getppid()}/stat") as f:  # rank <- rank server <- launcher
            launcher = int(f.read().rsplit(")", 1)[1].split()[1])
        os.kill(launcher, signal.SIGSTOP)
        subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -CONT {launcher}"], start_new_session=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, n)
t.Trainer.train_step = step
"""
NAN_AT_STEP4 = """
import meshforge.run.train.forward_backward as fb
import meshforge.run.train.trainer as t
original_step, original_ce = t.Trainer.train_step, fb.cross_entropy_sum
def step(self, n):
    t._current_step = self.state.step + 1
    return original_step(self, n)
def ce(logits, labels):
    out = original_ce(logits, labels)
    return out * float("nan") if getattr(t, "_current_step", 0) == 4 else out
t.Trainer.train_step, fb.cross_entropy_sum = step, ce
"""

# rank 0 (DCP's coordinator) dies while the async save of step 10 is being written: its shards
# are on disk, its .metadata is not
KILL_DURING_ASYNC_SAVE_OF_STEP10 = """
import os, signal
from torch.distributed.checkpoint import filesystem as fs
original = fs.FileSystemWriter.finish
def finish(self, metadata, results):
    if "step-00000010" in str(self.path):
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, metadata, results)
fs.FileSystemWriter.finish = finish
"""


def _args(out: Path, name: str, *extra: str) -> list[str]:
    return [
        str(RECIPES / "debug_cpu.toml"),
        *ONE_RANK,
        *QUICK,
        "train.steps=10",
        f"output_dir={out}",
        f"run_name={name}",
        *extra,
    ]


def _hook_env(tmp_path: Path, code: str) -> dict:
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(code)
    return cli_env(PYTHONPATH=str(hook))


def _losses(run_dir: Path) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(run_dir)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted FSDP-4 run with checkpoints at steps 5 and 10."""
    out = tmp_path_factory.mktemp("ckpt")
    proc = run_recipe(_args(out, "ref", "mesh.dp_shard=4", *CKPT), cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "ref"


@pytest.mark.slow
def test_kill_9_of_a_rank_then_resume_gives_the_same_curve(reference, tmp_path):
    """kill -9 of rank 1 mid-run ends the job promptly; rerunning with resume continues
    from the last complete checkpoint, bit-identical on the same mesh, each step logged once."""
    args = _args(tmp_path, "killed", "mesh.dp_shard=4", *CKPT)
    start = time.monotonic()
    proc = run_cli(args, cwd=tmp_path, env=_hook_env(tmp_path, KILL_RANK1_AT_STEP7))
    assert proc.returncode == 1 and "rank 1 failed" in proc.stderr and "SIGKILL" in proc.stderr
    # ended by the kill, not by the other ranks' collectives timing out (300 s): a bound, not a
    # speed target (as test_launch's: a loaded 2-core machine takes 80 s to start and stop 4 ranks)
    assert time.monotonic() - start < 200
    run_dir = tmp_path / "killed"
    assert [p.name for p in committed(run_dir / "checkpoints")] == ["step-00000005"]
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    proc = run_cli([*args, "checkpoint.load=latest"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 11))  # each step exactly once
    assert _losses(run_dir) == _losses(reference)  # bit-identical
    info = json.loads((run_dir / "run.json").read_text())
    assert info["run_id"] == run_id and info["resumed_from"].endswith("step-00000005")  # same W&B run


@pytest.mark.slow
def test_async_checkpoint_commits_as_soon_as_written_survives_a_kill_mid_write_and_resumes_exactly(
    reference, tmp_path
):
    """checkpoint.async_save: step 5's save is committed while training goes on (not at the
    next save), a kill while step 10's is being written leaves step 5 loadable and step 10
    uncommitted, and the resumed run matches the synchronous reference bit for bit."""
    args = _args(tmp_path, "async", "mesh.dp_shard=4", *CKPT, "checkpoint.async_save=true")
    proc = run_cli(args, cwd=tmp_path, env=_hook_env(tmp_path, KILL_DURING_ASYNC_SAVE_OF_STEP10))
    assert proc.returncode == 1 and "SIGKILL" in proc.stderr, proc.stderr[-3000:]
    folder = tmp_path / "async" / "checkpoints"
    with pytest.warns(UserWarning, match="step-00000010.tmp .no meta.json"):
        assert [p.name for p in committed(folder)] == ["step-00000005"]
    assert (folder / "step-00000010.tmp").is_dir()  # written in part, never renamed
    proc = run_cli([*args, "checkpoint.load=latest"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "async")
    assert [r["step"] for r in rows if "checkpoint_seconds" in r] == [5, 10]
    assert _losses(tmp_path / "async") == _losses(reference)  # the async snapshot is the sync one
    assert [p.name for p in committed(folder)] == ["step-00000005", "step-00000010"]
    summary = json.loads((tmp_path / "async" / "run.json").read_text())["summary"]
    assert summary["throughput_steps"]["excluded"]["checkpoint"] == [10]  # the resumed process's save


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh",
    [
        ["mesh.dp_shard=2", "mesh.tp=2"],
        ["mesh.dp_shard=2", "mesh.pp=2"],
        [],
        ["mesh.dp_shard=2", "mesh.cp=2"],
    ],
    ids=["dp2xtp2", "pp2xdp2", "1proc", "dp2xcp2"],
)
def test_resume_on_another_mesh(reference, tmp_path, mesh):
    step5 = reference / "checkpoints" / "step-00000005"
    proc = run_recipe(_args(tmp_path, "moved", *mesh, f"checkpoint.load={step5}"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, ref = _losses(tmp_path / "moved"), _losses(reference)
    assert sorted(got) == list(range(6, 11))
    for s in got:
        assert abs(got[s][0] - ref[s][0]) <= 1e-5 and abs(got[s][1] - ref[s][1]) <= 1e-5, (s, got[s], ref[s])


def test_incomplete_checkpoints_are_ignored(tmp_path):
    for name in ("step-00000005", "step-00000010.tmp", "step-00000015"):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").write_text("x")
    (tmp_path / "step-00000005" / "meta.json").write_text('{"step": 5}')
    with pytest.warns(UserWarning, match="incomplete checkpoint"):
        assert resolve_load("latest", tmp_path) == tmp_path / "step-00000005"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert resolve_load("auto", tmp_path) == tmp_path / "step-00000005"
        assert resolve_load("auto", tmp_path / "nothing-here") is None  # a requeued job's fresh start
        with pytest.raises(CheckpointNotFound, match="checkpoint.load=auto"):
            resolve_load("latest", tmp_path / "nothing-here")  # asked to resume: there must be one
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            resolve_load(str(tmp_path / "nothing-here"), tmp_path)


@pytest.mark.slow
def test_nan_stops_the_run_and_keeps_the_checkpoint_before_it(tmp_path):
    args = _args(tmp_path, "nan", "mesh.dp_shard=2", "checkpoint.enabled=true", "checkpoint.interval=2")
    env = _hook_env(tmp_path, NAN_AT_STEP4)
    proc = run_cli(args, cwd=tmp_path, env=env)
    assert proc.returncode == 1 and "at step 4" in proc.stderr and "train.max_bad_steps" in proc.stderr
    run_dir = tmp_path / "nan"
    assert [p.name for p in committed(run_dir / "checkpoints")] == ["step-00000002"]
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "failed"
    # allowed to skip one bad step, the same run finishes, without applying the NaN update
    proc = run_cli(
        [*_args(tmp_path, "nan_skip", "mesh.dp_shard=2", "train.max_bad_steps=1")], cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = read_metrics(tmp_path / "nan_skip")
    assert rows[3]["loss"] != rows[3]["loss"] and all(
        r["loss"] == r["loss"] for r in rows[4:]
    )  # NaN only at 4


def test_sigterm_saves_a_checkpoint_and_exits_nonzero(tmp_path):
    args = _args(
        tmp_path,
        "term",
        "train.steps=100000",
        "checkpoint.enabled=true",
        "checkpoint.interval=100000",
        "checkpoint.save_at_end=false",
    )
    exe = Path(sys.executable).parent / "run_recipe"
    proc = subprocess.Popen(
        [str(exe), *args],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "term" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while (not metrics.exists() or metrics.read_text().count("\n") < 3) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "stopped by SIGTERM after step" in err and "Traceback" not in err
    saved = committed(tmp_path / "term" / "checkpoints")
    assert len(saved) == 1
    step = json.loads((saved[0] / "meta.json").read_text())["step"]
    assert step == read_metrics(tmp_path / "term")[-1]["step"]  # saved the last completed step
    assert json.loads((tmp_path / "term" / "run.json").read_text())["status"] == "preempted"


# sitecustomize: rank 0 kills itself (SIGKILL: nothing flushed or closed) before the step given
KILL_RANK0_BEFORE_STEP = """
import os, signal
import meshforge.run.train.trainer as t
original = t.Trainer.train_step
def step(self, n):
    if os.environ.get("RANK") == "0" and n == int(os.environ["MESHFORGE_TEST_KILL_AT"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, n)
t.Trainer.train_step = step
"""


def _steps_in_every_record(run_dir: Path) -> dict[str, list[int]]:
    """The steps each record holds, as a user's tools read them: metrics.jsonl, TensorBoard's
    event files (EventAccumulator, which applies purges) and W&B's offline run files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from meshforge.run.observe import wandb_files as wf

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {
        "jsonl": [r["step"] for r in read_metrics(run_dir)],
        "tensorboard": sorted(e.step for e in acc.Scalars("loss")),
        "wandb": sorted(h["step"] for h in wf.history(wf.run_files(run_dir)) if "loss" in h),
    }


@pytest.mark.slow
def test_a_requeued_run_killed_twice_ends_with_every_step_once_in_every_record(tmp_path):
    """The Slurm requeue recipe: the same command (checkpoint.load=auto) after rank 0 is killed
    hard at step 5 (after the step-3 checkpoint) and at step 8 (after step 6's, resumed from 3)."""
    loggers = ["logging.tensorboard=true", "logging.wandb=true", "logging.log_every=1"]
    ckpt = ["checkpoint.enabled=true", "checkpoint.interval=3", "checkpoint.load=auto"]
    args = _args(tmp_path, "requeued", "mesh.dp_shard=2", *loggers, *ckpt)
    run_dir = tmp_path / "requeued"
    hook = _hook_env(tmp_path, KILL_RANK0_BEFORE_STEP)
    for kill_at, resumed_from in ((5, None), (8, "step-00000003")):
        proc = run_cli(
            args, cwd=tmp_path, env={**hook, "WANDB_MODE": "offline", "MESHFORGE_TEST_KILL_AT": str(kill_at)}
        )
        assert proc.returncode == 1 and "SIGKILL" in proc.stderr, proc.stderr[-3000:]
        assert [r["step"] for r in read_metrics(run_dir)][-1] == kill_at - 1
        info = json.loads((run_dir / "run.json").read_text())
        assert (info["resumed_from"] or "").endswith(resumed_from or "") and info["status"] == "failed"
    run_id = info["run_id"]
    proc = run_cli(args, cwd=tmp_path, env=cli_env(WANDB_MODE="offline"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads((run_dir / "run.json").read_text())
    assert info["resumed_from"].endswith("step-00000006") and info["run_id"] == run_id
    assert _steps_in_every_record(run_dir) == {
        k: list(range(1, 11)) for k in ("jsonl", "tensorboard", "wandb")
    }
    assert [p.name for p in committed(run_dir / "checkpoints")][-1] == "step-00000010"

    # each resume set aside the step logged after its checkpoint (4, then 7), records and all
    aside = sorted(tmp_path.glob("requeued.*"))
    assert sorted(read_metrics(folder)[-1]["step"] for folder in aside) == [4, 7]

    # a plain rerun (no checkpoint.load) of this folder is refused, naming the fix, and keeps it all
    plain = [a for a in args if a != "checkpoint.load=auto"]
    proc = run_cli(plain, cwd=tmp_path)
    assert proc.returncode == 2 and "checkpoint.load=auto" in proc.stderr, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 11))
    assert sorted(tmp_path.glob("requeued.*")) == aside  # nothing more set aside


@pytest.mark.slow
def test_auto_before_any_checkpoint_starts_afresh_and_keeps_each_step_once(tmp_path):
    """A requeued job whose first attempt died before any checkpoint: the same command starts
    from step 0 again, its records cut back to nothing (not [1, 2, 3, 1, 2, 3]), same run id."""
    ckpt = ["checkpoint.enabled=true", "checkpoint.interval=100", "checkpoint.save_at_end=false"]
    args = _args(
        tmp_path, "early", "train.steps=3", "logging.tensorboard=true", *ckpt, "checkpoint.load=auto"
    )
    run_dir = tmp_path / "early"
    runs = []
    for _ in range(2):
        proc = run_cli(args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads((run_dir / "run.json").read_text()))
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
    assert runs[1]["run_id"] == runs[0]["run_id"] and runs[1]["resumed_from"] is None
    assert _steps_in_every_record(run_dir)["tensorboard"] == [1, 2, 3]
    proc = run_cli([*args[:-1], "checkpoint.load=latest"], cwd=tmp_path)  # resuming needs a checkpoint
    assert proc.returncode == 2 and "checkpoint.load=auto" in proc.stderr, proc.stderr[-3000:]


def test_unwritable_checkpoint_folder_fails_before_training(tmp_path):
    proc = run_cli(
        _args(tmp_path, "ro", "checkpoint.enabled=true", "checkpoint.folder=/proc/meshforge-ckpt"),
        cwd=tmp_path,
    )
    assert proc.returncode == 1 and "not writable" in proc.stderr and "checkpoint.folder" in proc.stderr
    assert not (tmp_path / "ro" / "metrics.jsonl").exists()


def test_seed_checkpoint_and_safetensors_export(tmp_path):
    """`meshforge init` writes the recipe's initial weights; a run started from it on any mesh
    equals one that initialised itself; `meshforge export` gives the trained weights unsharded."""
    from safetensors.torch import load_file

    from meshforge.recipe import load_recipe
    from meshforge.run.train.trainer import Trainer

    proc = run_cli(
        ["init", str(RECIPES / "debug_cpu.toml"), "--out", str(tmp_path / "seed")],
        cwd=tmp_path,
        program="meshforge",
    )
    assert proc.returncode == 0, proc.stderr
    common = [*ONE_RANK, *QUICK, "train.steps=3", f"output_dir={tmp_path}", *CKPT]
    seeded = Trainer(
        load_recipe(
            RECIPES / "debug_cpu.toml",
            [*common, "run_name=s", "seed=99", f"checkpoint.init_from={tmp_path / 'seed'}"],
        )
    )
    plain = Trainer(load_recipe(RECIPES / "debug_cpu.toml", [*common, "run_name=p"]))
    for (n, a), b in zip(seeded.pmodel.parts[0].named_parameters(), plain.pmodel.parts[0].parameters()):
        assert torch.equal(a, b), n  # seed 99 was overridden by the seed checkpoint (made with seed 0)
    plain.run()
    proc = run_cli(
        ["export", str(tmp_path / "p" / "checkpoints"), str(tmp_path / "export")],
        cwd=tmp_path,
        program="meshforge",
    )
    assert proc.returncode == 0, proc.stderr
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    trained = plain.pmodel.parts[0].state_dict()
    assert set(exported) == set(trained)
    assert all(torch.equal(exported[k], trained[k]) for k in trained)


class _Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned > pwned.txt",))


def test_checkpoint_metadata_cannot_run_code(tmp_path, monkeypatch):
    """DCP pickles its metadata; meshforge unpickles it through an allow-list."""
    import pickle

    from meshforge.run.checkpoint.dcp import dcp_load

    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "step-00000001"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(RuntimeError, match=r"(os|posix)\.system, which no checkpoint needs"):
        dcp_load({"x": torch.zeros(2)}, ckpt)
    assert not (tmp_path / "pwned.txt").exists()


@pytest.mark.slow
def test_a_tied_model_saved_on_pp2_stores_one_weight_and_resumes_on_tp2_and_one_process(tmp_path):
    """Tied embeddings on a pipeline are two copies (first and last stage) kept equal; the
    checkpoint stores the weight and its AdamW state once, under the embedding's name, and a
    resume on tp 2 (one DTensor for both uses) or one process (one tensor) continues the curve."""
    from torch.distributed.checkpoint import FileSystemReader

    tied = ["model.tie_embeddings=true", *CKPT]
    proc = run_recipe(_args(tmp_path, "pp2", "mesh.pp=2", *tied), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    step5 = tmp_path / "pp2" / "checkpoints" / "step-00000005"
    keys = set(FileSystemReader(str(step5)).read_metadata().state_dict_metadata)
    assert "model.tok_embeddings.weight" in keys and "optim.state.tok_embeddings.weight.exp_avg" in keys
    assert not [k for k in keys if "output.weight" in k]  # one copy, one optimizer state
    ref = _losses(tmp_path / "pp2")
    for name, mesh in (("tp2", ["mesh.tp=2"]), ("one", [])):
        proc = run_recipe(_args(tmp_path, name, *mesh, *tied, f"checkpoint.load={step5}"), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = _losses(tmp_path / name)
        assert sorted(got) == list(range(6, 11))
        for s in got:
            assert abs(got[s][0] - ref[s][0]) <= 1e-5 and abs(got[s][1] - ref[s][1]) <= 1e-5, (name, s)


@pytest.mark.slow
def test_a_cp2_checkpoint_resumes_on_one_process_and_on_tp2(tmp_path):
    """Context parallel changes no parameter's shape (FSDP shards over dp_shard x cp): a cp 2
    checkpoint continues the same losses on one process and on tp 2, with the data position."""
    proc = run_recipe(_args(tmp_path, "cp2", "mesh.cp=2", *CKPT), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    step5 = tmp_path / "cp2" / "checkpoints" / "step-00000005"
    assert json.loads((step5 / "meta.json").read_text())["mesh"]["cp"] == 2
    ref = _losses(tmp_path / "cp2")
    for name, mesh in (("one", []), ("tp2", ["mesh.tp=2"])):
        proc = run_recipe(_args(tmp_path, name, *mesh, f"checkpoint.load={step5}"), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = _losses(tmp_path / name)
        assert sorted(got) == list(range(6, 11))
        for s in got:
            assert abs(got[s][0] - ref[s][0]) <= 1e-5 and abs(got[s][1] - ref[s][1]) <= 1e-5, (name, s)


@pytest.mark.slow
def test_a_resumed_run_trains_with_the_recipe_s_optimizer_settings_and_says_which_changed(tmp_path):
    """torch's optimizer and scheduler state carry the saved lr, betas, eps and weight decay: a run
    resumed with a new optimizer.lr used to go on at the old one, silently. It takes the recipe's,
    where the schedule stands, and the terminal names the change. The state also carried the saving
    run's implementation: one process's fused AdamW crashed on TP 2 without sequence parallel
    (DTensor and plain parameters in one group); the resumed run keeps its own."""
    common = ["checkpoint.enabled=true", "checkpoint.interval=5", "lr_scheduler.warmup_steps=100"]
    first = run_recipe(_args(tmp_path, "lr", *common, "train.steps=5", "optimizer.lr=1e-3"), tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    tp2 = ["mesh.tp=2", "tp.sequence_parallel=false"]
    again = _args(tmp_path, "lr", *common, *tp2, "train.steps=7", "optimizer.lr=1e-2", "checkpoint.load=auto")
    proc = run_recipe(again, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = "resumed with the recipe's optimizer settings (moments kept): optimizer.lr: 0.001 -> 0.01"
    logs = "".join(log.read_text() for log in (tmp_path / "lr").glob("logs/**/stderr.log"))
    fallback = "optimizer.implementation = fused: DTensor and plain parameters mixed"
    assert said in logs and logs.count(fallback) == 2  # the fallback from each rank
    for warning in (said, fallback):  # the launcher shows each once, with no progress display
        assert proc.stderr.count(f"WARNING meshforge: {warning}") == 1, proc.stderr[-2000:]
    lr = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "lr")}
    assert lr[5] == pytest.approx(1e-3 * 5 / 100) and lr[6] == pytest.approx(1e-2 * 6 / 100)
    assert lr[7] == pytest.approx(1e-2 * 7 / 100)
