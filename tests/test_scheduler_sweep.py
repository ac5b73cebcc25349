"""A sweep is one job: `submit --train run.toml` with a [sweep] table and/or `--sweep KEY=V1,V2`
is checked at submit (one error line, nothing stored), stored as the base config plus its lists,
and run (and exported to SLURM) as `python -m sae_dist train ... --sweep=KEY=V1,V2`; explicit
[[sweep.points]] are stored as a list and run as `--sweep-points=JSON`."""

from __future__ import annotations

import json
import shlex

import pytest

from conftest import wait_for
from sae_dist.config import load_toml
from sae_dist.contract.sweep import build_sweep, parse_sweep_flags, split_sweep
from sae_dist.contract.sweep_argv import SWEEP_KEY, stored_job_flags, sweep_flags, sweep_size, swept_keys
from sae_dist.db import get_engine
from sae_dist.db.sweeps import list_sweeps, sweep_runs
from scheduler.spec import JobSpec
from scheduler.store import count_jobs, get_job
from scheduler.supervisor import job_argv
from test_scheduler_cli import cli_in_process, sched, submitted_id  # noqa: F401 (sched: a fixture)

BASE = 'name = "sw"\nd_in = 16\nsteps = 5\nbatch_size = 32\nsource = "synthetic"\n'


def _toml(tmp_path, text: str):
    path = tmp_path / "run.toml"
    path.write_text(BASE + text)
    return path


def _swept_names(flags: list[str], base: dict) -> list[str]:
    """The SAE names the trainer builds from a command line's --sweep flags."""
    lists = parse_sweep_flags([f.removeprefix("--sweep=") for f in flags if f.startswith("--sweep=")])
    return build_sweep(base, None, lists).names


@pytest.mark.slow  # CLI calls on a real database
def test_a_sweep_is_one_job_whose_command_line_carries_the_sweep(sched, tmp_path, capsys):
    toml = _toml(tmp_path, '[sweep]\nk = [4, 8]\nexpansion_factor = [2, 4]\n')
    done = cli_in_process(capsys, "submit", "--json", "--train", str(toml), "--sweep", "lr=3e-4,1e-3",
                          "--sweep", "expansion_factor=2,8", "-D", str(tmp_path))
    job = get_job(get_engine(), submitted_id(done))
    stored = json.loads(job.train_config_json)
    # The flag replaced the TOML's expansion_factor list; the keys keep the TOML's order, then the flags'.
    assert stored[SWEEP_KEY] == {"k": [4, 8], "expansion_factor": [2, 8], "lr": [3e-4, 1e-3]}
    assert sweep_size(stored) == 8 and count_jobs(get_engine()) == 1

    argv = job_argv(job, ["virtual-0", "virtual-1"])
    assert argv[2:4] == ["sae_dist", "train"] and "--devices=cpu:2" in argv
    assert [a for a in argv if a.startswith("--sweep")] == [
        "--sweep=k=4,8", "--sweep=expansion_factor=2,8", "--sweep=lr=0.0003,0.001"]
    base, table = split_sweep(load_toml(toml))
    expected = build_sweep(base, table, parse_sweep_flags(["lr=3e-4,1e-3", "expansion_factor=2,8"])).names
    assert _swept_names(argv, base) == expected  # the trainer reads back the same 8 SAEs, in order
    assert expected[0] == "k4-x2-lr3e-4"

    script = cli_in_process(capsys, "export-sbatch", str(job.id)).stdout
    assert "--sweep=k=4,8 --sweep=expansion_factor=2,8 --sweep=lr=0.0003,0.001" in script
    queue = cli_in_process(capsys, "queue").stdout.splitlines()
    assert queue[1].split()[:3] == [str(job.id), "sw", "(8", ] and "SAEs)" in queue[1]
    assert json.loads(cli_in_process(capsys, "queue", "--json").stdout)[0]["saes"] == 8


@pytest.mark.parametrize(("toml_sweep", "flags", "message"), [
    ("[sweep]\nkk = [4, 8]\n", (), "error: sweep: kk: unknown setting; did you mean 'k'?"),
    ("[sweep]\nk = []\n", (), "error: sweep: k = []: an empty list; give one or more values"),
    ("k = 8\n", ("--sweep", "k=4,16"), "error: sweep: k is given both as a setting (k = 8) and in the sweep; keep one"),
    ("", ("--sweep", "k=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16",
          "--sweep", "lr=" + ",".join(f"{i}e-4" for i in range(1, 18))),
     "error: sweep: 272 SAEs (16 k x 17 lr); one job trains at most 256"),
    ("[sweep]\nk = [4]\n\n[[sweep.points]]\nk = 8\n", (), "error: sweep: both lists (k) and [[sweep.points]] given"),
    ("[[sweep.points]]\nk = 4\n", ("--sweep", "lr=1e-3,3e-3"), "error: sweep: --sweep lr cannot be combined with "
                                                              "[[sweep.points]]"),
    ("[[sweep.points]]\nk = 4\n\n[[sweep.points]]\nkk = 8\n", (), "error: sweep: point 2 of [[sweep.points]]: kk: "
                                                                  "unknown setting"),
])
def test_a_bad_sweep_is_one_error_and_nothing_is_stored(sched, tmp_path, capsys, toml_sweep, flags, message):
    done = cli_in_process(capsys, "submit", "--train", str(_toml(tmp_path, toml_sweep)), *flags, "-D", str(tmp_path))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith(message), done.stderr
    assert count_jobs(get_engine()) == 0


def test_sweep_goes_with_train_only(sched, tmp_path, capsys):
    done = cli_in_process(capsys, "submit", "--sweep", "k=4,8", "--", "true")
    assert (done.returncode, done.stderr) == (2, "error: --sweep: goes with --train run.toml (a command job has "
                                                  "no training settings)\n")


def test_the_app_path_a_spec_with_sweep_lists_is_checked_and_flagged():
    config = {"name": "s", "d_in": 16, "source": "synthetic", "k": 8}
    spec = JobSpec(kind="train", train_config={**config, SWEEP_KEY: {"k": [4, 8], "lr": [1e-3]}}, workdir="/tmp")
    assert spec.train_config[SWEEP_KEY] == {"k": [4, 8], "lr": [1e-3]}
    flags = stored_job_flags(spec.train_config, "cpu:1")
    assert "--k=8" not in flags and flags[-2:] == ["--sweep=k=4,8", "--sweep=lr=0.001"]
    assert sweep_flags(None) == [] and sweep_size(spec.train_config) == 2
    with pytest.raises(Exception, match=r"^--sweep: k: unknown|^--sweep: .*'k'"):
        JobSpec(kind="train", train_config={**config, SWEEP_KEY: {"kk": [4]}}, workdir="/tmp")


def test_an_array_of_sweeps_each_task_a_sweep_and_no_override_of_a_swept_key(sched, tmp_path, capsys):
    toml = _toml(tmp_path, '[sweep]\nk = [4, 8]\n\n[[array]]\nlr = 1e-3\n\n[[array]]\nlr = 3e-4\n')
    done = cli_in_process(capsys, "submit", "--json", "--train", str(toml), "-D", str(tmp_path))
    array_id = submitted_id(done)
    configs = [json.loads(get_job(get_engine(), array_id + i).train_config_json) for i in (0, 1)]
    assert [(c["name"], c["lr"], c[SWEEP_KEY]) for c in configs] == [("sw-0", 1e-3, {"k": [4, 8]}),
                                                                     ("sw-1", 3e-4, {"k": [4, 8]})]
    toml.write_text(toml.read_text() + "\n[[array]]\nk = 16\n")
    bad = cli_in_process(capsys, "submit", "--train", str(toml), "-D", str(tmp_path))
    assert (bad.returncode, bad.stderr) == (2, "error: --train: [[array]] entry 2: k is swept in every task "
                                               "([sweep]); set it in one of the two\n")
    assert count_jobs(get_engine()) == 2


POINTS = '[[sweep.points]]\nk = 4\n\n[[sweep.points]]\nk = 8\nlr = 1e-3\n'


def _trainer_names(argv: list[str]) -> list[str]:
    """The SAE names the trainer's own parser builds from a job's command line."""
    from sae_dist.cli import _parser
    from sae_dist.contract import sweep_from_args

    ns = _parser().parse_args(["train", *argv])
    return sweep_from_args(ns).names


@pytest.mark.slow  # CLI calls on a real database
def test_explicit_points_are_one_job_whose_command_line_carries_them_as_json(sched, tmp_path, capsys):
    done = cli_in_process(capsys, "submit", "--json", "--train", str(_toml(tmp_path, POINTS)), "-D", str(tmp_path))
    job = get_job(get_engine(), submitted_id(done))
    stored = json.loads(job.train_config_json)
    assert stored[SWEEP_KEY] == {"points": [{"k": 4}, {"k": 8, "lr": 1e-3}]}
    assert sweep_size(stored) == 2 and swept_keys(stored[SWEEP_KEY]) == ["k", "lr"]
    argv = job_argv(job, ["virtual-0"])
    flags = [a for a in argv if a.startswith("--sweep")]
    assert flags == ['--sweep-points=[{"k":4},{"k":8,"lr":0.001}]']
    assert not any(a.startswith(("--k=", "--lr=")) for a in argv)  # the points set them
    assert _trainer_names(argv[4:]) == ["k4", "k8-lr1e-3"]
    # The SLURM script: the JSON is one shell word, read back the same by a shell.
    script = cli_in_process(capsys, "export-sbatch", str(job.id)).stdout
    assert """'--sweep-points=[{"k":4},{"k":8,"lr":0.001}]'""" in script
    line = next(x for x in script.splitlines() if "--sweep-points" in x)
    assert shlex.split(line)[shlex.split(line).index("train") + 1:][-2:] == [flags[0], "--no-db"]
    queue = cli_in_process(capsys, "queue").stdout.splitlines()
    assert "(2 SAEs)" in queue[1]


def test_the_app_path_a_spec_with_points_is_checked_and_flagged():
    config = {"name": "s", "d_in": 16, "source": "synthetic", "k": 8}
    spec = JobSpec(kind="train", train_config={**config, SWEEP_KEY: {"points": [{"k": 4}, {"lr": 1e-3}]}},
                   workdir="/tmp")
    assert spec.train_config[SWEEP_KEY] == {"points": [{"k": 4}, {"lr": 1e-3}]}
    flags = stored_job_flags(spec.train_config, "cpu:1")
    assert "--k=8" not in flags and flags[-1] == '--sweep-points=[{"k":4},{"lr":0.001}]'
    with pytest.raises(Exception, match="point 2 of"):
        JobSpec(kind="train", train_config={**config, SWEEP_KEY: {"points": [{"k": 4}, {"kk": 4}]}}, workdir="/tmp")
    with pytest.raises(Exception, match="one or more tables"):
        JobSpec(kind="train", train_config={**config, SWEEP_KEY: {"points": "k=4"}}, workdir="/tmp")


def test_the_trainer_reads_sweep_points_and_refuses_them_twice(tmp_path):
    assert _trainer_names(["--sweep-points", '[{"k": 4}, {"k": 8, "lr": 0.001}]']) == ["k4", "k8-lr1e-3"]
    with pytest.raises(Exception, match="--sweep-points: not JSON"):
        _trainer_names(["--sweep-points", "k=4"])
    with pytest.raises(Exception, match="--sweep-points and the TOML's"):
        _trainer_names(["--config", str(_toml(tmp_path, POINTS)), "--sweep-points", '[{"k": 4}]'])


@pytest.mark.slow  # a real daemon runs a real (tiny) sweep
def test_a_real_daemon_runs_the_sweep_as_one_job(sched, tmp_path, capsys):
    """Explicit points, so the stored list, its --sweep-points flag and the trainer's reading of it
    run for real (a grid's --sweep flags run for real in tests/test_sweep_train.py)."""
    toml = _toml(tmp_path, POINTS)
    job_id = submitted_id(cli_in_process(capsys, "submit", "--json", "--train", str(toml), "--gpus", "1",
                                         "-D", str(tmp_path)))
    sched.start_daemon()
    engine = get_engine()
    wait_for(lambda: get_job(engine, job_id).state not in ("PENDING", "RUNNING"), 120, "the sweep job")
    job = get_job(engine, job_id)
    log = (sched.home / "logs" / f"{job_id}-sw.out")
    assert job.state == "COMPLETED", log.read_text()[-2000:] if log.exists() else job
    (sweep,) = [s for s in list_sweeps(engine) if s.job_id == job_id]  # one job, one sweep
    runs = sweep_runs(engine, sweep.id)
    assert [(r.sweep_point, r.status, r.job_id) for r in runs] == [("k4", "COMPLETED", job_id),
                                                                   ("k8-lr1e-3", "COMPLETED", job_id)]
    assert json.loads(runs[1].config_json)["lr"] == 1e-3 and json.loads(runs[0].config_json)["k"] == 4
