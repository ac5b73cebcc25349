"""Compiled CPU kernels, built on first use with torch's extension loader (g++ and ninja) and cached
in torch's extension directory; every caller has a stock-PyTorch fallback for when they cannot be
built (no compiler, SAE_DIST_NO_KERNELS=1), so a missing compiler costs speed, never a run.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

DISABLE_ENV = "SAE_DIST_NO_KERNELS"
_HERE = Path(__file__).resolve().parent
_loaded: dict[str, object] = {}


def cpu_topk():
    """The module with `topk_rows` (topk_cpu.cpp), or None when it cannot be had."""
    if os.environ.get(DISABLE_ENV):
        return None
    if "topk_cpu" not in _loaded:
        _loaded["topk_cpu"] = _build("topk_cpu")
    return _loaded["topk_cpu"]


def _build(name: str):
    # torch runs `ninja` from PATH; the pip-installed one sits beside this interpreter, which
    # is often run without its virtual environment activated.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load

        # -O3 and OpenMP's simd pragma, no -march=native: the cache may be shared by unlike nodes.
        return load(name=f"sae_dist_{name}", sources=[str(_HERE / f"{name}.cpp")],
                    extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, no headers: the stock path serves
        log.warning("could not build the %s kernel (%s); using stock PyTorch (slower)", name,
                    str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return None
