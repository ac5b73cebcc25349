"""export-sbatch on a real SLURM: a one-node cluster on loopback runs the exported training job.

Needs Debian's slurm-wlm (scripts/test.sh installs it where it can: root and apt). The cluster
has no GPUs, so the job is exported with --cpu: torchrun starts the same `-m sae_dist train`
ranks with gloo. Recipe: shared/notes/slurm-and-postgres-on-loopback.md (auth/none, sandbox only).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import run_cli

pytestmark = pytest.mark.skipif(shutil.which("slurmctld") is None or os.geteuid() != 0,
                                reason="needs Debian's slurm-wlm and root (scripts/test.sh installs it)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def slurm(tmp_path):
    d = tmp_path / "slurm"
    for sub in ("state", "spool", "log"):
        (d / sub).mkdir(parents=True)
    d.chmod(0o755)
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
        AuthType=auth/none
        CredType=cred/none
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


def test_exported_training_job_runs_under_slurm(slurm, tmp_path, monkeypatch):
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "2")
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
    """))
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
    submitted = subprocess.run(["sbatch", "--parsable", str(script)], cwd=tmp_path, env=env,
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
