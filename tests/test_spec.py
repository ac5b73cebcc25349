"""JobSpec and the submit parsers, on plain data: every good input parses, every bad one is a
UserError whose one line names what was wrong."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from sae_dist.config import build_config
from sae_dist.contract import train_argv
from sae_dist.errors import UserError
from scheduler.spec import (
    JobSpec,
    check_output_pattern,
    expand_output,
    parse_begin,
    parse_dependency,
    parse_env,
    parse_gpu_ids,
    parse_time_limit,
    priority_from_nice,
    resolve_devices,
    safe_name_for_path,
)

REPO = Path(__file__).resolve().parents[1]
NOW = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)  # a Saturday, 14:00 in TZ_PLUS2
TZ_PLUS2 = timezone(timedelta(hours=2))
DEVICES = [(0, "GPU-aaa"), (1, "GPU-bbb"), (2, "GPU-ccc"), (3, "GPU-ddd")]


def one_line_naming(excinfo: pytest.ExceptionInfo, *needles: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)


# --- parse_time_limit ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, seconds", [
    ("30", 1800.0),                    # minutes
    ("90", 5400.0),                    # minutes may exceed 59
    ("5:30", 330.0),                   # minutes:seconds
    ("1:02:03", 3723.0),               # hours:minutes:seconds
    ("2-3", 2 * 86400 + 3 * 3600.0),   # days-hours
    ("2-3:04", 2 * 86400 + 3 * 3600 + 4 * 60.0),
    ("1-0:0:5", 86405.0),
    (" 10 ", 600.0),
    ("UNLIMITED", None), ("unlimited", None), ("infinite", None), ("INFINITE", None),
])
def test_time_limit_good(text, seconds):
    assert parse_time_limit(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "1:2:3:4", "-5", "1-", "1-2:3:4:5", "5:60", "1:60:00",
                                  "1-24", "1.5", "1h", "1-2-3", "²", "0", "0:00", "0-0"])
def test_time_limit_bad(text):
    with pytest.raises(UserError) as e:
        parse_time_limit(text)
    one_line_naming(e, "--time", repr(text))


def test_time_limit_zero_points_to_unlimited():
    with pytest.raises(UserError, match="UNLIMITED"):
        parse_time_limit("0")


# --- parse_dependency ---------------------------------------------------------------------------

def test_dependency_good():
    assert parse_dependency("afterok:1:2,afterany:3") == [("afterok", 1), ("afterok", 2), ("afterany", 3)]
    assert parse_dependency("afternotok:7") == [("afternotok", 7)]
    assert parse_dependency("afterok:1:1, afterok:1") == [("afterok", 1)]  # one condition


@pytest.mark.parametrize("text, needle", [
    ("", "--dependency"), ("afterok", "afterok"), ("afterok:", "afterok"), ("afterok:0", "afterok:0"),
    ("afterok:-1", "afterok:-1"), ("afterok:x", "afterok:x"), ("after:1", "'after'"),
    ("singleton", "'singleton'"), ("afterok:1?afterany:2", "'?'"), ("afterok:1,,afterany:2", "''"),
    ("afterok:1+10", "afterok:1+10"), ("1", "'1'"),
])
def test_dependency_bad(text, needle):
    with pytest.raises(UserError) as e:
        parse_dependency(text)
    one_line_naming(e, "--dependency", needle)


# --- parse_begin --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("now", NOW),
    ("NOW", NOW),
    ("now+30", NOW + timedelta(seconds=30)),
    ("now+10minutes", NOW + timedelta(minutes=10)),
    ("now+1minute", NOW + timedelta(minutes=1)),
    ("now+2hours", NOW + timedelta(hours=2)),
    ("now+1days", NOW + timedelta(days=1)),
    ("now+1weeks", NOW + timedelta(weeks=1)),
    ("now+5seconds", NOW + timedelta(seconds=5)),
    # Clock times are local (UTC+2 here): 15:30 local is still ahead today; 13:00 has passed.
    ("15:30", datetime(2025, 3, 1, 13, 30, tzinfo=UTC)),
    ("15:30:10", datetime(2025, 3, 1, 13, 30, 10, tzinfo=UTC)),
    ("13:00", datetime(2025, 3, 2, 11, 0, tzinfo=UTC)),
    ("14:00", datetime(2025, 3, 2, 12, 0, tzinfo=UTC)),  # exactly now counts as passed
    ("2025-04-01T08:00", datetime(2025, 4, 1, 6, 0, tzinfo=UTC)),
    ("2025-04-01T08:00:30", datetime(2025, 4, 1, 6, 0, 30, tzinfo=UTC)),
    ("2025-04-01", datetime(2025, 3, 31, 22, 0, tzinfo=UTC)),
    ("2025-04-01T08:00Z", datetime(2025, 4, 1, 8, 0, tzinfo=UTC)),       # an offset is kept
    ("2025-04-01T08:00+05:00", datetime(2025, 4, 1, 3, 0, tzinfo=UTC)),
    ("2020-01-01T00:00", datetime(2019, 12, 31, 22, 0, tzinfo=UTC)),     # past: eligible at once
    ("tomorrow", datetime(2025, 3, 1, 22, 0, tzinfo=UTC)),
    ("midnight", datetime(2025, 3, 1, 22, 0, tzinfo=UTC)),
    ("noon", datetime(2025, 3, 2, 10, 0, tzinfo=UTC)),
])
def test_begin_good(text, expected):
    got = parse_begin(text, NOW, tz=TZ_PLUS2)
    assert got == expected and got.tzinfo == UTC


def test_begin_uses_this_machines_zone_by_default():
    got = parse_begin("2025-04-01T08:00", NOW)
    assert got.tzinfo == UTC
    assert got == datetime(2025, 4, 1, 8, 0).astimezone().astimezone(UTC)
    clock = parse_begin("23:59", NOW)
    assert NOW < clock <= NOW + timedelta(days=1)


@pytest.mark.parametrize("text", ["", "soon", "now+", "now-5", "now+5fortnights", "now+x", "nowish",
                                  "25:00", "12:60", "12:00:61", "2025-13-01", "2025-02-30T10:00",
                                  "2025-04-01T08", "01/04/2025", "12", "now + 5"])
def test_begin_bad(text):
    with pytest.raises(UserError) as e:
        parse_begin(text, NOW, tz=TZ_PLUS2)
    one_line_naming(e, "--begin", repr(text))


# --- parse_env, parse_gpu_ids, nice -------------------------------------------------------------

def test_env_good():
    assert parse_env([]) == {}
    assert parse_env(["A=1", "B_2=x=y", "_C=", "A=2"]) == {"A": "2", "B_2": "x=y", "_C": ""}


@pytest.mark.parametrize("item, needle", [
    ("NOEQUALS", "'NOEQUALS'"), ("=x", "''"), ("1A=x", "'1A'"), ("A-B=x", "'A-B'"), ("A B=x", "'A B'"),
    ("SLURM_JOB_ID=3", "SLURM_JOB_ID"), ("CUDA_VISIBLE_DEVICES=0", "CUDA_VISIBLE_DEVICES"),
    ("SAE_DIST_JOB_ID=1", "SAE_DIST_JOB_ID"), ("SAE_DIST_MASTER_PORT=1", "SAE_DIST_MASTER_PORT"),
    ("A=x\0y", "A"),
])
def test_env_bad(item, needle):
    with pytest.raises(UserError) as e:
        parse_env(["OK=1", item])
    one_line_naming(e, "--env", needle)


def test_gpu_ids():
    assert parse_gpu_ids("0,2") == ["0", "2"]
    assert parse_gpu_ids(" 1 ") == ["1"]
    assert parse_gpu_ids("GPU-aaa,3") == ["GPU-aaa", "3"]


@pytest.mark.parametrize("text, needle", [("", "''"), (",", "','"), ("0,,1", "'0,,1'"), ("0,0", "0"),
                                          ("0 1", "'0 1'")])
def test_gpu_ids_bad(text, needle):
    with pytest.raises(UserError) as e:
        parse_gpu_ids(text)
    one_line_naming(e, "--gpu-ids", needle)


def test_priority_from_nice():
    assert priority_from_nice(10) == -10 and priority_from_nice(-5) == 5


# --- JobSpec ------------------------------------------------------------------------------------

def test_spec_defaults(tmp_path):
    spec = JobSpec(argv=["/usr/bin/python3", "-c", "print(1)"], workdir=str(tmp_path))
    assert spec.name == "python3" and spec.kind == "command"
    assert spec.gpus == 1 and spec.gpu_ids is None and spec.priority == 0
    assert spec.dependencies == [] and spec.env == {} and not spec.held and not spec.requeue
    assert JobSpec(argv=["x"]).workdir == str(Path.cwd())  # SLURM's default: where you submit


def test_spec_normalises(tmp_path):
    begin = datetime(2025, 4, 1, 8, 0, tzinfo=TZ_PLUS2)
    spec = JobSpec(argv=["run"], workdir=str(tmp_path), gpu_ids=["0", "2"], time_limit_s=60,
                   begin_at=begin, dependencies=[["afterok", 3], ("afterok", 3)], gpus=None,
                   name="$(rm -rf ~)", env={"A": "1"}, stdout="logs/%x-%5j.out")
    assert spec.gpus == 2
    assert spec.time_limit_s == 60.0 and isinstance(spec.time_limit_s, float)
    assert spec.begin_at == begin and spec.begin_at.tzinfo == UTC
    assert spec.dependencies == [("afterok", 3)]
    assert spec.name == "$(rm -rf ~)"  # stored literally; only paths sanitise it
    assert JobSpec(argv=["cpu-only"], gpus=0, workdir=str(tmp_path)).gpus == 0


@pytest.mark.parametrize("kwargs, needles", [
    (dict(argv=[]), ["empty command"]),
    (dict(argv=[" "]), ["empty command"]),
    (dict(argv=["a", "b\0c"]), ["NUL"]),
    (dict(argv="echo hi"), ["list of strings"]),
    (dict(workdir="/no/such/dir/anywhere"), ["--chdir", "/no/such/dir/anywhere", "does not exist"]),
    (dict(workdir="relative/dir"), ["--chdir", "absolute"]),
    (dict(workdir=__file__), ["--chdir", "not a directory"]),
    (dict(env={"SLURM_NTASKS": "2"}), ["--env", "SLURM_NTASKS"]),
    (dict(env={"BAD-KEY": "1"}), ["--env", "'BAD-KEY'"]),
    (dict(env={"A": 1}), ["--env", "A"]),
    (dict(gpus=-1), ["--gpus", "-1"]),
    (dict(gpus=1.5), ["--gpus", "1.5"]),
    (dict(gpus=True), ["--gpus"]),
    (dict(gpus=3, gpu_ids=["0", "1"]), ["--gpus", "3", "2 devices"]),
    (dict(gpu_ids=["0", "0"]), ["--gpu-ids", "0"]),
    (dict(gpu_ids=[]), ["--gpu-ids"]),
    (dict(gpus=0, mem_per_gpu=2**30), ["--mem-per-gpu"]),
    (dict(mem_per_gpu=0), ["--mem-per-gpu", "0"]),
    (dict(mem_per_gpu="20GiB"), ["--mem-per-gpu", "20GiB"]),
    (dict(time_limit_s=0), ["--time", "0"]),
    (dict(time_limit_s=-5.0), ["--time", "-5.0"]),
    (dict(time_limit_s=float("inf")), ["--time", "UNLIMITED"]),
    (dict(begin_at=datetime(2025, 1, 1)), ["--begin", "timezone-aware"]),
    (dict(dependencies=[("afterok", 0)]), ["--dependency", "0"]),
    (dict(dependencies=[("before", 1)]), ["--dependency", "'before'"]),
    (dict(priority=1.5), ["--priority", "1.5"]),
    (dict(priority=2**40), ["--priority", f"{2**40} is out of range"]),
    (dict(held="yes"), ["--hold"]),
    (dict(name=""), ["--job-name", "empty"]),
    (dict(name="two\nlines"), ["--job-name", "control"]),
    (dict(name="x" * 300), ["--job-name", "300"]),
    (dict(stdout="out-%N.log"), ["--output", "%N"]),
    (dict(stderr="logs/"), ["--error", "directory"]),
    (dict(stdout=""), ["--output", "empty"]),
    (dict(kind="script"), ["kind", "'script'"]),
    (dict(train_config={"steps": 10}), ["--train", "command"]),
])
def test_spec_bad(tmp_path, kwargs, needles):
    kwargs = {"argv": ["echo", "hi"], "workdir": str(tmp_path), **kwargs}
    with pytest.raises(UserError) as e:
        JobSpec(**kwargs)
    one_line_naming(e, *needles)


def test_train_spec(tmp_path):
    spec = JobSpec(kind="train", train_config={"steps": 10, "architecture": "relu"}, workdir=str(tmp_path))
    assert spec.name == "train" and spec.gpus == 1 and spec.argv == []
    assert spec.train_config["architecture"] == "standard"  # normalised by TrainConfig
    assert spec.train_config["k"] == 32  # every field filled
    named = JobSpec(kind="train", train_config={"name": "big-run", "devices": "cpu:2"}, workdir=str(tmp_path))
    assert named.name == "big-run" and named.gpus == 2  # the config's device count is the ask
    flag_wins = JobSpec(kind="train", train_config={"devices": "cuda:2"}, gpus=3, workdir=str(tmp_path))
    assert flag_wins.gpus == 3  # as in `sae_dist train`: flags win over the TOML


@pytest.mark.parametrize("kwargs, needles", [
    (dict(train_config=None), ["--train", "needs a config"]),
    (dict(train_config={"stepz": 10}), ["--train", "stepz", "steps"]),
    (dict(train_config={"steps": 0}), ["--train", "steps"]),
    (dict(train_config={"devices": "tpu:2"}), ["--train", "devices"]),
    (dict(train_config={}, argv=["python"]), ["--train", "no command"]),
    (dict(train_config={}, gpus=0), ["--gpus", "at least 1"]),
])
def test_train_spec_bad(tmp_path, kwargs, needles):
    with pytest.raises(UserError) as e:
        JobSpec(**{"kind": "train", "workdir": str(tmp_path), **kwargs})
    one_line_naming(e, *needles)


# --- resolve_devices ----------------------------------------------------------------------------

def test_resolve_devices(tmp_path):
    def spec(**kw):
        return JobSpec(argv=["x"], workdir=str(tmp_path), **kw)

    assert resolve_devices(spec(gpus=4), DEVICES) is None
    assert resolve_devices(spec(gpus=0), []) is None
    assert resolve_devices(spec(gpu_ids=["2", "0"]), DEVICES) == ["GPU-ccc", "GPU-aaa"]
    assert resolve_devices(spec(gpu_ids=["GPU-ddd", "1"]), DEVICES) == ["GPU-ddd", "GPU-bbb"]


@pytest.mark.parametrize("kwargs, devices, message", [
    (dict(gpus=5), DEVICES, "asked for 5 GPUs, this machine has 4"),
    (dict(gpus=1), [], "asked for 1 GPU, this machine has 0"),
    (dict(gpu_ids=["7"]), DEVICES, "unknown device id 7: this machine has devices 0-3 (see `info`)"),
    (dict(gpu_ids=["GPU-zzz"]), DEVICES, "unknown device id GPU-zzz: this machine has devices 0-3"),
    (dict(gpu_ids=["1"]), [(0, "u0"), (2, "u2"), (3, "u3")], "this machine has devices 0,2-3"),
    (dict(gpu_ids=["0"]), [], "this machine has no devices"),
    (dict(gpu_ids=["0", "GPU-aaa"]), DEVICES, "twice"),
])
def test_resolve_devices_bad(tmp_path, kwargs, devices, message):
    with pytest.raises(UserError) as e:
        resolve_devices(JobSpec(argv=["x"], workdir=str(tmp_path), **kwargs), devices)
    one_line_naming(e, message)


# --- expand_output ------------------------------------------------------------------------------

HOSTILE_NAMES = ["../../x", "..", ".", "...", "", "/", "/etc/passwd", "a/../../b", "$(rm -rf ~)",
                 "`reboot`", "x\0y", "\n..", ".hidden", "~", "x" * 1000, "é" * 200, "\\..\\..", "%j"]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
@pytest.mark.parametrize("pattern", [None, "%x.out", "logs/%x-%j.out", "%x", ".%x", "%x%x", "logs/.%x."])
def test_expand_output_stays_inside(tmp_path, name, pattern):
    log_dir, workdir = tmp_path / "logs-home", tmp_path / "work"
    path = expand_output(pattern, 42, name, log_dir, workdir, default="%x-%j.out")
    if pattern is None:
        home = log_dir
    else:
        home = (workdir / pattern).parent  # the directory the pattern puts the file in
    assert path.resolve().is_relative_to(home.resolve())
    assert path.parent.resolve() == home.resolve()
    assert path.name not in ("", ".", "..")
    assert len(path.name.encode("utf-8", "surrogateescape")) <= 255
    assert "\0" not in str(path) and "\n" not in str(path)


def test_expand_output_substitutions(tmp_path):
    log_dir, workdir = tmp_path / "logs", tmp_path / "work"
    assert expand_output(None, 7, "train", log_dir, workdir, "%x-%j.out") == log_dir / "train-7.out"
    assert expand_output("o-%j.txt", 7, "n", log_dir, workdir, "d") == workdir / "o-7.txt"
    assert expand_output("/abs/%x/%j", 7, "n", log_dir, workdir, "d") == Path("/abs/n/7")
    assert expand_output("%5j-100%%.out", 7, "n", log_dir, workdir, "d") == workdir / "00007-100%.out"
    assert expand_output("%j", 7, "%x", log_dir, workdir, "d") == workdir / "7"
    assert expand_output("%x", 7, "%j", log_dir, workdir, "d") == workdir / "%j"  # no re-expansion
    # An unsupported letter in a stored pattern stays literal rather than failing a job's start.
    assert expand_output("%N-%j%", 7, "n", log_dir, workdir, "d") == workdir / "%N-7%"
    assert expand_output("%x", 7, "../../x", log_dir, workdir, "d") == workdir / "___.._x"


def test_safe_name():
    assert safe_name_for_path("job-1.v2") == "job-1.v2"
    # Never run, but a log file named so could not be typed as it reads: shell characters go.
    assert safe_name_for_path("$(rm -rf ~)") == "__rm_-rf___"
    assert safe_name_for_path("sweep k=4; lr*2 'é'") == "sweep_k=4__lr_2__é_"
    assert safe_name_for_path("..") == "__"


@pytest.mark.parametrize("pattern", ["%j.out", "logs/%x-%j.log", "100%%", "%10j", "/tmp/x", "%A_%a.out", "%4a"])
def test_output_pattern_good(pattern):
    check_output_pattern(pattern)


@pytest.mark.parametrize("pattern", ["%N.out", "%u", "%3x", "end%", "a/..", "a/."])
def test_output_pattern_bad(pattern):
    with pytest.raises(UserError) as e:
        check_output_pattern(pattern, "--output")
    one_line_naming(e, "--output", repr(pattern))


# --- train_argv ---------------------------------------------------------------------------------

def _round_trip(config: dict, devices: str):
    from sae_dist.cli import _parser
    from sae_dist.contract import config_from_args

    argv = train_argv(config, devices)
    return argv, config_from_args(_parser().parse_args(["train", *argv]))


@pytest.mark.parametrize("config", [
    {},
    {"steps": 10, "architecture": "relu", "lr": 1e-5, "resume": True, "out_dir": "/tmp/run",
     "db": False, "auxk_coefficient": 0.0, "name": "-starts-with-dash", "seed": 3, "lr_decay_fraction": 0.2},
    {"source": "shards", "shards_path": "/data/acts with space", "d_in": 64, "d_sae": 128, "k": 8,
     "precision": "bf16", "synthetic_noise": 0.1 + 0.2},
    {"architecture": "jumprelu", "l0_coefficient": 0.003, "jumprelu_bandwidth": 0.05, "devices": "cuda:8"},
])
@pytest.mark.parametrize("devices", ["cpu:2", "cuda:4"])
def test_train_argv_round_trip(config, devices):
    argv, rebuilt = _round_trip(config, devices)
    assert rebuilt == build_config({**config, "devices": devices})
    assert argv[-1] == f"--devices={devices}" and sum(a.startswith("--devices") for a in argv) == 1


def test_train_argv_flags():
    assert train_argv({}, "cpu:1") == ["--devices=cpu:1"]  # defaults need no flag
    argv = train_argv({"steps": 10, "resume": True, "out_dir": "/r", "db": False}, "cuda:2")
    assert argv == ["--steps=10", "--out-dir=/r", "--resume", "--no-db", "--devices=cuda:2"]


@pytest.mark.parametrize("config, devices, needle", [
    ({"steps": -1}, "cpu:1", "steps"), ({}, "tpu:1", "devices"), ({"nope": 1}, "cpu:1", "nope"),
])
def test_train_argv_bad(config, devices, needle):
    with pytest.raises(UserError) as e:
        train_argv(config, devices)
    one_line_naming(e, "--train", needle)


# --- import cost --------------------------------------------------------------------------------

def test_import_is_light():
    code = ("import sys, scheduler.spec; heavy = [m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'streamlit', 'altair', 'sqlmodel', 'sqlalchemy', 'sae_dist.db')]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_shared_needs_its_memory_and_is_never_exclusive(tmp_path):
    from scheduler.spec import JobSpec, check_memory_fits

    ok = JobSpec(argv=["true"], shared=True, mem_per_gpu=12 << 30, workdir=str(tmp_path))
    assert ok.shared and ok.mem_per_gpu == 12 << 30
    for kw, says in (({"exclusive": True, "mem_per_gpu": 1 << 30}, "--shared: and --exclusive contradict"),
                     ({}, "--shared: needs --mem"),
                     ({"gpus": 0}, "--shared: shares a GPU")):
        with pytest.raises(UserError, match=says):
            JobSpec(argv=["true"], shared=True, workdir=str(tmp_path), **kw)
    with pytest.raises(UserError, match=r"--mem: 100.0 GiB is more than any device here has \(the largest: 80.0 GiB\)"):
        check_memory_fits(JobSpec(argv=["true"], mem_per_gpu=100 << 30, workdir=str(tmp_path)), [80 << 30, None])
    check_memory_fits(ok, [None, None])  # nothing known: nothing refused
