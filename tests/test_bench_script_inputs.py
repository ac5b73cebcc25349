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
])
def test_a_bad_option_is_one_line_and_a_failure_before_any_work(tmp_path, script, args, said):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--out", str(out), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode != 0 and done.stderr.strip().startswith(said), done
    assert len(done.stderr.strip().splitlines()) == 1 and not out.exists()
