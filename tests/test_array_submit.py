"""What `submit --array` stores and writes, as plain data: one task per task id (a command's
tasks share one job; a training's each get their own run name), `[[array]]` overrides checked
one by one, %A/%a in output names, and SLURM's batch script for an array."""

from __future__ import annotations

import subprocess
from datetime import UTC, datetime

import pytest

from sae_dist.errors import UserError
from scheduler.array_submit import array_from_overrides, jobs_to_store, task_rows
from scheduler.arrays import ArraySpec, parse_array
from scheduler.sbatch import sbatch_script
from scheduler.spec import JobSpec, array_letters_used, expand_output

DEVICES = [(0, "virtual-0"), (1, "virtual-1")]
TRAIN = {"d_in": 16, "expansion_factor": 2, "k": 4, "steps": 10, "batch_size": 32, "source": "synthetic"}


def _train(tmp_path, **config) -> JobSpec:
    return JobSpec(kind="train", train_config={**TRAIN, **config}, workdir=str(tmp_path))


def test_a_command_array_is_one_job_repeated_with_its_task_ids(tmp_path):
    spec = JobSpec(argv=["python", "run.py"], workdir=str(tmp_path))
    tasks = jobs_to_store(spec, DEVICES, parse_array("0-8:4%2"))
    assert [t for t, _ in tasks] == [0, 4, 8]
    assert len({id(job) for _, job in tasks}) == 1 and tasks[0][1].array_max_running == 2
    rows = task_rows(tasks, datetime(2026, 1, 1, tzinfo=UTC))
    assert [r["array_task_id"] for r in rows] == [0, 4, 8] and {r["array_max_running"] for r in rows} == {2}
    assert jobs_to_store(spec, DEVICES)[0][0] is None  # a plain submit: no task id


def test_a_training_array_names_each_task_apart(tmp_path):
    tasks = jobs_to_store(_train(tmp_path, name="sweep"), DEVICES, parse_array("0-2"))
    assert [job.train_config["name"] for _, job in tasks] == ["sweep-0", "sweep-1", "sweep-2"]
    unnamed = jobs_to_store(_train(tmp_path), DEVICES, parse_array("3"))
    assert unnamed[0][1].train_config["name"] == "train-3"  # the job's default name, then the task


def test_array_tables_override_each_task_and_are_checked(tmp_path):
    overrides = [{"lr": 1e-3}, {"lr": 3e-4, "k": 8}, {"lr": 1e-4, "name": "low"}]
    array = array_from_overrides(overrides, None)
    assert array == ArraySpec((0, 1, 2))
    tasks = jobs_to_store(_train(tmp_path, name="lr"), DEVICES, array, overrides)
    assert [(job.train_config["lr"], job.train_config["k"], job.train_config["name"]) for _, job in tasks] == [
        (1e-3, 4, "lr-0"), (3e-4, 8, "lr-1"), (1e-4, 4, "low")]
    assert array_from_overrides(overrides, parse_array("1-2%1")) == ArraySpec((1, 2), 1)


@pytest.mark.parametrize("overrides, array, message", [
    ([], None, "[[array]] has no entries"),
    ([{"lr": 1e-3}], "0-1", "task 1 has no [[array]] entry in the TOML (1 entries: task ids 0-0)"),
    ([{"lr": 1e-3}, {"lr": -1.0}], None, "--train: [[array]] entry 1: lr"),
    ([{"lr": 1e-3}, {"lrr": 1.0}], None, "--train: [[array]] entry 1: lrr: unknown setting"),
    ([{"devices": "cpu:2"}], None, "devices cannot differ between tasks"),
    ([{"out_dir": "/tmp/same"}, {"out_dir": "/tmp/same"}], None, "tasks 0 and 1 of the array would both write"),
    (["lr"], None, "entry 0 must be a table"),
])
def test_a_bad_override_is_one_error_naming_its_entry(tmp_path, overrides, array, message):
    with pytest.raises(UserError) as e:
        given = array_from_overrides(overrides, parse_array(array) if array else None)
        jobs_to_store(_train(tmp_path), DEVICES, given, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_array_letters_in_output_names(tmp_path):
    assert array_letters_used("logs/%x-%A_%a.out") == "%A" and array_letters_used("%j.out") is None
    out = expand_output("%A_%3a-%j.out", 17, "n", tmp_path / "logs", tmp_path, "x", array=(12, 5))
    assert out == tmp_path / "12_005-17.out"  # %A as it is, %3a padded to 3
    assert expand_output("%A_%a", 17, "n", tmp_path, tmp_path, "x") == tmp_path / "%A_%a"  # no array: literal


def _script(tmp_path, job_kind="train", **kw) -> str:
    import json
    from types import SimpleNamespace

    job = SimpleNamespace(id=12, name="sweep", kind=job_kind, gpus=1, exclusive=False, workdir=str(tmp_path),
                          time_limit_s=None, env_json="{}", train_config_json=json.dumps({**TRAIN, "name": "sweep-0"}),
                          argv_json=json.dumps(["python", "run.py"]))
    return sbatch_script(job, **kw)


def test_an_array_becomes_slurms_array_with_a_config_per_task(tmp_path):
    configs = {0: {**TRAIN, "name": "sweep-0"}, 4: {**TRAIN, "name": "it's-4", "lr": 1e-4}}
    script = _script(tmp_path, array="0,4%1", task_configs=configs)
    lines = script.splitlines()
    assert "#SBATCH --output=%x-%A_%a.out" in lines and "#SBATCH --array=0,4%1" in lines
    assert 'case "$SLURM_ARRAY_TASK_ID" in' in lines and '    -m sae_dist train "${flags[@]}"' in lines
    path = tmp_path / "job.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0  # it parses, quotes and all
    # The case picks each task's own flags: run just that part of the script.
    case = script[script.index("case "):script.index("esac") + 4]
    for task, name in ((0, "sweep-0"), (4, "it's-4")):
        shown = subprocess.run(["bash", "-c", f'SLURM_ARRAY_TASK_ID={task}; {case}; printf "%s\\n" "${{flags[@]}}"'],
                               capture_output=True, text=True)
        assert f"--name={name}" in shown.stdout.splitlines()
    missing = subprocess.run(["bash", "-c", f"SLURM_ARRAY_TASK_ID=2; {case}"], capture_output=True, text=True)
    assert missing.returncode == 1 and "no config for array task 2" in missing.stderr


def test_an_array_text_that_is_not_ours_never_reaches_the_script(tmp_path):
    with pytest.raises(ValueError):
        _script(tmp_path, job_kind="command", array="0-3\n#SBATCH --x")


def test_a_command_array_script_runs_the_command_per_task(tmp_path):
    lines = _script(tmp_path, job_kind="command", array="0-99%8").splitlines()
    assert "#SBATCH --array=0-99%8" in lines and "#SBATCH --output=%x-%A_%a.out" in lines
    assert "srun python run.py" in lines
