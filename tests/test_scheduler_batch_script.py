"""`submit job.sh` (and the `sbatch` console script): a lab's batch script, its #SBATCH lines read
as sbatch reads them, queued and run unchanged.

The reading is pure (scheduler.batch_script: text in, directives and warnings out) and tested on
plain text; the command line's part (precedence, checks, the stored copy, exit codes) in-process;
a real daemon on virtual devices runs the scripts and their array tasks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from importlib import import_module
from pathlib import Path

import pytest

from conftest import REPO, wait_for
from sae_dist.db import get_engine
from sae_dist.errors import UserError
from scheduler.batch_script import BatchScript, parse_export, parse_shebang, read_script
from scheduler.store import count_jobs, get_job, list_jobs
from test_scheduler_cli import cli_in_process, sched  # noqa: F401 (sched: a fixture)

LAB_LINES = """\
#!/bin/bash
#SBATCH --array=0-3
#SBATCH --gres=gpu:1
#SBATCH -t 10
#SBATCH -J x
"""
LAB_ONE_LINE = """\
#!/bin/bash
#SBATCH --array=0-3 --gres=gpu:1 -t 10 -J x
"""
LAB_BODY = """
# as a lab writes it: its task id into its own -o file
echo "$SLURM_ARRAY_TASK_ID"
env | grep '^SLURM_' | sort >&2
"""
LAB_FLAGS = ("--array=0-3", "--gpus=1", "--time=10", "--job-name=x")


def _flags(script: BatchScript) -> list[str]:
    return [flag for d in script.directives for flag in d.argv]


# ---------------------------------------------------------------------------------------------
# Reading a script (pure)
# ---------------------------------------------------------------------------------------------

def test_separate_lines_and_one_line_read_alike():
    apart, together = read_script(LAB_LINES + LAB_BODY), read_script(LAB_ONE_LINE + LAB_BODY)
    assert _flags(apart) == _flags(together) == list(LAB_FLAGS)
    assert apart.interpreter == together.interpreter == ("/bin/bash",)
    assert apart.warnings == together.warnings == ()
    assert [(d.line, d.text) for d in apart.directives] == [(2, "--array=0-3"), (3, "--gres=gpu:1"), (4, "-t 10"),
                                                            (5, "-J x")]
    assert {d.line for d in together.directives} == {2}


def test_every_way_of_writing_an_option():
    script = read_script(textwrap.dedent("""\
        #!/bin/bash
        #SBATCH --time=5 --time 6 -t 7 -t8 --tim=9
        #SBATCH --job-name "a b" -J'c d' --output=o.log # a comment: -t 99
        #SBATCH -Ha 0-2%1 --nice --nice=-5 --exclusive --requ --parsable
        #SBATCH -b now+1hour -D /tmp -d afterok:3 -e %x-%j.err --export=ALL,A=1
        """))
    assert _flags(script) == [
        "--time=5", "--time=6", "--time=7", "--time=8",
        "--job-name=a b", "--job-name=c d", "--output=o.log",
        "--hold", "--array=0-2%1", "--nice=100", "--nice=-5", "--exclusive", "--requeue", "--parsable",  # --requ:
        # a unique prefix is the option, as getopt's; an ambiguous one (--tim) is not
        "--begin=now+1hour", "--chdir=/tmp", "--dependency=afterok:3", "--error=%x-%j.err", "--export=ALL,A=1"]
    assert script.warnings == ("2: #SBATCH --tim=9: an ambiguous abbreviation (of --time, --time-min); ignored",)


@pytest.mark.parametrize("directive, gpus, warned", [
    ("--gres=gpu:2", 2, None), ("--gres=gpu", 1, None), ("--gres gpu:a100:3", 3, "GPU type 'a100' is ignored"),
    ("--gres=gpu:a100", 1, "GPU type 'a100' is ignored"), ("-G 2", 2, None), ("--gpus=h100:4", 4, "'h100'"),
    ("--gpus-per-node=3", 3, None), ("--gpus-per-node=a100:2", 2, "'a100'"),
    ("--gres=gpu:1,shard:2", 1, "the resource 'shard:2' is not scheduled here"),
    ("--gres=shard:2", None, "the resource 'shard:2' is not scheduled here"),
])
def test_gpu_requests(directive, gpus, warned):
    script = read_script(f"#!/bin/bash\n#SBATCH {directive}\n")
    assert _flags(script) == ([f"--gpus={gpus}"] if gpus is not None else [])
    assert len(script.warnings) == (1 if warned else 0)
    if warned:
        assert warned in script.warnings[0] and script.warnings[0].startswith(f"2: #SBATCH {directive}: ")


def test_each_ignored_directive_is_one_warning_saying_so():
    script = read_script(textwrap.dedent("""\
        #!/bin/bash
        #SBATCH -N 2 --partition gpu --ntasks=4
        #SBATCH --cpus-per-task=8 --mail-user=me@lab.org --mail-type=END -p long
        #SBATCH --mem=64G --mem-per-gpu=20G --exclusive=user
        #SBATCH --bogus value --also-bogus=1 -y
          #SBATCH -t 3
        # a comment, then blank lines

        #SBATCH -J still-read
        python train.py
        #SBATCH -t 4
        """))
    assert _flags(script) == ["--job-name=still-read"]
    warned = [(w.split(":")[0], w.split(": ", 2)[1]) for w in script.warnings]
    expected = [
        ("2", "#SBATCH -N 2"), ("2", "#SBATCH --partition gpu"), ("2", "#SBATCH --ntasks=4"),
        ("3", "#SBATCH --cpus-per-task=8"), ("3", "#SBATCH --mail-user=me@lab.org"), ("3", "#SBATCH --mail-type=END"),
        ("3", "#SBATCH -p long"), ("4", "#SBATCH --mem=64G"), ("4", "#SBATCH --mem-per-gpu=20G"),
        ("4", "#SBATCH --exclusive=user"), ("5", "#SBATCH --bogus value"), ("5", "#SBATCH --also-bogus=1"),
        ("5", "#SBATCH -y"), ("6", "an indented #SBATCH is a comment to sbatch (the line must start with #SBATCH)"),
        ("11", "#SBATCH after the script's first command")]
    assert len(warned) == len(expected), warned
    for (line, text), (want_line, want) in zip(warned, expected):
        assert line == want_line and text.startswith(want), (line, text)
    assert all(w.endswith("ignored") for w in script.warnings), script.warnings
    assert "not an sbatch option" in script.warnings[10] and "host memory" in script.warnings[7]


@pytest.mark.parametrize("text, line, needle", [
    ("echo hi\n", 1, "the first line is not #!"),
    ("", 1, "the first line is not #!"),
    ("#!\n", 1, "#! names no interpreter"),
    ("#!/bin/bash\r\n#SBATCH -t 5\r\n", 1, "DOS line break"),
    ("#!/bin/bash\n#SBATCH -J x\x00\n", 2, "NUL byte"),
    ("#!/bin/bash\n\n#SBATCH -J 'open\n", 3, "no closing quotation"),
    ("#!/bin/bash\n#SBATCH -t\n", 2, "-t needs a value on the same line"),
    ("#!/bin/bash\n#SBATCH --time\n", 2, "--time needs a value on the same line"),
    ("#!/bin/bash\n#SBATCH --hold=yes\n", 2, "--hold takes no value"),
    ("#!/bin/bash\n#SBATCH -t 5 oops\n", 2, "'oops' is not an option"),
    ("#!/bin/bash\n#SBATCH --gres=gpu:x:y:z\n", 2, "--gres: 'gpu:x:y:z' is not a GPU request"),
    ("#!/bin/bash\n#SBATCH --gres=gpu:a100:two\n", 2, "has no GPU count"),
    ("#!/bin/bash\n#SBATCH -G lots\n", 2, "--gpus: 'lots' is not a GPU count"),
    ("#!/bin/bash\n#SBATCH --mem=lots\n", 2, "--mem: bad memory size 'lots'"),
])
def test_what_sbatch_refuses_is_an_error_naming_the_line(text, line, needle):
    with pytest.raises(UserError) as e:
        read_script(text)
    assert str(e.value).startswith(f"{line}: ") and needle in str(e.value), str(e.value)


def test_the_interpreter_is_the_kernels_reading_of_the_shebang():
    assert parse_shebang("#!/bin/bash") == ("/bin/bash",)
    assert parse_shebang("#! /bin/bash -l ") == ("/bin/bash", "-l")
    assert parse_shebang("#!/usr/bin/env python3") == ("/usr/bin/env", "python3")
    assert parse_shebang("#!/usr/bin/env -S python3 -u") == ("/usr/bin/env", "-S python3 -u")  # one argument


def test_export_as_sbatch_reads_it():
    env = {"LR": "3e-4", "HOME": "/home/me"}
    assert parse_export("ALL", env) == (True, {})
    assert parse_export("NONE", env) == (False, {})
    assert parse_export("ALL,A=1,LR", env) == (True, {"A": "1", "LR": "3e-4"})
    assert parse_export("A=x=y,LR,UNSET", env) == (False, {"A": "x=y", "LR": "3e-4"})  # no ALL: only these
    for bad in ("", "ALL,,A=1", "1A=2", "A B"):
        with pytest.raises(UserError, match="--export: "):
            parse_export(bad, env)


SRUN_SIGNS = {"SLURM_NTASKS", "SLURM_JOBID", "SLURM_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NNODES",
              "SLURM_TASKS_PER_NODE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_ID"}
"""What tools take for a sign of SLURM's srun or an allocation (Lightning: SLURM_NTASKS; Open MPI and
PRRTE: SLURM_JOBID; MPICH's hydra: SLURM_NODELIST, SLURM_NNODES, SLURM_TASKS_PER_NODE; submitit's
ranks and Lightning's: SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID)."""


def test_a_batch_jobs_environment():
    """SLURM_JOB_ID, SLURM_JOB_NAME and SLURM_SUBMIT_DIR for a batch job, none of srun's; with
    --export=NONE a bare environment instead of the daemon's."""
    from types import SimpleNamespace

    from scheduler.supervisor import BARE_PATH, job_environment

    base = {"PATH": "/venv/bin:/bin", "HOME": "/home/me", "FROM_DAEMON": "1", "SAE_DIST_HOME": "/state",
            **{name: "4" for name in SRUN_SIGNS}}
    stored = {"SLURM_SUBMIT_DIR": "/lab", "A": "1"}

    def job(kind: str, **env: str):
        return SimpleNamespace(id=12, name="x", kind=kind, port=None, env_json=json.dumps({**stored, **env}),
                               array_job_id=None, array_task_id=None, snapshot_dir=None)

    env = job_environment(job("batch"), ["virtual-0"], base)
    assert {k: v for k, v in env.items() if k.startswith("SLURM_")} == {
        "SLURM_JOB_ID": "12", "SLURM_JOB_NAME": "x", "SLURM_SUBMIT_DIR": "/lab"}
    assert (env["FROM_DAEMON"], env["PATH"], env["A"], env["SAE_DIST_JOB_ID"]) == ("1", "/venv/bin:/bin", "1", "12")
    bare = job_environment(job("batch", SAE_DIST_EXPORT="NONE"), ["virtual-0"], base)
    assert "FROM_DAEMON" not in bare and not SRUN_SIGNS & set(bare)
    assert (bare["PATH"], bare["HOME"], bare["SAE_DIST_HOME"], bare["A"], bare["SLURM_JOB_ID"]) == (
        BARE_PATH, "/home/me", "/state", "1", "12")
    # A command job's stored environment is its --env alone, and it gets no SLURM_JOB_ID
    assert "SLURM_JOB_ID" not in job_environment(job("command", SAE_DIST_EXPORT="NONE"), ["virtual-0"], base)


# ---------------------------------------------------------------------------------------------
# The command line: precedence, checks, exit codes (in-process, no daemon)
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def machine(state_home, monkeypatch, tmp_path):
    """4 virtual devices, no daemon; the test's directory is the one submitted from."""
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "4")
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _script(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_the_command_line_wins_over_the_script(machine, capsys, monkeypatch):
    script = _script(machine / "job.sh", LAB_ONE_LINE + "#SBATCH --export=ALL,A=1,LR --nice=3\n" + LAB_BODY)
    monkeypatch.setenv("LR", "1e-3")
    done = cli_in_process(capsys, "submit", "--json", "-t", "2:00", "-J", "mine", "--env", "A=2", "--array", "5",
                          script, "arg 1", "-t", "3")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    answer = json.loads(done.stdout)
    assert answer["tasks"] == 1 and answer["array"] == "5"  # the command line's --array
    job = get_job(get_engine(), answer["job_id"])
    assert (job.name, job.time_limit_s, job.priority, job.gpus, job.kind) == ("mine", 120.0, -3, 1, "batch")
    assert json.loads(job.env_json) == {"A": "2", "LR": "1e-3", "SLURM_SUBMIT_DIR": str(machine)}
    argv = json.loads(job.argv_json)
    assert argv[0] == "/bin/bash" and argv[2:] == ["arg 1", "-t", "3"]  # after the script: its own arguments
    copy = Path(argv[1])
    assert copy.parent == Path(os.environ["SAE_DIST_HOME"]) / "batch" and copy.read_text() == Path(script).read_text()
    assert job.stdout_pattern == "slurm-%A_%a.out" and job.stderr_pattern is None  # sbatch's default, an array's
    assert job.workdir == str(machine)

    # --export on the command line replaces the script's; NONE is stored for the supervisor
    done = cli_in_process(capsys, "submit", "--json", "--export", "NONE", "-o", "here.out", script)
    job = get_job(get_engine(), json.loads(done.stdout)["job_id"])
    assert json.loads(job.env_json) == {"SLURM_SUBMIT_DIR": str(machine), "SAE_DIST_EXPORT": "NONE"}
    assert job.stdout_pattern == "here.out"

    # --parsable: the id alone, as sbatch's; the default name is the script's
    plain = _script(machine / "plain.sh", "#!/bin/sh\necho hi\n")
    done = cli_in_process(capsys, "submit", "--parsable", plain)
    job = get_job(get_engine(), int(done.stdout))
    assert done.stdout == f"{job.id}\n" and job.name == "plain.sh" and job.stdout_pattern == "slurm-%j.out"
    assert json.loads(job.argv_json)[0] == "/bin/sh"


def test_a_command_after_dashes_is_never_read_as_a_script(machine, capsys):
    script = _script(machine / "job.sh", LAB_ONE_LINE + LAB_BODY)
    done = cli_in_process(capsys, "submit", "--json", "--", script, "a")  # `--`: a command, as always
    job = get_job(get_engine(), json.loads(done.stdout)["job_id"])
    assert (job.kind, json.loads(job.argv_json), job.name, job.array_job_id) == ("command", [script, "a"], "job.sh",
                                                                                 None)
    assert json.loads(job.env_json) == {} and job.time_limit_s is None
    # Without `--`, the first word is a batch script: a program name is not one (it used to run as a command)
    before = count_jobs(get_engine())
    for args, needle in ((("python", "x.py"), "python: no such batch script (to run a program, put it after --: "
                                              "submit -- python ...)"),
                         ((str(machine),), "is a directory, not a batch script")):
        done = cli_in_process(capsys, "submit", *args)
        assert (done.returncode, done.stdout) == (2, "") and done.stderr.splitlines() == [f"error: {done.stderr[7:-1]}"]
        assert needle in done.stderr, done.stderr
    assert count_jobs(get_engine()) == before


def test_bad_scripts_are_one_error_line_exit_2_and_store_nothing(machine, capsys):
    engine = get_engine()
    cases = [  # (script, the error's start after "error: NAME:")
        ("echo hi\n", "1: the first line is not #! and an interpreter"),
        ("#!/bin/bash\n#SBATCH -J ok\n#SBATCH -t 1x\n", "3: #SBATCH -t 1x: --time: '1x' is not a time limit"),
        ("#!/bin/bash\n#SBATCH --nice=abc\n", "2: #SBATCH --nice=abc: argument --nice: 'abc' is not a whole number"),
        ("#!/bin/bash\n#SBATCH -o x%N.out\n", "2: #SBATCH -o x%N.out: --output: '%N' in 'x%N.out' is not supported"),
        ("#!/bin/bash\n#SBATCH --export=SLURM_X=1\n", "2: #SBATCH --export=SLURM_X=1: --export: SLURM_X refused"),
        ("#!/bin/bash\n#SBATCH -D /nonexistent\n", "2: #SBATCH -D /nonexistent: --chdir: /nonexistent does not exist"),
        ("#!/bin/bash\n#SBATCH -d singleton\n", "2: #SBATCH -d singleton: --dependency: unknown kind 'singleton'"),
        ("#!/bin/bash\n#SBATCH --array=3-1\n", "2: #SBATCH --array=3-1: --array '3-1': the range 3-1 ends before"),
        ("#!/bin/bash\n#SBATCH --begin=soonish\n", "2: #SBATCH --begin=soonish: --begin: 'soonish' is not a begin"),
        ("#!/bin/bash\n#SBATCH --gres=gpu:k80:x\n", "2: #SBATCH --gres=gpu:k80:x: --gres: 'gpu:k80:x' has no GPU"),
        ("#!/bin/bash\n#SBATCH -J ok -t\n", "2: #SBATCH -t: -t needs a value on the same line"),
        ("#!/bin/bash\r\n", "1: a DOS line break"),
    ]
    for n, (text, start) in enumerate(cases):
        script = _script(machine / f"bad{n}.sh", text)
        done = cli_in_process(capsys, "submit", script)
        what = f"{text!r}: {done}"
        assert (done.returncode, done.stdout) == (2, ""), what
        assert done.stderr.startswith(f"error: {script}:{start}") and done.stderr.count("\n") == 1, what
    # A command line's own mistakes stay its own (no line to name), and --export needs a script
    script = _script(machine / "good.sh", LAB_LINES)
    for args, needle in ((("-t", "1x", script), "error: --time: '1x' is not a time limit"),
                         (("--export", "NONE", "--", "true"), "error: --export: goes with a batch script"),
                         (("--train", "run.toml", script), "error: give either --train run.toml or a batch script"),
                         (("--cluster", "slurm", script), "error: --cluster slurm: a batch script goes to this")):
        done = cli_in_process(capsys, "submit", *args)
        assert done.returncode == 2 and done.stderr.startswith(needle), (args, done.stderr)
    assert count_jobs(engine) == 0 and not (Path(os.environ["SAE_DIST_HOME"]) / "batch").exists()


def test_an_ignored_directive_is_one_warning_and_the_job_is_queued(machine, capsys):
    script = _script(machine / "job.sh", "#!/bin/bash\n#SBATCH -N 1 --partition=gpu -J w\n#SBATCH --bogus\necho\n")
    done = cli_in_process(capsys, "submit", script)
    assert done.returncode == 0 and done.stdout == "Submitted batch job 1\n"
    assert done.stderr.splitlines() == [
        f"warning: {script}:2: #SBATCH -N 1: this scheduler runs a job on this one machine; ignored",
        f"warning: {script}:2: #SBATCH --partition=gpu: this machine has no partitions; ignored",
        f"warning: {script}:3: #SBATCH --bogus: not an sbatch option; ignored"]
    assert get_job(get_engine(), 1).name == "w"


def test_the_sbatch_console_script(machine, capsys):
    """pyproject.toml's `sbatch` is `submit`: the function it names queues the script; the installed
    script too, where this environment has it (an install of this checkout)."""
    target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["sbatch"]
    module, _, name = target.partition(":")
    entry = getattr(import_module(module), name)
    script = _script(machine / "job.sh", LAB_LINES + LAB_BODY)
    capsys.readouterr()
    assert entry(["--parsable", "-t", "5", script]) == 0
    job_id = int(capsys.readouterr().out)
    assert (get_job(get_engine(), job_id).time_limit_s, get_job(get_engine(), job_id).array_task_id) == (300.0, 0)
    assert entry(["job-that-is-not-there.sh"]) == 2
    assert "no such batch script" in capsys.readouterr().err

    installed = shutil.which("sbatch", path=str(Path(sys.executable).parent))
    if installed and b"scheduler.cli" in Path(installed).read_bytes():
        done = subprocess.run([installed, "--json", script], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and json.loads(done.stdout)["tasks"] == 4, done.stderr


def test_slurms_sbatch_is_never_ours(tmp_path):
    """--cluster slurm hands scripts to SLURM's sbatch: ours, first on PATH, is passed over."""
    from scheduler.cluster import slurm_command

    ours, theirs = tmp_path / "venv", tmp_path / "usr"
    for folder, text in ((ours, "#!/x/python\nfrom scheduler.cli import sbatch_main\n"), (theirs, "\x7fELF")):
        folder.mkdir()
        (folder / "sbatch").write_text(text)
        (folder / "sbatch").chmod(0o755)
    assert slurm_command("sbatch", f"{ours}:{theirs}") == str(theirs / "sbatch")
    assert slurm_command("sbatch", str(ours)) is None


def test_a_script_submit_imports_neither_sqlalchemy_nor_torch(machine):
    get_engine()  # a database at the head revision: the lean path takes the submit
    script = _script(machine / "job.sh", LAB_LINES + "#SBATCH --mem=1G\n" + LAB_BODY)
    code = ("import sys; from scheduler.cli import main; assert main(['submit', '--parsable', 'job.sh']) == 0; "
            "print(sorted(m for m in ('sqlalchemy', 'sqlmodel', 'torch') if m in sys.modules), file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], cwd=machine, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[-1] == "[]", done.stderr
    assert Path(script).exists() and int(done.stdout) == 1


# ---------------------------------------------------------------------------------------------
# A real daemon runs them (slow)
# ---------------------------------------------------------------------------------------------

def _sbatch(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m scheduler submit ARGS` as a process, from `cwd` (the submit directory)."""
    return subprocess.run([sys.executable, "-m", "scheduler", "submit", *args], cwd=cwd,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=60)


def _ended(job_ids, timeout: float = 60) -> dict:
    engine = get_engine()
    wait_for(lambda: all(get_job(engine, j).state not in ("PENDING", "RUNNING") for j in job_ids), timeout,
             f"jobs {job_ids} to end")
    return {j: get_job(engine, j) for j in job_ids}


def _slurm_env(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line.startswith("SLURM_"))


@pytest.mark.slow
def test_a_lab_script_runs_as_four_array_tasks_unchanged(sched, tmp_path, monkeypatch):  # noqa: F811
    work = tmp_path / "lab"
    work.mkdir()
    heads = {"lines": LAB_LINES + "#SBATCH -o out/%A_%a.txt\n", "one line": LAB_ONE_LINE + "#SBATCH -o out/%A_%a.txt\n"}
    arrays = {}
    for label, head in heads.items():
        (work / f"{label}.sh").write_text(head + LAB_BODY)
        done = _sbatch(work, "--json", f"{label}.sh")
        assert done.returncode == 0 and done.stderr == "", done.stderr
        arrays[label] = json.loads(done.stdout)["job_id"]
    for name in ("SLURM_NTASKS", "SLURM_JOBID", "SLURM_PROCID"):  # in the daemon's environment: stripped
        monkeypatch.setenv(name, "7")
    sched.start_daemon()
    for label, array_id in arrays.items():
        tasks = sorted((j for j in list_jobs(get_engine()) if j.array_job_id == array_id),
                       key=lambda j: j.array_task_id)
        assert [t.array_task_id for t in tasks] == [0, 1, 2, 3], label
        ended = _ended([t.id for t in tasks])
        for task in tasks:
            job = ended[task.id]
            assert (job.state, job.kind, job.name, job.gpus, job.time_limit_s) == ("COMPLETED", "batch", "x", 1, 600.0)
            out = work / "out" / f"{array_id}_{task.array_task_id}.txt"
            text = out.read_text()
            assert text.splitlines()[0] == str(task.array_task_id), (label, text)  # the lab's line, unchanged
            # The SLURM names a batch job gets, and no other (stderr went with stdout: sbatch's default)
            assert _slurm_env(text) == {
                "SLURM_ARRAY_JOB_ID": str(array_id), "SLURM_ARRAY_TASK_COUNT": "4",
                "SLURM_ARRAY_TASK_ID": str(task.array_task_id), "SLURM_ARRAY_TASK_MAX": "3",
                "SLURM_ARRAY_TASK_MIN": "0", "SLURM_JOB_ID": str(task.id), "SLURM_JOB_NAME": "x",
                "SLURM_SUBMIT_DIR": str(work)}, (label, text)


@pytest.mark.slow
def test_the_submitted_version_runs_and_the_command_line_wins(sched, tmp_path, monkeypatch):  # noqa: F811
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH -J from-script -o first.out\n#SBATCH --export=ALL,GIVEN=script\n"
                      'echo "version 1 $SLURM_JOB_NAME $GIVEN $*"\n')
    first = _sbatch(tmp_path, "--parsable", "job.sh", "a b", "c")
    overridden = _sbatch(tmp_path, "--parsable", "-J", "from-command-line", "-o", "second.out",
                         "--export", "ALL,GIVEN=command-line", "job.sh")
    # Edited after submit (a shorter file, the same inode): the queued jobs keep what was submitted
    script.write_text('#!/bin/bash\n#SBATCH -o third.out\necho "version 2"\n')
    third = _sbatch(tmp_path, "--parsable", "job.sh")
    bare = tmp_path / "bare.sh"
    bare.write_text('#!/bin/bash\n#SBATCH --export=NONE,ONLY=this -o bare.out\necho "$PATH|${FROM_DAEMON-unset}|'
                    '$ONLY|$SLURM_JOB_ID|$SAE_DIST_JOB_ID|$SAE_DIST_EXPORT|$HOME"\n')
    fourth = _sbatch(tmp_path, "--parsable", "bare.sh")
    ids = [int(r.stdout) for r in (first, overridden, third, fourth)]
    monkeypatch.setenv("FROM_DAEMON", "yes")  # in the daemon's environment: every job's, but a NONE one's
    sched.start_daemon()
    assert {j.state for j in _ended(ids).values()} == {"COMPLETED"}
    assert (tmp_path / "first.out").read_text() == "version 1 from-script script a b c\n"
    assert (tmp_path / "second.out").read_text() == "version 1 from-command-line command-line \n"
    assert (tmp_path / "third.out").read_text() == "version 2\n"
    path, from_daemon, only, slurm_id, our_id, export, home = (tmp_path / "bare.out").read_text().strip().split("|")
    assert (path, from_daemon, only, export) == ("/usr/local/bin:/usr/bin:/bin", "unset", "this", "NONE")
    assert slurm_id == our_id == str(ids[3]) and home == os.environ["HOME"]
    copies = sorted((sched.home / "batch").iterdir())
    assert len(copies) == 3 and not [c for c in copies if re.fullmatch(r"[0-9a-f]{64}", c.name) is None]
