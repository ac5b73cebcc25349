"""The guard on one test's time fails a test that takes too long, and passes one that does not."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_a_test_over_the_limit_fails_naming_it(tmp_path):
    (tmp_path / "test_sleeper.py").write_text(
        "import time\n\ndef test_quick():\n    pass\n\ndef test_sleeps():\n    time.sleep(0.6)\n")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "time_limit", "-p", "no:cacheprovider", "-q", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "tests"), "SAE_DIST_TEST_TIME_LIMIT_S": "0.3"})
    assert result.returncode == 1, result.stdout
    assert "1 failed, 1 passed" in result.stdout, result.stdout
    assert "test_sleeps (call) took" in result.stdout and "over the 0.3 s one test may take" in result.stdout
