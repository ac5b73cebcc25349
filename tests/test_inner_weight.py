"""Matryoshka's inner weight over the run (--matryoshka-inner-weight-start, --matryoshka-inner-weight-until):
held high, then falling to the configured weight. The schedule, its defaults and how they are said,
a sweep's names, a real run that trains otherwise and resumes exactly, a checkpoint of a constant
weight, and the bad inputs."""

from __future__ import annotations

import math

import pytest

from conftest import SMALL_MATRYOSHKA, main_here, run_cli
from conftest import final_checkpoint_weights as final_weights
from conftest import same_weights as same
from sae_dist.config import ConfigError, TrainConfig
from sae_dist.contract.sweep import parse_sweep_flags, point_name
from sae_dist.defaults import describe_resolved
from sae_dist.train.checkpoint import latest_checkpoint
from sae_dist.train.inner_weight import inner_weight_at


def test_held_at_the_start_then_linear_to_the_weight_by_until():
    at = [inner_weight_at(step, 100, 1.0, 8.0, 0.6) for step in (1, 20, 30, 40, 45, 50, 60, 61, 100)]
    assert at[:3] == [8.0, 8.0, 8.0]  # held for the first half of 0.6
    assert at[3:6] == pytest.approx([8 - 7 / 3, 8 - 7 / 2, 8 - 7 * 2 / 3])
    assert at[6:] == [1.0, 1.0, 1.0]
    assert [inner_weight_at(s, 10, 2.0, 2.0, 0.6) for s in range(1, 11)] == [2.0] * 10  # start == weight: none
    assert inner_weight_at(5, 10, 4.0, 1.0, 1.0) == 1.0 and inner_weight_at(10, 10, 4.0, 1.0, 1.0) == 4.0  # it may rise


def schedule(**settings) -> tuple[float, float, float]:
    return TrainConfig(d_in=64, **settings).resolved_matryoshka_inner_weight


def test_on_by_default_with_the_inner_offset_and_said_so():
    assert schedule(architecture="matryoshka") == (1.0, 8.0, 0.6)
    assert schedule(architecture="matryoshka", matryoshka_inner_weight=16) == (16.0, 16.0, 0.6)  # never rises
    assert schedule(architecture="matryoshka", matryoshka_inner_weight=2) == (2.0, 8.0, 0.6)
    # measured with the offset only: without it (or with batch selection, which has none) no schedule
    assert schedule(architecture="matryoshka", matryoshka_inner_offset=False) == (1.0, 1.0, 0.6)
    assert schedule(architecture="matryoshka", matryoshka_selection="batch") == (1.0, 1.0, 0.6)
    assert schedule(architecture="matryoshka", matryoshka_inner_weight_start=4,
                    matryoshka_inner_weight_until=0.5) == (1.0, 4.0, 0.5)
    given = TrainConfig(d_in=64, architecture="matryoshka")
    resolved = given.resolved(1)
    assert (resolved.matryoshka_inner_weight_start, resolved.matryoshka_inner_weight_until) == (8.0, 0.6)
    assert "inner weight 8 falling to 1 by 60% of the steps (default)" in describe_resolved(given, resolved)
    mine = TrainConfig(d_in=64, architecture="matryoshka", matryoshka_inner_weight_start=3)
    assert "inner weight 3 falling to 1 by 60% of the steps," in describe_resolved(mine, mine.resolved(1))
    constant = TrainConfig(d_in=64, architecture="matryoshka", matryoshka_inner_weight_start=1)
    assert "inner weight" not in describe_resolved(constant, constant.resolved(1))
    topk = TrainConfig(d_in=64).resolved(1)
    assert topk.matryoshka_inner_weight_start is None and topk.matryoshka_inner_weight_until is None


def test_a_sweep_names_its_points_by_them():
    assert parse_sweep_flags(["matryoshka_inner_weight_start=1,8"]) == {"matryoshka_inner_weight_start": [1.0, 8.0]}
    assert point_name({"matryoshka_inner_weight_start": 8.0, "matryoshka_inner_weight_until": 0.3}) == "iws8-iwu0.3"


@pytest.mark.parametrize("settings,said", [
    ({"matryoshka_inner_weight_start": -1.0}, "matryoshka_inner_weight_start: must be 0 or more, got -1.0"),
    ({"matryoshka_inner_weight_start": math.nan}, "matryoshka_inner_weight_start: must be 0 or more, got nan"),
    ({"matryoshka_inner_weight_start": math.inf}, "matryoshka_inner_weight_start: must be 0 or more, got inf"),
    ({"matryoshka_inner_weight_until": 0.0}, "matryoshka_inner_weight_until: must be above 0 and at most 1"),
    ({"matryoshka_inner_weight_until": 1.5}, "matryoshka_inner_weight_until: must be above 0 and at most 1"),
    ({"matryoshka_inner_weight_until": math.nan}, "matryoshka_inner_weight_until: must be above 0 and at most 1"),
])
def test_a_bad_value_is_a_config_error_naming_it(settings, said):
    with pytest.raises(ConfigError, match=said.replace("(", r"\(")):
        TrainConfig(architecture="matryoshka", **settings)


@pytest.mark.parametrize("flag", ["--matryoshka-inner-weight-start", "--matryoshka-inner-weight-until"])
def test_given_for_topk_on_the_command_line_is_one_line_and_exit_2(tmp_path, flag):
    done = main_here("train", flag, "0.5", "--no-db", "--out-dir", str(tmp_path / "run"))
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    name = flag.removeprefix("--").replace("-", "_")
    assert len(lines) == 1 and name in lines[0] and "add --architecture matryoshka" in lines[0], done.stderr
    assert not (tmp_path / "run").exists()


def test_a_bad_value_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    done = main_here("train", *SMALL_MATRYOSHKA, "--matryoshka-inner-weight-until", "2", "--no-db",
                     "--out-dir", str(tmp_path / "run"))
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "matryoshka_inner_weight_until" in lines[0], done.stderr
    assert not (tmp_path / "run").exists()


def trained(tmp_path, name: str, *args: str) -> str:
    done = main_here("train", *SMALL_MATRYOSHKA, *args, "--out-dir", str(tmp_path / name))
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def stopped_at_6_of_12(tmp_path, name: str, *args: str) -> None:
    """A 12-step run SIGTERMed after its step 6 (its checkpoint there), in its own process."""
    stopped = run_cli("train", *SMALL_MATRYOSHKA, "--no-db", "--steps", "12", *args, "--out-dir", str(tmp_path / name),
                      env={"SAE_DIST_TEST_TERM_RANK_AT": "0:6"})
    assert stopped.returncode != 0 and latest_checkpoint(tmp_path / name).name == "step_00000006", stopped.stderr


# SMALL_MATRYOSHKA holds the weight constant (start 1); these runs ask for the default's start again.
SCHEDULED = ("--matryoshka-inner-weight-start", "8")


@pytest.mark.slow  # four short trainings here, two more in their own processes
def test_a_run_on_the_schedule_trains_otherwise_and_resumes_exactly_and_a_constant_one_stays_constant(tmp_path):
    out = trained(tmp_path, "straight", "--steps", "12", *SCHEDULED)
    assert "inner weight 8 falling to 1 by 60% of the steps" in out
    trained(tmp_path, "constant", "--steps", "12")
    stopped_at_6_of_12(tmp_path, "split", *SCHEDULED)  # stopped while the weight falls (steps 4 to 7)
    assert "resumed from" in trained(tmp_path, "split", "--steps", "12", *SCHEDULED, "--resume")
    straight, split, constant = (final_weights(tmp_path / n) for n in ("straight", "split", "constant"))
    assert same(split, straight)
    assert (straight["W_dec"] - constant["W_dec"]).norm() > 1e-3 * constant["W_dec"].norm()  # it took effect
    # A run at a constant weight (every run before the schedule) resumed asking for one goes on constant.
    stopped_at_6_of_12(tmp_path, "old")
    out = trained(tmp_path, "old", "--steps", "12", *SCHEDULED, "--resume")
    assert "the checkpoint was trained at a constant inner weight; the run goes on at 1" in out
    assert same(final_weights(tmp_path / "old"), constant)
