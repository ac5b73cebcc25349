"""The watch on one test's time names a test that takes too long, and fails it only when asked to."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

SLEEPER = "import time\n\ndef test_quick():\n    pass\n\ndef test_sleeps():\n    time.sleep(0.6)\n"
SLOW_SETUP = ("import time, pytest\n\n@pytest.fixture\ndef slow():\n    time.sleep(0.6)\n\n"
              "def test_slow_fixture(slow):\n    pass\n")


def run_sleeper(tmp_path, strict: bool, workers: bool = False) -> subprocess.CompletedProcess:
    (tmp_path / "test_sleeper.py").write_text(SLEEPER)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "tests"), "SAE_DIST_TEST_TIME_LIMIT_S": "0.3",
           **({"SAE_DIST_TEST_TIME_STRICT": "1"} if strict else {})}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "time_limit", "-p", "no:cacheprovider", "-q", str(tmp_path),
         *(["-n", "2"] if workers else [])], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)


def test_a_test_over_the_limit_is_named_with_the_load_and_passes(tmp_path):
    for workers in (False, True):
        result = run_sleeper(tmp_path, strict=False, workers=workers)
        assert result.returncode == 0, result.stdout
        assert "2 passed" in result.stdout, result.stdout
        assert "tests over the time limit" in result.stdout, result.stdout
        assert "test_sleeps (call) took" in result.stdout and "over the 0.3 s one test may take" in result.stdout
        assert "load average" in result.stdout and "test_quick" not in result.stdout.split("over the time limit")[-1]


def test_a_slow_setup_is_named_too(tmp_path):
    (tmp_path / "test_setup.py").write_text(SLOW_SETUP)
    for workers in (False, True):
        result = run_sleeper(tmp_path, strict=False, workers=workers)
        assert result.returncode == 0, result.stdout
        assert "test_slow_fixture (setup) took" in result.stdout, result.stdout


def test_strict_fails_a_test_over_the_limit(tmp_path):
    result = run_sleeper(tmp_path, strict=True)
    assert result.returncode == 1, result.stdout
    assert "1 failed, 1 passed" in result.stdout, result.stdout
    assert "test_sleeps (call) took" in result.stdout and "over the 0.3 s one test may take" in result.stdout
