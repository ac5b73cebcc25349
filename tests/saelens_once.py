"""The real sae-lens, in one process for the whole session: importing sae_lens takes seconds, so
the test modules that check our export, our loader and our metrics against it (tests/test_export.py,
tests/test_evaluate.py, tests/test_sweep_eval.py, tests/test_planted_hierarchy.py,
tests/test_core_metrics.py, tests/test_transcoder.py) each prepare a
folder and a script, and one process runs every script."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

SAELENS_PYTHON = Path(__file__).resolve().parents[1] / ".venv-saelens" / "bin" / "python"

# Runs each job's script as __main__ with its arguments; a job that raises leaves its traceback in
# its folder's error.txt and the next job still runs.
RUNNER = r"""
import json, runpy, sys, traceback
from pathlib import Path

for folder, script, args in json.loads(sys.argv[1]):
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException:
        Path(folder, "error.txt").write_text(traceback.format_exc())
"""

_ran: dict[str, Path] = {}


def _preparers():
    from test_core_metrics import prepare_saelens as core_job
    from test_evaluate import prepare_saelens as evaluate_job
    from test_export import prepare_saelens as export_job
    from test_planted_hierarchy import prepare_saelens as synthetic_job
    from test_sweep_eval import prepare_saelens as sweep_job
    from test_transcoder import prepare_saelens as transcoder_job

    return {"export": export_job, "evaluate": evaluate_job, "sweep": sweep_job, "synthetic": synthetic_job,
            "core": core_job, "transcoder": transcoder_job}


def saelens_folder(job: str, tmp_path_factory) -> Path:
    """The folder of `job` ("export", "evaluate" or "sweep") after the one sae-lens process ran every job's
    script (the first call runs it; later ones, in any module, find it done). Skipped where there is
    no sae-lens environment; fails with the job's traceback where its script raised."""
    if not SAELENS_PYTHON.exists():
        pytest.skip(f"no sae-lens environment at {SAELENS_PYTHON} (create .venv-saelens to run this)")
    if not _ran:
        root = tmp_path_factory.mktemp("saelens")
        jobs = []
        for name, prepare in _preparers().items():
            folder = root / name
            folder.mkdir()
            script, args = prepare(folder)
            (folder / "script.py").write_text(script)
            jobs.append((str(folder), str(folder / "script.py"), [str(a) for a in args]))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("PYTHONPATH", None)
        proc = subprocess.run([str(SAELENS_PYTHON), "-c", RUNNER, json.dumps(jobs)], cwd=root, env=env,
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, f"the sae-lens process failed:\n{proc.stderr[-4000:]}"
        _ran.update({name: root / name for name in _preparers()})
    folder = _ran[job]
    error = folder / "error.txt"
    assert not error.exists(), f"sae-lens ({job}):\n{error.read_text()[-4000:]}"
    return folder
