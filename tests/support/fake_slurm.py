"""A Slurm stand-in for tests: `sbatch`, `squeue`, `sacct`, `scancel`, `srun`, `scontrol`
(installed by `install(bin_dir)` as small executables calling this file).

Jobs run on this machine: sbatch starts the script in the background (a runner process per
job), with the variables Slurm sets; srun starts its command once per node of the job, each
with its own SLURM_NODEID; every node is `localhost`. States live in `$FAKE_SLURM_DIR`:
PENDING for a moment, RUNNING, then COMPLETED / FAILED / TIMEOUT / CANCELLED. A finished job
leaves squeue at once (MinJobAge 0) and stays in sacct.

Told by the environment of the sbatch call:
  FAKE_SLURM_FAIL=<substring of a job name>    the job's node dies a moment after it starts (NODE_FAIL)
  FAKE_SLURM_CANCEL=<substring>                the job is cancelled a moment after it starts
  FAKE_SLURM_HOLD=1                            jobs stay PENDING (Resources) until cancelled
  FAKE_SLURM_SBATCH_ERROR=<message>            sbatch refuses the job with this message (exit 1)
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = ("sbatch", "squeue", "sacct", "scancel", "srun", "scontrol")
FINAL = ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL")


def install(bin_dir: Path) -> None:
    """Executables named like Slurm's, each calling this file with the command's name."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in COMMANDS:
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" {name} "$@"\n')
        path.chmod(0o755)


def _state_dir() -> Path:
    return Path(os.environ["FAKE_SLURM_DIR"])


def _job_path(job_id: str) -> Path:
    return _state_dir() / "jobs" / f"{job_id}.json"


def _load(job_id: str) -> dict | None:
    path = _job_path(job_id)
    return json.loads(path.read_text()) if path.is_file() else None


def _save(job: dict) -> None:
    path = _job_path(job["id"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(job))
    tmp.replace(path)


def _update(job_id: str, **changes) -> dict:
    """Change a job's record unless it already ended (a cancel wins over the runner's verdict)."""
    with open(_state_dir() / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        job = _load(job_id)
        if job["state"].split()[0] not in FINAL:
            job.update(changes)
            _save(job)
        return job


def _seconds(limit: str) -> float:
    days, _, hms = limit.rpartition("-")
    parts = [int(p) for p in hms.split(":")]
    h, m, s = ([0] * (3 - len(parts)) + parts)[-3:]
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def sbatch(args: list[str]) -> int:
    if os.environ.get("FAKE_SLURM_SBATCH_ERROR"):
        print(os.environ["FAKE_SLURM_SBATCH_ERROR"], file=sys.stderr)
        return 1
    script = Path(args[-1])
    options = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script.read_text(), re.M))
    root = _state_dir()
    (root / "jobs").mkdir(parents=True, exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        counter = root / "next_id"
        job_id = str(int(counter.read_text()) if counter.is_file() else 1001)
        counter.write_text(str(int(job_id) + 1))
    name = options.get("job-name", script.name)
    job = {
        "id": job_id,
        "name": name,
        "state": "PENDING",
        "reason": "Priority",
        "nodes": int(options.get("nodes", 1)),
        "nodelist": "",
        "exit_code": "",
        "output": options.get("output", f"slurm-{job_id}.out"),
        "time_limit_s": _seconds(options.get("time", "01:00:00")),
        "script": str(script),
        "options": options,
        "fail": bool(os.environ.get("FAKE_SLURM_FAIL")) and os.environ["FAKE_SLURM_FAIL"] in name,
        "cancel": bool(os.environ.get("FAKE_SLURM_CANCEL")) and os.environ["FAKE_SLURM_CANCEL"] in name,
        "hold": os.environ.get("FAKE_SLURM_HOLD") == "1",
    }
    _save(job)
    with open(root / "submissions.log", "a") as f:
        f.write(f"{job_id} {name}\n")
    subprocess.Popen(
        [sys.executable, __file__, "_run", job_id],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    print(job_id if "--parsable" in args else f"Submitted batch job {job_id}")
    return 0


def _run(job_id: str) -> int:
    """The job's life: queued a moment, then its script on `nodes` localhost nodes."""
    job = _load(job_id)
    if job["hold"]:
        _update(job_id, reason="Resources")
        return 0  # stays PENDING until scancel
    time.sleep(0.5)
    nodelist = ",".join(["localhost"] * job["nodes"])
    env = {
        **os.environ,
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NAME": job["name"],
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NNODES": str(job["nodes"]),
        "SLURM_SUBMIT_DIR": os.getcwd(),
    }
    with open(job["output"], "w") as out:
        proc = subprocess.Popen(
            ["bash", job["script"]], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    job = _update(job_id, state="RUNNING", reason="None", nodelist=nodelist, pgid=proc.pid)
    if job["fail"] or job["cancel"]:
        time.sleep(1.0)
        _kill(proc.pid)
        verdict = ("NODE_FAIL", "0:9") if job["fail"] else (f"CANCELLED by {os.getuid()}", "0:15")
        _update(job_id, state=verdict[0], exit_code=verdict[1])
        return 0
    try:
        rc = proc.wait(timeout=job["time_limit_s"])
    except subprocess.TimeoutExpired:
        _kill(proc.pid)
        _update(job_id, state="TIMEOUT", exit_code="0:15")
        return 0
    _update(job_id, state="COMPLETED" if rc == 0 else "FAILED", exit_code=f"{rc}:0")
    return 0


def _kill(pgid: int) -> None:
    """The job's script and everything in its process group: SIGTERM, then (as Slurm's
    KillWait) SIGKILL for whatever is left after a grace period."""
    try:
        os.killpg(pgid, signal.SIGTERM)
        for _ in range(100):
            time.sleep(0.1)
            os.killpg(pgid, 0)  # raises once the group is empty
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _ids(args: list[str]) -> list[str]:
    return args[args.index("-j") + 1].split(",")


def _fields(job: dict, names: list[str]) -> list[str]:
    values = {
        "JobID": job["id"],
        "State": job["state"],
        "ExitCode": job["exit_code"],
        "NodeList": job["nodelist"] or "None assigned",
    }
    return [values[n] for n in names]


def squeue(args: list[str]) -> int:
    with open(_state_dir() / "squeue.log", "a") as f:  # tests wait on polls, not on the clock
        f.write(" ".join(args) + "\n")
    jobs = [j for j in map(_load, _ids(args)) if j and j["state"].split()[0] not in FINAL]
    if not jobs:
        print("slurm_load_jobs error: Invalid job id specified", file=sys.stderr)
        return 1
    fmt = args[args.index("-o") + 1]
    for j in jobs:
        codes = {"%i": j["id"], "%T": j["state"], "%N": j["nodelist"], "%r": j["reason"], "%j": j["name"]}
        print(re.sub(r"%[a-zA-Z]", lambda m: codes.get(m.group(0), ""), fmt))
    return 0


def sacct(args: list[str]) -> int:
    names = args[args.index("-o") + 1].split(",")
    for j in filter(None, map(_load, _ids(args))):
        print("|".join(_fields(j, names)))
    return 0


def scancel(args: list[str]) -> int:
    for job_id in args:
        job = _load(job_id)
        if job is None:
            print(
                f"scancel: error: Kill job error on job id {job_id}: Invalid job id specified",
                file=sys.stderr,
            )
            return 1
        if job.get("pgid"):
            _kill(job["pgid"])
        _update(job_id, state=f"CANCELLED by {os.getuid()}", exit_code="0:15")
    return 0


def srun(args: list[str]) -> int:
    """One copy of the command per node of the job, as `srun --ntasks-per-node=1` starts
    them; with --kill-on-bad-exit, the first copy to fail stops the others."""
    command = [a for a in args if not a.startswith("--kill-on-bad-exit")]
    kill_on_bad_exit = len(command) < len(args)
    nodes = int(os.environ["SLURM_NNODES"])
    procs = [
        subprocess.Popen(command, env={**os.environ, "SLURM_NODEID": str(n), "SLURM_PROCID": str(n)})
        for n in range(nodes)
    ]
    while any(p.poll() is None for p in procs):
        if kill_on_bad_exit and any(p.returncode for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.terminate()
        time.sleep(0.2)
    return next((p.returncode for p in procs if p.returncode), 0)


def scontrol(args: list[str]) -> int:
    if args[:2] != ["show", "hostnames"]:
        print(f"fake scontrol: only `show hostnames`, not {args}", file=sys.stderr)
        return 1
    print("\n".join(args[2].split(",")))
    return 0


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "_run":
        sys.exit(_run(rest[0]))
    sys.exit(globals()[command](rest))
