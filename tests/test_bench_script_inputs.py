"""The benchmark scripts' bad options: one line naming the option, a non-zero exit, before any
work (no output directory written)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.parametrize(("script", "args", "said"), [
    ("bench_transcoder.py", ["--passes", "0"], "bench_transcoder: --passes must be 1 or more, got 0"),
    ("sweep_matryoshka.py", ["--parallel", "0"], "sweep_matryoshka: --parallel must be 1 or more, got 0"),
    ("sweep_matryoshka.py", ["--truth", "--truth-steps", "-1"],
     "sweep_matryoshka: --truth-steps must be 1 or more, got -1"),
    ("sweep_matryoshka.py", ["--groups", "budget,nope"], "sweep_matryoshka: unknown group(s) nope"),
    ("bench_quality.py", ["--sets", "h1,u9"], "bench_quality: unknown set(s) u9"),
])
def test_a_bad_option_is_one_line_and_a_failure_before_any_work(tmp_path, script, args, said):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--out", str(out), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode != 0 and done.stderr.strip().startswith(said), done
    assert len(done.stderr.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize(("args", "said"), [
    (["--data", "h2", "--refit", "--window", "0"], "refit_offline: --window must be in (0, 1], got 0.0"),
    (["--data", "h2", "--refit", "--window", "1.5"], "refit_offline: --window must be in (0, 1], got 1.5"),
    (["--data", "h2", "--refit", "--every", "0"], "refit_offline: --every must be 1 or more, got 0"),
    (["--data", "h2", "--encoder-lr=-1e-3"], "refit_offline: --encoder-lr must be above 0, got -0.001"),
    (["--data", "h2"], "refit_offline: nothing to do; ask for --refit, --encoder-lr or both"),
    (["--data", "h2", "--refit"], "refit_offline: {run} has no SAE (sae/cfg.json)"),
])
def test_refit_offline_bad_options_are_one_line_and_a_failure(tmp_path, args, said):
    run = tmp_path / "run"
    run.mkdir()
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "refit_offline.py"), str(run), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode != 0 and done.stderr.strip().startswith(said.format(run=run)), done
    assert len(done.stderr.strip().splitlines()) == 1 and list(run.iterdir()) == []


@pytest.mark.parametrize(("args", "said"), [
    (["--compare-no-inner-offset"], "error: --compare-no-inner-offset needs --arch matryoshka"),
    (["--precision", "fp8"], "error: --precision fp8: choose fp32, bf16 or auto"),
])
def test_bench_step_bad_options_are_one_line_and_exit_2_before_any_timing(args, said):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_step.py"), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == said, done
    assert "workload:" not in done.stdout  # nothing was timed
