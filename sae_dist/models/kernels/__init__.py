"""Compiled CPU kernels, built on first use with torch's extension loader (g++ and ninja) and cached
in torch's extension directory; every caller has a stock-PyTorch fallback for when they cannot be
built (no compiler, SAE_DIST_NO_KERNELS=1), so a missing compiler costs speed, never a run.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
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


@contextmanager
def _only_builder(module: str):
    """Hold an flock on the build directory while torch builds or loads the kernel.

    torch's own lock is a file it creates and deletes (FileBaton): a process killed while holding it
    (a job cancelled during its first build) leaves the file behind, and every later process waits
    for it forever, so every training hangs at start. An flock dies with its process: under it, no
    other process of ours is building, and a `lock` file still there is such a leftover.
    """
    from filelock import FileLock

    try:
        from torch.utils.cpp_extension import _get_build_directory  # private: where load() builds
    except ImportError:  # another torch: its own lock alone
        yield
        return
    build_dir = Path(_get_build_directory(module, False))
    build_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(build_dir) + ".flock"):
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that was killed", stale)
            stale.unlink(missing_ok=True)
        yield


def _build(name: str):
    # torch runs `ninja` from PATH; the pip-installed one sits beside this interpreter, which
    # is often run without its virtual environment activated.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load

        module = f"sae_dist_{name}"
        with _only_builder(module):
            # -O3 and OpenMP's simd pragma, no -march=native: the cache may be shared by unlike nodes.
            return load(name=module, sources=[str(_HERE / f"{name}.cpp")],
                        extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, no headers: the stock path serves
        log.warning("could not build the %s kernel (%s); using stock PyTorch (slower)", name,
                    str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return None
