"""Shared test fixtures: every test gets its own state home; nothing writes outside tmp."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def state_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("SAE_DIST_HOME", str(home))
    monkeypatch.delenv("SAE_DIST_DB_URL", raising=False)
    return home


def run_cli(*args: str, timeout: float = 240, env: dict | None = None, module: str = "sae_dist") -> subprocess.CompletedProcess:
    """Run `python -m <module> args...` for real, in the repository, with this test's environment."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
