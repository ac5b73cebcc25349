"""Usage accounting from device samples (pure, and sample thinning on a real database), and
`export-sbatch`: real SLURM batch scripts for training and for hostile command jobs."""

from __future__ import annotations

import json
import shlex
import subprocess
import textwrap
from datetime import timedelta

import pytest
from sqlalchemy import insert, select

from conftest import run_cli
from sae_dist.db import GpuSample, get_engine, utcnow
from scheduler.daemon import thin_samples
from scheduler.usage import MAX_GAP_S, summarize

# ---------------------------------------------------------------------------------------------
# summarize: (device, time s, utilisation %, memory used, power W) samples
# ---------------------------------------------------------------------------------------------


def test_summarize_utilisation_memory_and_energy():
    samples = [
        ("gpu0", 0.0, 10.0, 100, 100.0),
        ("gpu0", 1.0, 30.0, 300, 200.0),
        ("gpu0", 3.0, 50.0, 200, 100.0),
        ("gpu1", 0.5, 90.0, 50, 300.0),
        ("gpu1", 1.5, None, None, 300.0),  # a reading without utilisation or memory
    ]
    usage = summarize(samples)
    assert usage["mean_util_pct"] == pytest.approx((10 + 30 + 50 + 90) / 4)
    assert usage["peak_util_pct"] == 90.0
    assert usage["peak_memory_bytes"] == 300
    assert usage["samples"] == 5
    # gpu0: (100+200)/2*1 + (200+100)/2*2 = 450 J; gpu1: 300*1 = 300 J -> 750 J
    assert usage["energy_wh"] == pytest.approx(750 / 3600)
    # Order does not matter, devices never pair with each other.
    assert summarize(list(reversed(samples)))["energy_wh"] == pytest.approx(750 / 3600)


def test_summarize_skips_gaps_and_unknown_power():
    gap = MAX_GAP_S + 1
    usage = summarize([("d", 0.0, 50.0, 1, 100.0), ("d", 1.0, 50.0, 1, 100.0),
                       ("d", 1.0 + gap, 50.0, 1, 100.0),  # the daemon was down: not counted
                       ("d", 2.0 + gap, 50.0, 1, 100.0)])
    assert usage["energy_wh"] == pytest.approx(200 / 3600)
    edge = summarize([("d", 0.0, None, None, 60.0), ("d", MAX_GAP_S, None, None, 60.0)])  # exactly the limit
    assert edge["energy_wh"] == pytest.approx(60 * MAX_GAP_S / 3600)
    assert edge["mean_util_pct"] is None and edge["peak_memory_bytes"] is None

    virtual = summarize([("virtual-0", t, 20.0, 10, None) for t in (0.0, 1.0, 2.0)])
    assert virtual["energy_wh"] is None  # unknown, not 0
    assert virtual["mean_util_pct"] == 20.0
    assert summarize([("d", 0.0, 0.0, 0, 0.0), ("d", 1.0, 0.0, 0, 0.0)])["energy_wh"] == 0.0  # measured zero
    assert summarize([("d", 0.0, 5.0, 1, 250.0)])["energy_wh"] is None  # one reading: no interval
    assert summarize([("d", 0.0, 5.0, 1, None), ("d", 1.0, 5.0, 1, 100.0)])["energy_wh"] is None
    # Two readings at one instant, one without power (e.g. an old and a new daemon overlapping):
    # no crash, and the measured interval after them counts whatever order they come in.
    same = [("d", 1.0, 5.0, 1, None), ("d", 1.0, 5.0, 1, 100.0), ("d", 2.0, 5.0, 1, 100.0)]
    assert summarize(same)["energy_wh"] == pytest.approx(100 / 3600)
    assert summarize([same[1], same[0], same[2]])["energy_wh"] == pytest.approx(100 / 3600)
    empty = summarize([])
    assert empty == {"mean_util_pct": None, "peak_util_pct": None, "peak_memory_bytes": None,
                     "energy_wh": None, "samples": 0}


# ---------------------------------------------------------------------------------------------
# thin_samples on a real database
# ---------------------------------------------------------------------------------------------


def test_thin_samples_keeps_one_per_device_per_minute_for_old_ones():
    engine = get_engine()
    now = utcnow().replace(microsecond=0)
    old_start = (now - timedelta(days=10)).replace(second=0)  # on a minute boundary
    rows = []
    for device in ("gpu-a", "gpu-b"):
        for i in range(18):  # every 10 s for 3 minutes: 6 per minute
            rows.append({"device_uuid": device, "time": old_start + timedelta(seconds=10 * i),
                         "utilization_pct": 1.0, "memory_used": 1, "job_id": 1})
        for i in range(30):  # the last 30 seconds: untouched
            rows.append({"device_uuid": device, "time": now - timedelta(seconds=i), "utilization_pct": 2.0,
                         "memory_used": 2, "job_id": 2})
    table = GpuSample.__table__
    with engine.begin() as conn:
        conn.execute(insert(table), rows)
    cutoff = now - timedelta(days=7)

    removed = thin_samples(engine, cutoff)

    with engine.connect() as conn:
        left = conn.execute(select(table.c.device_uuid, table.c.time)).all()
    old = [(d, t) for d, t in left if t < cutoff]
    recent = [(d, t) for d, t in left if t >= cutoff]
    assert removed == 2 * 18 - 2 * 3
    assert len(recent) == 2 * 30
    buckets = [(d, int(t.timestamp()) // 60) for d, t in old]
    assert len(buckets) == len(set(buckets)) == 2 * 3  # one per device per minute
    assert thin_samples(engine, cutoff) == 0  # thinning twice changes nothing


# ---------------------------------------------------------------------------------------------
# export-sbatch
# ---------------------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, module="scheduler", timeout=60)


def _in_process(capsys, calls: list[tuple[str, ...]]) -> list[subprocess.CompletedProcess]:
    """The CLI's main in this process, call by call, each one's output captured as a process's."""
    from scheduler.cli import main

    results = []
    for args in calls:
        capsys.readouterr()
        code = main(list(args))
        out = capsys.readouterr()
        results.append(subprocess.CompletedProcess(list(args), code, out.out, out.err))
    return results


def _job_id(result: subprocess.CompletedProcess) -> int:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["job_id"]


def _bash_syntax_ok(script: str) -> None:
    check = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def _srun_command(script: str) -> list[str]:
    """The arguments of the script's one srun, its last command (it may span lines: a '\\'
    continuation, or a quoted argument holding a newline), as the shell would split them."""
    starts = [i for i, line in enumerate(script.splitlines(keepends=True)) if line.startswith("srun ")]
    assert len(starts) == 1, script
    tail = "".join(script.splitlines(keepends=True)[starts[0]:]).replace("\\\n", " ")
    argv = shlex.split(tail)
    assert argv[0] == "srun"
    return argv[1:]


@pytest.mark.slow
def test_export_sbatch(tmp_path, monkeypatch, capsys):
    """The submits and exports run the CLI's main in-process (the scripts are the subject); the
    first export also runs as a real process, which must write the same script."""
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "4")
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    out_dir = tmp_path / "my run"
    (tmp_path / "run.toml").write_text(textwrap.dedent(f"""
        d_in = 32
        d_sae = 128
        k = 8
        steps = 10
        lr = 0.0003
        out_dir = "{out_dir}"
    """))
    toml = str(tmp_path / "run.toml")
    hostile = ["echo", "$(rm -rf ~)", "; ls", "it's", "`id`", "a\nb", ""]
    train, untimed, command = (_job_id(r) for r in _in_process(capsys, [
        ("submit", "--json", "--train", toml, "--gpus", "2", "-t", "1:30:00", "-J", "my run; rm",
         "--env", "WANDB_MODE=off line", "-D", str(tmp_path)),
        ("submit", "--json", "--train", toml, "--gpus", "2"),
        ("submit", "--json", "-D", str(tmp_path), "--", *hostile),
    ]))
    written = tmp_path / "job.sbatch"
    script, plain, big, cmd = _in_process(capsys, [
        ("export-sbatch", str(train)), ("export-sbatch", str(untimed)),
        ("export-sbatch", str(train), "--nodes", "2", "--gpus-per-node", "4", "-o", str(written)),
        ("export-sbatch", str(command)),
    ])
    process = _cli("export-sbatch", str(train))
    for r in (script, plain, big, cmd, process):
        assert r.returncode == 0 and r.stderr == "", r.stderr
    assert process.stdout == script.stdout
    script = script.stdout

    assert script.startswith("#!/bin/bash\n")
    sbatch = [line for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert "#SBATCH --nodes=1" in sbatch and "#SBATCH --gpus-per-node=2" in sbatch
    assert "#SBATCH --ntasks-per-node=1" in sbatch  # one srun task (one torchrun) per node
    assert "#SBATCH --time=01:30:00" in sbatch
    assert any(line.startswith("#SBATCH --output=") for line in sbatch)
    assert all(";" not in line and " rm" not in line for line in sbatch)  # the name, made harmless
    assert f"cd {shlex.quote(str(tmp_path))}" in script
    assert "export WANDB_MODE='off line'" in script
    argv = _srun_command(script)
    assert argv[0] == "torchrun"
    flags = dict(zip(argv[1:], argv[2:]))
    assert flags["--nnodes"] and flags["--nproc-per-node"] == "2"
    assert flags["--rdzv-backend"] == "c10d" and flags["--rdzv-id"] == "$SLURM_JOB_ID"
    host, _, port = flags["--rdzv-endpoint"].rpartition(":")
    assert host and port.isdigit()
    module = argv.index("-m")
    assert argv[module:module + 3] == ["-m", "sae_dist", "train"]
    config_flags = ["--d-in=32", "--d-sae=128", "--k=8", "--lr=0.0003", "--steps=10", f"--out-dir={out_dir}",
                    "--devices=cuda:2"]
    trainer_flags = argv[module + 3:]
    assert [f for f in trainer_flags if f in config_flags] == config_flags, trainer_flags  # in order
    assert all(f.startswith("--") for f in trainer_flags)
    _bash_syntax_ok(script)

    assert "--time" not in plain.stdout  # no limit, no --time line
    _bash_syntax_ok(plain.stdout)

    assert big.stdout.strip() == f"wrote {written}"
    exported = written.read_text()
    assert "#SBATCH --nodes=2" in exported and "#SBATCH --gpus-per-node=4" in exported
    big_argv = _srun_command(exported)
    assert big_argv[big_argv.index("--nproc-per-node") + 1] == "4" and "--devices=cuda:4" in big_argv
    _bash_syntax_ok(exported)

    # A command job: its arguments come back exactly, nothing in them is evaluated.
    assert _srun_command(cmd.stdout) == hostile
    _bash_syntax_ok(cmd.stdout)
    # Run it with a stand-in srun that prints its arguments (NUL-separated), HOME a scratch dir.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\nfor a in \"$@\"; do printf '%s\\0' \"$a\"; done\n")
    (fake / "srun").chmod(0o755)
    ran = subprocess.run(["bash", "-c", cmd.stdout], capture_output=True,
                         env={"PATH": f"{fake}:/usr/bin:/bin", "HOME": str(tmp_path)})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.decode().split("\0")[:-1] == hostile
    assert (tmp_path / "run.toml").exists()  # `rm -rf ~` did not run

