"""The contract between the scheduler and the trainer, in one torch-free place.

A job reaches its ranks through two channels only: the `python -m sae_dist train` flags that
rebuild its `TrainConfig` (written by `train_argv`, read by `add_config_flags` and
`config_from_args`, all below), and the environment variables named here. The scheduler writes
both, the launcher and the trainer read them; neither side spells a name on its own.
A sweep is part of what a job describes: `sweep` (many SAEs from one stream, defined and checked)
and `sweep_argv` (how a queued sweep travels as flags) live beside this module. Torch-free, and
imports only config and errors: the scheduler and the app read it.
See docs/architecture.md ("The scheduler-trainer contract").
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sae_dist.errors import ConfigError, UserError

if TYPE_CHECKING:
    from sae_dist.config import TrainConfig
    from sae_dist.contract.sweep import Sweep

# sae_dist.config is imported inside the functions below: every `python -m scheduler` command
# reads a name from here, and only submit needs the config code (~30 ms).

# ---- the job's environment (written by scheduler/supervisor.py, read by the launcher and ranks) ----
JOB_ID_ENV = "SAE_DIST_JOB_ID"  # the scheduler's job id; a run records it
JOB_NAME_ENV = "SAE_DIST_JOB_NAME"
NUM_GPUS_ENV = "SAE_DIST_NUM_GPUS"  # how many devices the job was given
DEVICES_ENV = "SAE_DIST_DEVICES"  # the scheduler's device ids of the job, one per local rank
VIRTUAL_DEVICES_ENV = "SAE_DIST_VIRTUAL_DEVICES"  # set when the job's devices are CPU-backed
MASTER_PORT_ENV = "SAE_DIST_MASTER_PORT"  # the rendezvous port reserved for the job
ARRAY_JOB_ID_ENV = "SAE_DIST_ARRAY_JOB_ID"  # a task of a job array: the array's id
ARRAY_TASK_ID_ENV = "SAE_DIST_ARRAY_TASK_ID"  # ... and its task id (also as SLURM's SLURM_ARRAY_*)
# "<state directory's key>:<job id>" in every process of a job: the daemon finds a job's processes
# by it where no cgroup holds them (scheduler/proctrack.py)
JOB_MARK_ENV = "SAE_DIST_JOB_MARK"

# ---- set by our launcher for its ranks ----
OUR_LAUNCHER_ENV = "SAE_DIST_OUR_LAUNCHER"  # the ranks run under sae_dist.train.launch, not a bare torchrun
FORKED_RANK_ENV = "SAE_DIST_FORKED_RANK"  # a CPU rank forked by our launcher (sae_dist/cli/forked_rank.py)
RESTART_NOTE_ENV = "SAE_DIST_RESTART_NOTE"  # JSON: why the launcher restarted without a device
DEVICE_TYPE_ENV = "SAE_DIST_DEVICE_TYPE"  # "cpu" forces CPU ranks (an sbatch script on CPU nodes)
THREADS_PER_RANK_ENV = "SAE_DIST_THREADS_PER_RANK"  # torch threads of each CPU rank
# A rank our launcher forked keeps the launcher's /proc environ (no LOCAL_RANK there), so it names
# itself (its comm, 15 bytes at most) for the scheduler to count it on its own device.
RANK_PROCESS_NAME = "sae-rank-{local_rank}"

# ---- test and benchmark knobs ----
SLOW_RANKS_ENV = "SAE_DIST_TEST_SLOW_RANKS"  # "1:3" makes rank 1's compute 3x slower (virtual devices)
# Test-only, a stand-in for a device that dies mid-run: "2:15" makes rank 2 SIGKILL itself right
# after step 15. Name the last rank: a run restarted without it has no such rank, so it fires once.
KILL_RANK_AT_ENV = "SAE_DIST_TEST_KILL_RANK_AT"
# Test-only, a stand-in for a preemption reaching one rank: "0:5" makes rank 0 SIGTERM itself after
# step 5 (the others learn of it at the next report, and all stop there, checkpointed).
TERM_RANK_AT_ENV = "SAE_DIST_TEST_TERM_RANK_AT"
# Test-only, a run that cannot end before it is stopped: "0:4" makes rank 0 wait after step 4
# until a signal reaches it (a preemption test then needs no race with the run's end).
PAUSE_RANK_AT_ENV = "SAE_DIST_TEST_PAUSE_RANK_AT"
# Test-only: "0.1" scales a benchmark's fixed waits (the quiet measured before each point, the
# ceiling's processes' common start) by 0.1: the tests check what is recorded, not its quality.
BENCH_WAIT_SCALE_ENV = "SAE_DIST_TEST_BENCH_WAIT_SCALE"


def device_channels(devices: Sequence[str], kind: str) -> tuple[dict[str, str], str]:
    """A job's devices (the scheduler's ids, in rank order) as every channel that carries them:
    CUDA_VISIBLE_DEVICES (GPUs by uuid; none for CPU ranks), SAE_DIST_DEVICES and
    SAE_DIST_NUM_GPUS, and the trainer's --devices value ("cuda:2"). The scheduler starting a job
    and the launcher restarting one on fewer devices both derive them here, so they agree."""
    env = {"CUDA_VISIBLE_DEVICES": ",".join(devices) if kind == "cuda" else "",
           DEVICES_ENV: ",".join(devices), NUM_GPUS_ENV: str(len(devices))}
    return env, f"{kind}:{max(1, len(devices))}"


def rank_values(name: str, raw: str, convert: Callable[[str], float], least: float, example: str) -> dict[int, Any]:
    """A knob's "rank:value" pairs, comma-separated ("1:3,2:2"), as {rank: value}; {} when blank.
    Every mistake (no colon, a rank below 0, a value `convert` refuses or below `least`) is one
    UserError in one format: the knob, what it was given, and `example` ("2:15 (rank 2 ...)")."""
    values = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        rank_text, _, value_text = item.partition(":")
        try:
            rank, value = int(rank_text), convert(value_text)
        except ValueError:
            rank, value = -1, least
        if rank < 0 or not value >= least:  # `not >=`: NaN is refused too
            raise UserError(f"{name}={raw!r}: give rank:value pairs such as {example}")
        values[rank] = value
    return values

# Names a user's --env may not set: the supervisor sets them for every job, and a user's value would
# break device isolation or the port reservation (two jobs on one rendezvous port).
RESERVED_JOB_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", JOB_ID_ENV, JOB_NAME_ENV,
                              NUM_GPUS_ENV, DEVICES_ENV, VIRTUAL_DEVICES_ENV, MASTER_PORT_ENV,
                              ARRAY_JOB_ID_ENV, ARRAY_TASK_ID_ENV, JOB_MARK_ENV})


# ---- the job's flags: TrainConfig -> `python -m sae_dist train` flags -> TrainConfig ----
# Both directions sit here, beside each other, so that a new config field cannot reach one side
# only (tests/test_contract.py round-trips every field through the real parser).

TRAIN_FLAG = "--train"  # submit's flag for a training job: a mistake in its config names it


def add_config_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per config field, with the field's help; unset flags leave the TOML/default alone."""
    from sae_dist.config import config_fields, field_types

    parser.add_argument("--config", help="TOML file with the same keys as the flags (flags win)")
    types = field_types()
    for f in config_fields():
        if f.name in skip:
            continue
        flag = _flag(f.name)
        help_text = f.metadata.get("help", "") + (f" (default: {f.default})" if f.default is not None else "")
        help_text = help_text.replace("%", "%%")  # argparse %-formats help ("5% of the steps")
        annotation = types[f.name]
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        base = args[0] if args and typing.get_origin(annotation) is not typing.Literal else annotation
        if base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=help_text)
        else:
            convert = {int: int, float: float}.get(base, str)
            parser.add_argument(flag, type=convert, default=argparse.SUPPRESS, help=help_text,
                                metavar=f.name.upper())


def add_sweep_flag(parser: argparse.ArgumentParser) -> None:
    """`--sweep KEY=V1,V2`, repeatable: train (and estimate) many SAEs in one job (sae_dist/contract/sweep.py)."""
    parser.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                        help="train one SAE per value (repeat for a grid: their cartesian product), all "
                             "from one data stream in this job, e.g. --sweep k=16,32 --sweep expansion_factor=8,16; "
                             "a run TOML's [sweep] table does the same")
    parser.add_argument("--sweep-points", default=None, metavar="JSON",
                        help="an explicit list of SAEs instead of a grid, as JSON: '[{\"k\": 16}, {\"k\": 32, "
                             "\"lr\": 0.001}]' (a run TOML's [[sweep.points]] tables; how a queued job passes them)")


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    """The config the flags (over the --config TOML, over the defaults) describe, validated; a
    sweep's base config (its SAEs' shared settings) when the run is a sweep."""
    from sae_dist.config import build_config

    return build_config(_given_values(ns)[0])


def sweep_from_args(ns: argparse.Namespace) -> Sweep | None:
    """The sweep the --sweep flags and the TOML's [sweep] table describe (None: one SAE)."""
    from sae_dist.contract.sweep import build_sweep, parse_sweep_flags

    values, table = _given_values(ns)
    if getattr(ns, "sweep_points", None) is not None:
        table = _points_table(ns.sweep_points, table)
    return build_sweep(values, table, parse_sweep_flags(getattr(ns, "sweep", None) or []))


def _points_table(text: str, table: Any) -> dict[str, Any]:
    """`--sweep-points JSON` (how a queued job passes [[sweep.points]]: sae_dist/contract/sweep_argv.py) as
    the [sweep] table it stands for; one error for text that is no JSON, or a TOML [sweep] too."""
    import json

    from sae_dist.contract.sweep import SweepError

    if table is not None:
        raise SweepError("--sweep-points and the TOML's [sweep] table both given; give the sweep once")
    try:
        return {"points": json.loads(text)}
    except ValueError as e:
        raise SweepError(f"--sweep-points: not JSON ({e}); give a list of tables, e.g. "
                         '\'[{"k": 16}, {"k": 32, "lr": 0.001}]\'') from None


def _given_values(ns: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """(the settings given: TOML under flags, no defaults; the TOML's [sweep] table or None)."""
    from sae_dist.config import config_fields, load_toml
    from sae_dist.contract.sweep import split_sweep

    loaded: dict[str, Any] = load_toml(ns.config) if getattr(ns, "config", None) else {}
    values, table = split_sweep(loaded)
    names = {f.name for f in config_fields()}
    values.update({k: v for k, v in vars(ns).items() if k in names})
    return values, table


def checked_train_config(config: TrainConfig | Mapping[str, Any]) -> TrainConfig:
    """A TrainConfig as it is (valid by construction), or a dict of settings checked by the
    trainer's own validation; a mistake is one UserError naming --train."""
    from sae_dist.config import TrainConfig, build_config

    if isinstance(config, TrainConfig):
        return config
    try:
        return build_config(dict(config))
    except ConfigError as e:
        raise UserError(f"{TRAIN_FLAG}: {e}") from None


def train_argv(config: TrainConfig | Mapping[str, Any], devices_flag: str) -> list[str]:
    """The `python -m sae_dist train` flags that rebuild this config on `devices_flag` ("cuda:2").

    A dict is validated first (checked_train_config). One `--flag=value` per field that differs
    from its default (the '=' form keeps a value that starts with '-' from reading as a flag);
    booleans as --x / --no-x; --devices last. The config's own `devices` is replaced: a job runs
    on what the scheduler allocated.
    """
    _check_devices_flag(devices_flag)
    return _flags(checked_train_config(config).to_dict(), devices_flag)


def stored_train_argv(stored: Mapping[str, Any], devices_flag: str) -> list[str]:
    """train_argv of a queued job's config: the dict submit validated and stored, so it is not
    validated again. A field it lacks (queued before the field existed) keeps its default."""
    _check_devices_flag(devices_flag)
    return _flags(stored, devices_flag)


def _check_devices_flag(devices_flag: str) -> None:
    from sae_dist.config import parse_devices

    try:
        parse_devices(devices_flag)
    except ConfigError as e:
        raise UserError(f"{TRAIN_FLAG}: {e}") from None


def _flags(values: Mapping[str, Any], devices_flag: str) -> list[str]:
    from sae_dist.config import config_fields

    fields = config_fields()
    unknown = sorted(set(values) - {f.name for f in fields})
    if unknown:  # a stored config from a version with other fields: never drop a setting silently
        raise UserError(f"{TRAIN_FLAG}: {unknown[0]}: unknown setting")
    flags: list[str] = []
    for f in fields:
        value = values.get(f.name, f.default)
        if f.name == "devices" or value == f.default:
            continue
        if isinstance(value, bool):
            flags.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif value is None:
            # No flag spells None; every optional field defaults to None, so this is a new field.
            raise UserError(f"{TRAIN_FLAG}: {f.name} cannot be unset from the command line")
        else:
            flags.append(f"{_flag(f.name)}={value!r}" if isinstance(value, float) else f"{_flag(f.name)}={value}")
    return [*flags, f"--devices={devices_flag}"]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
