"""Compiled CPU kernels, built with torch's extension loader (g++ and ninja) at set-up
(scripts/setup.sh) or else on first use, and cached in torch's extension directory; every caller
has a stock-PyTorch fallback for when they cannot be built (no compiler, SAE_DIST_NO_KERNELS=1),
so a missing compiler costs speed, never a run.

A build is named by its source and torch's version and place (`sae_dist_topk_cpu_<hash>`): torch's cache is
per user, not per checkout, so under one name two checkouts (or one before and after an update)
rebuilt it in turn, each at some job's start, behind torch's build lock (40 s to minutes at "step
0"). It is built from a copy of its source in its build directory too (a build names its source's
path): each source is built once and loaded by every checkout that has it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

DISABLE_ENV = "SAE_DIST_NO_KERNELS"
BUILD_NOTE_S = 2.0  # a load this long was a build: the log says how long the job waited for it
_HERE = Path(__file__).resolve().parent
_loaded: dict[str, object] = {}


def build_name(name: str, source: bytes, torch_version: str, torch_dir: str = "") -> str:
    """The extension's name in torch's cache: the kernel's, and a digest of its source and the torch
    it is built against, its version and where it is installed (pure). The build's command names
    torch's headers and libraries by that path: two virtualenvs of one torch version under one
    name rebuilt the kernel in turn, each at a job's start (measured: 20-80 s each, alternating)."""
    digest = hashlib.sha256(source + b"\0" + torch_version.encode() + b"\0" + torch_dir.encode()).hexdigest()[:12]
    return f"sae_dist_{name}_{digest}"


def module_name(name: str) -> str:
    """`build_name` of the kernel `name` here, for the torch installed."""
    import torch

    return build_name(name, (_HERE / f"{name}.cpp").read_bytes(), torch.__version__,
                      os.path.dirname(torch.__file__))


def cpu_topk():
    """The module with `topk_rows` (topk_cpu.cpp), or None when it cannot be had."""
    if os.environ.get(DISABLE_ENV):
        return None
    if "topk_cpu" not in _loaded:
        _loaded["topk_cpu"] = _build("topk_cpu")
    return _loaded["topk_cpu"]


def _build_directory(module: str) -> Path | None:
    """Where torch's load() builds `module` (created), or None with a torch whose private helper
    for it is gone: the lock and the shared source below then fall back to torch's own ways."""
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private: where load() builds
    except ImportError:
        return None
    build_dir = Path(_get_build_directory(module, False))
    build_dir.mkdir(parents=True, exist_ok=True)
    return build_dir


def _builders_lock(build_dir: Path):
    """The flock every builder of ours holds while torch builds or loads the kernel in
    `build_dir` (a file beside that directory)."""
    from filelock import FileLock

    return FileLock(str(build_dir) + ".flock")


@contextmanager
def _only_builder(build_dir: Path | None):
    """Hold an flock on the build directory while torch builds or loads the kernel.

    torch's own lock is a file it creates and deletes (FileBaton): a process killed while holding it
    (a job cancelled during its first build) leaves the file behind, and every later process waits
    for it forever, so every training hangs at start. An flock dies with its process: under it, no
    other process of ours is building, and a `lock` file still there is such a leftover.
    """
    if build_dir is None:  # another torch: its own lock alone
        yield
        return
    with _builders_lock(build_dir):
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that was killed", stale)
            stale.unlink(missing_ok=True)
        yield


def _shared_source(name: str, build_dir: Path | None) -> Path:
    """The kernel's source, copied into its build directory (under the builder's lock): the build
    names its source's path, so a build from one checkout's path was rebuilt, a minute on two
    cores, by the next job from another checkout (measured: 22-27 s to the first step, alternating
    two checkouts). One path for every checkout with this source: built once. Without the build
    directory, the checkout's own path."""
    original = _HERE / f"{name}.cpp"
    if build_dir is None:
        return original
    shared = build_dir / f"{name}.cpp"
    text = original.read_bytes()
    if not shared.exists() or shared.read_bytes() != text:
        partial = shared.with_suffix(".cpp.partial")
        partial.write_bytes(text)
        os.replace(partial, shared)
    return shared


def _build(name: str):
    # torch runs `ninja` from PATH; the pip-installed one sits beside this interpreter, which
    # is often run without its virtual environment activated.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load

        module = module_name(name)
        build_dir = _build_directory(module)
        # Said before the wait, so that a job's log (and the Monitor, which shows its last line)
        # says what a job at its start waits for when the kernel is built.
        log.info("loading the %s kernel (built once per source and torch version: a first build takes "
                 "about a minute on 2 cores)", name)
        started = time.monotonic()
        with _only_builder(build_dir):
            # -O3 and OpenMP's simd pragma, no -march=native: the cache may be shared by unlike nodes.
            kernel = load(name=module, sources=[str(_shared_source(name, build_dir))],
                          extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
        waited = time.monotonic() - started
        if waited > BUILD_NOTE_S:  # a build (ours or another process's, waited for): not a load
            log.info("the %s kernel was ready after %.0f s (built, or waited for another build)", name, waited)
        return kernel
    except Exception as e:  # no compiler, no ninja, no headers: the stock path serves
        log.warning("could not build the %s kernel (%s); using stock PyTorch (slower)", name,
                    str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return None
