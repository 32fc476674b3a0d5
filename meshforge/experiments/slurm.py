"""Sweep points as Slurm jobs: one sbatch script per point, and the scheduler's view of each job.

A point's script asks for whole nodes; `srun` starts one torchrun agent per node and the
agents rendezvous over c10d at the job's first node (as TorchTitan's multinode script does),
so torchrun stays the distributed engine. The sweep (sweep.py) submits up to
`sweep.slurm.max_concurrent` points and polls: `squeue` while a job is queued or running,
`sacct` once it has left the queue. A scheduler command that is missing or fails raises
SchedulerError naming the command and its stderr.
"""

from __future__ import annotations

import math
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from meshforge.configs.schema import SlurmConfig, SweepConfig
from meshforge.core.errors import Interrupted, Problem, RecipeError, SchedulerError
from meshforge.experiments.sweep_record import append_row, log_verdict, measure, run_finished

# the states a job leaves the queue in; anything else is still queued or running
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "TIMEOUT",
    "CANCELLED",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "LOST",  # ours: neither squeue nor sacct knows the job any more
}
# a final state -> the sweep's status (a COMPLETED job is judged by its run's own record)
SWEEP_STATUS = {"TIMEOUT": "hung", "DEADLINE": "hung", "OUT_OF_MEMORY": "oom", "CANCELLED": "cancelled"}
RDZV_PORT = 29500  # + the job id modulo 10000: jobs sharing a node do not collide


@dataclass
class JobState:
    """One job as the scheduler reports it."""

    job_id: str
    state: str  # Slurm's, e.g. PENDING, RUNNING, "CANCELLED by 1000", NODE_FAIL
    nodelist: str = ""
    exit_code: str = ""  # sacct's "rc:signal"
    reason: str = ""  # squeue's reason while queued

    @property
    def final(self) -> bool:
        return self.state.split()[0] in FINAL_STATES


def nodes_for(world: int, cfg: SlurmConfig) -> tuple[int, int]:
    """(nodes, ranks per node) for a point of `world` ranks: whole nodes of `gpus_per_node`."""
    per_node = cfg.gpus_per_node
    if world <= per_node:
        return 1, world
    if world % per_node:
        raise RecipeError(
            [
                Problem(
                    "sweep.slurm.gpus_per_node",
                    per_node,
                    f"must divide the world size {world} (whole nodes per point); "
                    f"e.g. {max(d for d in range(1, per_node + 1) if world % d == 0)}",
                )
            ],
            "sweep",
        )
    return world // per_node, per_node


def slurm_time(seconds: float) -> str:
    """Seconds as Slurm's [D-]HH:MM:SS, rounded up to the minute."""
    minutes = math.ceil(seconds / 60)
    days, minutes = divmod(minutes, 24 * 60)
    hhmm = f"{minutes // 60:02d}:{minutes % 60:02d}:00"
    return f"{days}-{hhmm}" if days else hhmm


def job_script(
    name: str,
    command: list[str],
    world: int,
    log: Path,
    cfg: SlurmConfig,
    time_limit: str,
    gpus: bool,
) -> str:
    """The sbatch script of one point: `command` (`python -m meshforge.cli RECIPE ...`) run
    by one torchrun agent per node."""
    nodes, per_node = nodes_for(world, cfg)
    directives = [
        f"--job-name={name}",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        f"--time={time_limit}",
        f"--output={log}",
    ]
    if gpus:
        directives.append(f"--gpus-per-node={per_node}")
    directives += [f"--partition={cfg.partition}"] * bool(cfg.partition)
    directives += [f"--account={cfg.account}"] * bool(cfg.account)
    directives += list(cfg.sbatch_args)
    python, module_args = command[0], command[1:]
    torchrun = [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        '"$SLURM_NNODES"',
        "--nproc_per_node",
        str(per_node),
        "--rdzv_id",
        '"$SLURM_JOB_ID"',
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        '"$HEAD:$PORT"',
    ]
    body = [
        "#!/bin/bash",
        *(f"#SBATCH {d}" for d in directives),
        "set -euo pipefail",
        *cfg.setup,
        # all of scontrol's output read (not `| head -n 1`: under pipefail, scontrol's SIGPIPE failed the job)
        'NODES=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        'HEAD="${NODES[0]}"',
        f"PORT=$(({RDZV_PORT} + SLURM_JOB_ID % 10000))",
        "srun --kill-on-bad-exit=1 "
        + " ".join(a if a.startswith('"$') else shlex.quote(a) for a in torchrun)
        + " \\\n    "
        + " ".join(shlex.quote(a) for a in module_args),
    ]
    return "\n".join(body) + "\n"


def check_commands() -> None:
    """Before any planning: the commands a sweep runs on this (login) node must exist."""
    missing = [c for c in ("sbatch", "squeue", "sacct") if shutil.which(c) is None]
    if missing:
        raise SchedulerError(
            f"{', '.join(f'`{c}`' for c in missing)} not found on PATH: sweep.launcher=slurm submits "
            "from a Slurm login node (or set sweep.launcher=local)"
        )


def _scheduler(cmd: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise SchedulerError(
            f"`{cmd[0]}` not found on PATH: sweep.launcher=slurm runs on a Slurm login node "
            "(or set sweep.launcher=local)"
        ) from None
    except subprocess.TimeoutExpired:
        raise SchedulerError(f"`{shlex.join(cmd)}` did not answer within 120 s") from None


def _checked(cmd: list[str]) -> str:
    proc = _scheduler(cmd)
    if proc.returncode != 0:
        said = proc.stderr.strip() or proc.stdout.strip()
        raise SchedulerError(f"`{shlex.join(cmd)}` failed (exit {proc.returncode}): {said}")
    return proc.stdout


def submit(script: Path) -> str:
    """sbatch the script; its job id."""
    out = _checked(["sbatch", "--parsable", str(script)]).strip()
    job_id = out.split(";")[0]  # --parsable prints "id" or "id;cluster"
    if not job_id.isdigit():
        raise SchedulerError(f"`sbatch --parsable {script}` printed {out!r}, not a job id")
    return job_id


def query(job_ids: list[str]) -> dict[str, JobState]:
    """The state of each job: squeue's while it is in the queue, else sacct's."""
    if not job_ids:
        return {}
    ids = ",".join(job_ids)
    proc = _scheduler(["squeue", "-h", "-j", ids, "-o", "%i|%T|%N|%r"])
    if proc.returncode != 0 and "Invalid job id" not in proc.stderr:  # every id already gone
        raise SchedulerError(f"`squeue -j {ids}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    states = {}
    for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
        job_id, state, nodes, reason = (line.split("|") + ["", "", ""])[:4]
        if job_id in job_ids:
            states[job_id] = JobState(job_id, state, nodes, reason=reason)
    gone = [j for j in job_ids if j not in states or states[j].final]
    if gone:
        out = _checked(
            ["sacct", "-n", "-P", "-X", "-j", ",".join(gone), "-o", "JobID,State,ExitCode,NodeList"]
        )
        for line in out.splitlines():
            job_id, state, code, nodes = (line.split("|") + ["", "", ""])[:4]
            if job_id in gone:
                states[job_id] = JobState(job_id, state, nodes, code)
    return states


def sweep_status(state: JobState) -> str:
    """A final job's status in sweep.jsonl (COMPLETED -> finished, judged again by the run)."""
    first = state.state.split()[0]
    return "finished" if first == "COMPLETED" else SWEEP_STATUS.get(first, "failed")


MISSES_ALLOWED = 3  # polls a job may be missing from both squeue and sacct (accounting lags)


def run_on_slurm(
    todo: Iterable[tuple],
    active: dict[str, tuple[int, dict]],
    world: int,
    sw: SweepConfig,
    sweep_dir: Path,
    record: Path,
    console: Console,
    n: int,
    collect: str = "rerun the same command to collect them",
) -> None:
    """Submit `todo` ((i, point, row, recipe, command) each) as jobs, at most `max_concurrent` in the
    queue at once, and follow them and the `active` ones (job id -> (i, row)) to the end. `todo` is
    read one point at a time, as a slot frees: a sweep's points still being traced come as they
    are judged. Each state change is a row in `record`; Ctrl-C leaves the jobs to the scheduler
    (`collect`: how their results are read later)."""
    cfg = sw.slurm
    time_limit = cfg.time or slurm_time(sw.timeout_s)
    (sweep_dir / "jobs").mkdir(exist_ok=True)
    misses: dict[str, int] = {}
    pending = iter(todo)
    try:
        while True:
            while len(active) < cfg.max_concurrent and (upcoming := next(pending, None)):
                i, pt, row, recipe, command = upcoming
                log, script = sweep_dir / f"{pt.label}.log", sweep_dir / "jobs" / f"{pt.label}.sbatch"
                gpus = recipe.train.device in ("cuda", "auto")
                name = f"{sweep_dir.name}-{pt.label}"
                script.write_text(job_script(name, command, world, log, cfg, time_limit, gpus))
                row.update(status="queued", job_id=submit(script), script=str(script), log=str(log))
                row["submitted"] = time.time()
                append_row(record, row, console, i, n)
                active[row["job_id"]] = (i, row)
            if not active:  # and nothing left to submit
                break
            time.sleep(cfg.poll_s)
            states = query(list(active))
            for job_id, (i, row) in list(active.items()):
                state = states.get(job_id)
                if state is None:  # neither squeue nor sacct knows it (yet)
                    misses[job_id] = misses.get(job_id, 0) + 1
                    if misses[job_id] < MISSES_ALLOWED:
                        continue
                    state = JobState(
                        job_id, "COMPLETED" if run_finished(sweep_dir / row["label"]) else "LOST"
                    )
                if not state.final:
                    if state.state == "RUNNING" and row["status"] != "running":
                        row.update(status="running", nodelist=state.nodelist, started=time.time())
                        append_row(record, row, console, i, n)
                    continue
                _finish(row, state, sweep_dir)
                append_row(record, row, console, i, n)
                del active[job_id]
    except KeyboardInterrupt:
        ids = ",".join(active)
        raise Interrupted(
            f"stopped; {len(active)} job(s) left to the scheduler ({ids}): {collect}"
            + (f", or `scancel {ids.replace(',', ' ')}` to stop them" if ids else "")
        ) from None


def _finish(row: dict, state: JobState, sweep_dir: Path) -> None:
    """A job that left the queue: its sweep status, with the scheduler's reason and the log's."""
    status = sweep_status(state)
    run_dir, log = sweep_dir / row["label"], Path(row["log"])
    row.update(
        slurm_state=state.state, exit_code=state.exit_code, nodelist=state.nodelist or row.get("nodelist", "")
    )
    if "started" in row:
        row["wall_s"] = round(time.time() - row["started"], 1)
    if status == "finished" and run_finished(run_dir):
        row.update(status="finished", error="", **measure(run_dir))
        return
    reason = f"slurm job {row['job_id']} {state.state} (exit {state.exit_code or '?'})"
    if state.state.split()[0] in ("COMPLETED", "FAILED"):  # the job itself ended: its log says why
        reason += f": {log_verdict(log)}"
    row.update(status="failed" if status == "finished" else status, error=f"{reason}; log: {log}")
