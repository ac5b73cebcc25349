"""The scheduler-trainer contract (sae_dist.contract) on plain data: a config written as trainer
flags by the scheduler and read back by the trainer's own parser is the same config; the stored
config is trusted (validated once, at submit); the job's environment names; the import cost."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sae_dist.cli import _parser
from sae_dist.config import TrainConfig, config_fields
from sae_dist.contract import (
    ARRAY_JOB_ID_ENV,
    JOB_ID_ENV,
    MASTER_PORT_ENV,
    RESERVED_JOB_ENV,
    THREADS_PER_RANK_ENV,
    config_from_args,
    stored_train_argv,
    train_argv,
)
from sae_dist.errors import UserError

REPO = Path(__file__).resolve().parents[1]

# Every field away from its default, spread over the three sources (each source's paths are only
# valid with it); floats that print long, booleans flipped, strings that start with '-'.
SYNTHETIC_EVERYTHING = TrainConfig(
    architecture="jumprelu", d_in=48, d_sae=96, expansion_factor=3, k=5, l1_coefficient=0.1,
    l0_coefficient=1e-5, jumprelu_init_threshold=0.002, jumprelu_bandwidth=0.1 + 0.2, auxk_coefficient=0.0,
    auxk_k=7, dead_after_samples=1000, model_layer=2, model_site="mlp_out", context_length=64,
    synthetic_features=100, synthetic_active=2.5, synthetic_power_law=0.0, synthetic_noise=1e-5, seed=7,
    synthetic_children=3, synthetic_child_prob=0.25, synthetic_magnitude_sigma=0.5, synthetic_correlation=0.3,
    batch_size=512, lr=1e-5, lr_warmup_steps=0, lr_decay_fraction=1.0, steps=10, precision="bf16",
    grad_accum=2, ddp_bucket_mb=12.5, ddp_compress="bf16", balance="speed", rebalance=False,
    on_rank_loss="fail", devices="cpu:3", name="-starts-with-dash", out_dir="-/a dir", log_every=1,
    checkpoint_every=0, keep_checkpoints=5, eval_rows=0, resume=True, db=False)
SHARDS = TrainConfig(source="shards", shards_path="-shards dir/x", lr=0.1, architecture="matryoshka",
                     matryoshka_widths="256,1024,4096", matryoshka_selection="batch", matryoshka_inner_weight=0.5,
                     matryoshka_inner_weight_start=4.0, matryoshka_inner_weight_until=0.5,
                     matryoshka_inner_offset=False,
                     refit_fraction=0.2, rare_bias_floor=0.3 + 0.1, rare_bias_step=1 / 3, rare_bias_until=0.75,
                     decoder_lr_factor=1 / 3, ddp_compress="fp16",
                     balance="memory", name="--looks-like-a-flag")
MODEL = TrainConfig(source="model", model_path="--model", text_path="-text.txt", model_site="attn_out",
                    precision="fp32", lr=1 / 3, architecture="standard", transcode="mlp_in:mlp_out", skip=True)
CONFIGS = [TrainConfig(), SYNTHETIC_EVERYTHING, SHARDS, MODEL,
           TrainConfig(resume=True, out_dir="/r", db=True, rebalance=True)]  # booleans at their defaults


def _read_back(argv: list[str]) -> TrainConfig:
    """What `python -m sae_dist train ARGV` builds: the trainer's real parser, then config_from_args."""
    return config_from_args(_parser().parse_args(["train", *argv]))


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("devices", ["cpu:2", "cuda:4"])
def test_config_survives_the_flags(config, devices):
    argv = train_argv(config, devices)
    assert _read_back(argv) == dataclasses.replace(config, devices=devices)
    assert argv[-1] == f"--devices={devices}"
    # The same flags from the dict submit stores, and from that dict trusted as stored.
    assert train_argv(config.to_dict(), devices) == argv
    assert stored_train_argv(config.to_dict(), devices) == argv


@pytest.mark.parametrize("command", ["train", "estimate-memory", "bench"])
def test_every_flag_has_printable_help(command, capsys):
    """--help renders every field's help (a '%' in one, "5% of the steps", made argparse raise)."""
    with pytest.raises(SystemExit) as e:
        _parser().parse_args([command, "--help"])
    text = capsys.readouterr().out
    assert e.value.code == 0 and "5% of" in text and "%%" not in text
    skipped = {"devices", "steps", "name"} if command == "bench" else set()  # bench has flags of its own
    assert all(f"--{f.name.replace('_', '-')}" in text for f in config_fields() if f.name not in skipped)


def test_every_field_is_round_tripped():
    """A new config field must join a config above: the round trip then covers it."""
    changed = {f.name for f in config_fields() for c in CONFIGS if getattr(c, f.name) != f.default}
    assert changed == {f.name for f in config_fields()}


def test_stored_config_is_trusted():
    # A job queued before a field existed lacks it: the field keeps its default (no flag).
    assert stored_train_argv({"steps": 10}, "cpu:1") == ["--steps=10", "--devices=cpu:1"]
    # Nothing re-validates it (submit did): the value reaches the trainer, whose parser reports it.
    assert stored_train_argv({"steps": -1}, "cpu:1") == ["--steps=-1", "--devices=cpu:1"]
    for bad, needle in (({"nope": 1}, "nope"), ({"steps": None}, "steps")):
        with pytest.raises(UserError) as e:
            stored_train_argv(bad, "cpu:1")
        assert str(e.value).startswith("--train: ") and needle in str(e.value)
    with pytest.raises(UserError, match="^--train: devices"):
        stored_train_argv({}, "tpu:1")


def test_submit_validates_once_and_the_supervisor_never(monkeypatch, tmp_path):
    """`submit --train` builds the TrainConfig once; the supervisor turns the stored dict into
    flags without building it again."""
    from sae_dist.db import get_engine
    from scheduler.cli import main
    from scheduler.store import get_job
    from scheduler.supervisor import job_argv

    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "2")
    validations = []
    original = TrainConfig.validate
    monkeypatch.setattr(TrainConfig, "validate", lambda self: (validations.append(1), original(self))[1])
    toml = tmp_path / "run.toml"
    toml.write_text('steps = 5\nlr = 1e-5\nname = "-dash"\n')
    assert main(["submit", "--gpus", "2", "-D", str(tmp_path), "--train", str(toml)]) == 0
    assert len(validations) == 1
    job = get_job(get_engine(), 1)
    argv = job_argv(job, ["virtual-0", "virtual-1"])
    assert len(validations) == 1
    assert argv[:4] == [sys.executable, "-m", "sae_dist", "train"]
    assert _read_back(argv[4:]) == TrainConfig(steps=5, lr=1e-5, name="-dash", devices="cpu:2")


def test_submit_json(monkeypatch, tmp_path, capsys):
    """`submit --json` prints one JSON object: the job's id and its state (what bench reads)."""
    from sae_dist.db import get_engine
    from scheduler.cli import main
    from scheduler.store import get_job

    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "2")
    for extra in ([], ["--hold"]):
        assert main(["submit", "--json", *extra, "-D", str(tmp_path), "--", "true"]) == 0
        out = capsys.readouterr().out
        assert out.count("\n") == 1
        said = json.loads(out)
        assert set(said) == {"job_id", "state"} and isinstance(said["job_id"], int)
        assert said["state"] == get_job(get_engine(), said["job_id"]).state == "PENDING"
    assert main(["submit", "-D", str(tmp_path), "--", "true"]) == 0
    assert capsys.readouterr().out == "Submitted batch job 3\n"  # without --json: SLURM's line


def test_supervisor_sets_every_reserved_name():
    """The names a user's --env may not set are exactly those the supervisor sets for a job."""
    from scheduler.supervisor import job_environment

    task = SimpleNamespace(id=7, name="j", kind="command", port=29601, env_json="{}", array_job_id=5, array_task_id=2,
                           snapshot_dir=None)
    env = job_environment(task, ["GPU-a", "GPU-b"], {"SLURM_JOB_ID": "1", "PATH": "/bin"}, array_tasks=(3, 0, 2))
    slurm_array = {"SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN",
                   "SLURM_ARRAY_TASK_MAX"}  # SLURM's own names, for scripts written for SLURM
    assert RESERVED_JOB_ENV <= set(env) and set(env) - RESERVED_JOB_ENV == {"PATH"} | slurm_array
    assert (env[JOB_ID_ENV], env[MASTER_PORT_ENV]) == ("7", "29601")
    assert (env[ARRAY_JOB_ID_ENV], env["SLURM_ARRAY_TASK_ID"], env["SLURM_ARRAY_TASK_COUNT"]) == ("5", "2", "3")
    plain = job_environment(SimpleNamespace(id=8, name="j", kind="command", port=None, env_json="{}", array_job_id=None,
                                            array_task_id=None, snapshot_dir=None), ["GPU-a"], {"SLURM_JOB_ID": "1"})
    assert not {k for k in plain if "ARRAY" in k}  # a plain job: no array names at all


def test_import_is_light():
    """The scheduler's submit path imports the contract: it and its flag writer stay torch-free."""
    code = ("import sys, sae_dist.contract as c; c.train_argv({'steps': 3}, 'cpu:1'); "
            "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'streamlit', 'altair', 'scheduler')])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_a_rank_knob_reads_pairs_and_refuses_in_one_format():
    from sae_dist.contract import rank_values
    from sae_dist.errors import UserError

    assert rank_values("K", "", float, 1.0, "1:3") == {}
    assert rank_values("K", " 1:3, 0:1.5 ,", float, 1.0, "1:3") == {1: 3.0, 0: 1.5}
    assert rank_values("K", "2:15", int, 1, "2:15") == {2: 15}
    for raw, convert, least in [("2", int, 1), ("2:six", int, 1), ("two:6", int, 1), ("2:0", int, 1),
                                ("-1:3", float, 1.0), ("1:0.5", float, 1.0), ("1:nan", float, 1.0)]:
        with pytest.raises(UserError) as refused:
            rank_values("K", raw, convert, least, "1:3 (rank 1 ...)")
        assert str(refused.value) == f"K={raw!r}: give rank:value pairs such as 1:3 (rank 1 ...)"


def test_a_virtual_device_rank_gets_its_share_of_the_cores(monkeypatch):
    """Jobs on virtual devices share the machine: each rank gets cores / devices torch threads, never
    the whole machine (two jobs would oversubscribe it); the operator's own setting wins."""
    from scheduler.devices import usable_cores, virtual_device_threads
    from scheduler.supervisor import job_environment

    assert [virtual_device_threads(16, n) for n in (1, 2, 3, 16, 32)] == [16, 8, 5, 1, 1]
    assert virtual_device_threads(2, 0) == 2
    job = SimpleNamespace(id=9, name="j", kind="command", port=None, env_json="{}", array_job_id=None,
                          array_task_id=None, snapshot_dir=None)
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "2")  # the daemon offers 2 virtual devices
    env = job_environment(job, ["virtual-0"], {})
    assert env[THREADS_PER_RANK_ENV] == str(max(1, usable_cores() // 2))
    mine = job_environment(job, ["virtual-0"], {THREADS_PER_RANK_ENV: "3"})
    assert mine[THREADS_PER_RANK_ENV] == "3"
    assert THREADS_PER_RANK_ENV not in job_environment(job, ["GPU-a"], {})  # a GPU's rank: torch's default
