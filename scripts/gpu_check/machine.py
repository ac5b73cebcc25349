"""What the check runs on, and whether everything it imports is there: the GPU and its driver,
Python, torch and CUDA, and the project with the packages that travelled as wheels.

    python3 scripts/gpu_check/machine.py OUT.json

Writes the facts to OUT.json (the verdict's header) and fails when an import fails.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from harness import expect, run_step

IMPORTS = ("sae_dist.cli", "sae_dist.train.loop", "sae_dist.db", "scheduler.cli", "scheduler.daemon", "sqlmodel",
           "alembic", "pynvml", "safetensors", "filelock", "streamlit", "altair")


def nvidia_smi() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"no nvidia-smi ({e.__class__.__name__})"
    return "; ".join(out.stdout.strip().splitlines()) or f"nvidia-smi: {out.stderr.strip()[:200]}"


def main() -> int:
    import torch

    facts = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             "gpu": nvidia_smi(),
             "python": f"{platform.python_version()} ({sys.executable})",
             "torch": f"{torch.__version__}, CUDA {torch.version.cuda}, "
                      + (f"{torch.cuda.device_count()} device(s) seen, bf16 {torch.cuda.is_bf16_supported()}"
                         if torch.cuda.is_available() else "no CUDA device seen")}
    missing = []
    versions = []
    for name in IMPORTS:
        try:
            module = importlib.import_module(name)
            if "." not in name and getattr(module, "__version__", None):
                versions.append(f"{name} {module.__version__}")
        except Exception as e:  # noqa: BLE001 - every failure is reported, whatever it is
            missing.append(f"{name} ({e.__class__.__name__}: {e})")
    for name in ("triton", "sparsify"):
        spec = importlib.util.find_spec(name)
        versions.append(f"{name} {'present' if spec else 'absent'}")
    facts["packages"] = ", ".join(versions)
    Path(sys.argv[1]).write_text(json.dumps(facts, indent=1))
    for key, value in facts.items():
        print(f"{key}: {value}")
    expect(not missing, "cannot import " + "; ".join(missing))
    print(f"{facts['gpu']}; torch {torch.__version__}; every module the check needs imports")
    return 0


if __name__ == "__main__":
    run_step(main)
