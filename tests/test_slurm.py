"""export-sbatch on a real SLURM: a one-node cluster on loopback runs the exported training job.

Needs Debian's slurm-wlm (scripts/test.sh installs it where it can: root and apt). The cluster
has no GPUs, so the job is exported with --cpu: torchrun starts the same `-m sae_dist train`
ranks with gloo. The cluster is slurmctld and slurmd on 127.0.0.1 (munge where Debian's munge
is installed, as the test command does; auth/none otherwise, sandbox only). Also `submit --cluster
slurm` against that cluster, with the metrics in a throwaway PostgreSQL.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from conftest import run_cli
from scheduler.cluster import slurm_command  # SLURM's sbatch: the venv's first on PATH is ours

pytestmark = [pytest.mark.skipif(shutil.which("slurmctld") is None or os.geteuid() != 0,
                                 reason="needs Debian's slurm-wlm and root (scripts/test.sh installs it)"),
              pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """One cluster for the module's tests (each of its jobs writes under its own test's tmp_path)."""
    d = tmp_path_factory.mktemp("cluster") / "slurm"
    for sub in ("state", "spool", "log"):
        (d / sub).mkdir(parents=True)
    d.chmod(0o755)
    indent = "\n" + " " * 8  # the lines go into the indented (dedented) slurm.conf below
    auth = indent.join(["AuthType=auth/none", "CredType=cred/none"])
    munged_pid = None
    if shutil.which("munged") and shutil.which("mungekey"):  # as a real cluster authenticates
        # munged wants every directory above its socket traversable by all: pytest's tmp_path is
        # under a 0700 directory, so munge gets a directory of its own in /tmp.
        munge = Path(tempfile.mkdtemp(prefix="sae-dist-munge-"))
        munge.chmod(0o755)
        subprocess.run(["mungekey", "-c", "-k", str(munge / "munge.key")], check=True, capture_output=True)
        subprocess.run(["munged", f"--socket={munge}/munge.sock", f"--key-file={munge}/munge.key",
                        f"--pid-file={munge}/munged.pid", f"--log-file={d}/log/munged.log",
                        f"--seed-file={munge}/munged.seed"], check=True, capture_output=True)
        munged_pid = int((munge / "munged.pid").read_text().split()[0])
        auth = indent.join(["AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={munge}/munge.sock"])
    memory = subprocess.run(["slurmd", "-C"], capture_output=True, text=True).stdout
    real_memory = next((f.split("=")[1] for f in memory.split() if f.startswith("RealMemory=")), "1000")
    cpus = os.cpu_count() or 1
    conf = d / "slurm.conf"
    conf.write_text(textwrap.dedent(f"""
        ClusterName=saedisttest
        SlurmctldHost=localhost
        SlurmUser=root
        SlurmdUser=root
        SlurmctldPort={_free_port()}
        SlurmdPort={_free_port()}
        {auth}
        StateSaveLocation={d}/state
        SlurmdSpoolDir={d}/spool
        SlurmctldPidFile={d}/slurmctld.pid
        SlurmdPidFile={d}/slurmd.pid
        SlurmctldLogFile={d}/log/slurmctld.log
        SlurmdLogFile={d}/log/slurmd.log
        ProctrackType=proctrack/linuxproc
        TaskPlugin=task/none
        SelectType=select/cons_tres
        SelectTypeParameters=CR_Core
        SchedulerType=sched/backfill
        MpiDefault=none
        ReturnToService=2
        JobAcctGatherType=jobacct_gather/none
        AccountingStorageType=accounting_storage/none
        JobCompType=jobcomp/filetxt
        JobCompLoc={d}/log/jobcomp.txt
        MailProg=/bin/true
        NodeName=localhost CPUs={cpus} RealMemory={real_memory} State=UNKNOWN
        PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
    """))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = [subprocess.Popen(["slurmctld", "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)]
    daemons.append(subprocess.Popen(["slurmd", "-D", "-N", "localhost", "-f", str(conf)], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-n", "localhost", "-o", "%T"], env=env,
                                 capture_output=True, text=True).stdout.strip()
            if out == "idle":
                break
            time.sleep(0.25)
        else:
            pytest.fail(f"SLURM did not come up: {(d / 'log' / 'slurmctld.log').read_text()[-2000:]}")
        yield env
    finally:
        for p in reversed(daemons):
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        if munged_pid is not None:
            os.kill(munged_pid, signal.SIGTERM)
            shutil.rmtree(munge, ignore_errors=True)


def small_training(tmp_path: Path, extra: str = "") -> Path:
    """tmp_path/run.toml: 20 steps of a small SAE on 2 ranks' worth of batch; its run directory."""
    run_dir = tmp_path / "run"
    (tmp_path / "run.toml").write_text(textwrap.dedent(f"""
        d_in = 32
        d_sae = 128
        k = 8
        batch_size = 64
        steps = 20
        log_every = 10
        checkpoint_every = 0
        out_dir = "{run_dir}"
    """) + extra + "\n")
    return run_dir


def test_exported_training_job_runs_under_slurm(slurm, tmp_path, monkeypatch):
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "2")
    run_dir = small_training(tmp_path)
    sub = run_cli("submit", "--gpus", "2", "-t", "10", "--train", str(tmp_path / "run.toml"), "-J", "slurm-demo",
                  "-D", str(tmp_path), module="scheduler")
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.split()[-1]
    script = tmp_path / "job.sbatch"
    exp = run_cli("export-sbatch", job_id, "--cpu", "--gpus-per-node", "2", "-o", str(script), module="scheduler")
    assert exp.returncode == 0, exp.stderr
    text = script.read_text()
    assert "--gpus-per-node" not in text and "#SBATCH --time=00:10:00" in text
    env = {**slurm, "PATH": f"{Path(sys.executable).parent}:{slurm['PATH']}"}
    submitted = subprocess.run([slurm_command("sbatch", env["PATH"]), "--parsable", str(script)], cwd=tmp_path, env=env,
                               capture_output=True, text=True)
    assert submitted.returncode == 0, submitted.stderr
    slurm_id = submitted.stdout.strip().split(";")[0]
    deadline = time.time() + 180
    while time.time() < deadline:
        queue = subprocess.run(["squeue", "-h", "-j", slurm_id], env=env, capture_output=True, text=True).stdout
        if not queue.strip():
            break
        time.sleep(0.5)
    out = (tmp_path / f"slurm-demo-{slurm_id}.out").read_text()
    assert "done: step 20" in out, out[-3000:]
    assert "2 x cpu (gloo)" in out
    assert (run_dir / "sae" / "cfg.json").is_file()


def slurm_env(slurm: dict) -> dict:
    """The test's environment for our commands: SLURM_CONF, and the venv's torchrun on PATH (sbatch
    passes the submitting environment on to the job)."""
    return {"SLURM_CONF": slurm["SLURM_CONF"], "PATH": f"{Path(sys.executable).parent}:{slurm['PATH']}"}


def cluster_row(env: dict, job_id: str) -> dict | None:
    listed = run_cli("queue", "--all", "--json", module="scheduler", env=env)
    assert listed.returncode == 0, listed.stderr
    return next((r for r in json.loads(listed.stdout) if r["job_id"] == job_id), None)


def settle(env: dict, job_id: str, states: set[str], timeout: float) -> None:
    """Until SLURM's own squeue (a small C program) shows the job in one of states, or no longer
    shows it: waiting by polling `queue` (a Python process a second) took the cores the job needs."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        shown = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id.removeprefix("slurm:"), "-o", "%T"],
                               env={**os.environ, **env}, capture_output=True, text=True).stdout.strip()
        if not shown or shown in states:
            return
        time.sleep(0.5)


def wait_state(env: dict, job_id: str, states: set[str], timeout: float = 240) -> dict:
    """The job's row in our `queue` once it is in one of states (read from SLURM by `queue` itself)."""
    settle(env, job_id, states, timeout)
    deadline = time.time() + timeout
    while time.time() < deadline:
        row = cluster_row(env, job_id)
        if row and row["state"] in states:
            return row
        time.sleep(1)
    raise AssertionError(f"{job_id} never reached {states}: {cluster_row(env, job_id)}")


def test_submit_to_slurm_trains_on_two_ranks_into_postgres(slurm, postgres_url, tmp_path, monkeypatch):
    """submit --cluster slurm: sbatch, one srun task running torchrun with 2 gloo ranks, metrics in
    PostgreSQL; our queue and acct read the job's state from SLURM itself."""
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    env = slurm_env(slurm)
    run_dir = small_training(tmp_path, 'name = "on-slurm"')
    sub = run_cli("submit", "--cluster", "slurm", "--cpu", "--gpus-per-node", "2", "--train",
                  str(tmp_path / "run.toml"), "-J", "slurm-pg", "-D", str(tmp_path), "--json",
                  module="scheduler", env=env)
    assert sub.returncode == 0, sub.stderr
    job_id = json.loads(sub.stdout)["job_id"]
    assert job_id.startswith("slurm:")
    row = wait_state(env, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    out = (tmp_path / f"slurm-pg-{job_id[6:]}.out").read_text()
    assert row["state"] == "COMPLETED" and row["exit_code"] == 0 and row["cluster"] == "slurm", out[-3000:]
    assert "2 x cpu (gloo)" in out and (run_dir / "sae" / "cfg.json").is_file()

    from sae_dist.db import get_engine, step_metrics
    from sae_dist.db.runs import find_run_by_dir

    engine = get_engine(postgres_url)
    run = find_run_by_dir(engine, str(run_dir.resolve()))
    assert run is not None and run.status == "COMPLETED" and run.world_size == 2 and run.name == "on-slurm"
    assert [m.step for m in step_metrics(engine, run.id)] == [10, 20]
    acct = run_cli("acct", "--json", module="scheduler", env=env)
    assert any(r["job_id"] == job_id and r["state"] == "COMPLETED" for r in json.loads(acct.stdout)), acct.stdout
    assert run_cli("queue", module="scheduler", env=env).stdout.count(job_id) == 0  # ended: not in the queue


def test_cancel_a_cluster_job_with_scancel(slurm, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    env = slurm_env(slurm)
    sub = run_cli("submit", "--cluster", "slurm", "--cpu", "-J", "sleeper", "-D", str(tmp_path), "--json",
                  "--", "sleep", "300", module="scheduler", env=env)
    assert sub.returncode == 0, sub.stderr
    job_id = json.loads(sub.stdout)["job_id"]
    wait_state(env, job_id, {"RUNNING"}, timeout=60)
    assert job_id in run_cli("queue", module="scheduler", env=env).stdout
    cancelled = run_cli("cancel", job_id, module="scheduler", env=env)
    assert cancelled.returncode == 0 and "cancel sent to SLURM" in cancelled.stdout, cancelled.stderr
    assert wait_state(env, job_id, {"CANCELLED"}, timeout=60)["state"] == "CANCELLED"

    # The two refusals are decided before SLURM is asked: the same main() in this process.
    from test_scheduler_cli import cli_in_process

    unknown = cli_in_process(capsys, "cancel", "slurm:999999")
    assert unknown.returncode == 2 and "was not submitted by sae-dist" in unknown.stderr
    bad = cli_in_process(capsys, "cancel", "slurm:abc")
    assert bad.returncode == 2 and "slurm:<SLURM job id>" in bad.stderr


def test_cluster_flags_without_a_cluster_are_one_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    result = run_cli("submit", "--nodes", "2", "--", "true", module="scheduler")
    assert result.returncode == 2 and "are for --cluster slurm" in result.stderr
    result = run_cli("submit", "--cluster", "slurm", "-H", "--", "true", module="scheduler")
    assert result.returncode == 2 and "SLURM decides when and where" in result.stderr


def test_an_exported_array_runs_as_slurms_array(slurm, tmp_path, monkeypatch):
    """A local array exported with export-sbatch is one SLURM array: each task gets its own
    SLURM_ARRAY_TASK_ID, the same SLURM_ARRAY_JOB_ID, and its own %A_%a output file."""
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    sub = run_cli("submit", "--json", "--array", "0-4:2", "-J", "arr", "-D", str(tmp_path), "--", "sh", "-c",
                  'echo "$SLURM_ARRAY_JOB_ID $SLURM_ARRAY_TASK_ID $SLURM_ARRAY_TASK_COUNT" '
                  '> "task-$SLURM_ARRAY_TASK_ID"',
                  module="scheduler")
    assert sub.returncode == 0, sub.stderr
    script = tmp_path / "array.sbatch"
    exp = run_cli("export-sbatch", str(json.loads(sub.stdout)["job_id"]), "--cpu", "-o", str(script),
                  module="scheduler")
    assert exp.returncode == 0 and "#SBATCH --array=0,2,4" in script.read_text().splitlines(), exp.stderr
    env = slurm_env(slurm)
    submitted = subprocess.run([slurm_command("sbatch", env["PATH"]), "--parsable", str(script)], cwd=tmp_path,
                               env={**slurm, **env},
                               capture_output=True, text=True)
    assert submitted.returncode == 0, submitted.stderr
    slurm_id = submitted.stdout.strip().split(";")[0]
    deadline = time.time() + 180
    while time.time() < deadline and subprocess.run(["squeue", "-h", "-j", slurm_id], env={**slurm, **env},
                                                    capture_output=True, text=True).stdout.strip():
        time.sleep(0.5)
    for task in (0, 2, 4):
        assert (tmp_path / f"task-{task}").read_text().split() == [slurm_id, str(task), "3"]
        assert (tmp_path / f"arr-{slurm_id}_{task}.out").exists()
    assert not (tmp_path / "task-1").exists()
