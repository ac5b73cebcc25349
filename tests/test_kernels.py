"""The compiled CPU top-k kernel against torch.topk, and the trainer without a compiler."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time

import filelock
import pytest
import torch

from conftest import REPO
from sae_dist.models.kernels import _build, _build_directory, _builders_lock, build_name, cpu_topk, module_name


def kernel_topk(pre, bias, k, dead=None, k_aux=0):
    rows = pre.shape[0]
    vals, idx = torch.empty(rows, k), torch.empty(rows, k, dtype=torch.long)
    aux_vals, aux_idx = torch.empty(rows, max(k_aux, 1)), torch.empty(rows, max(k_aux, 1), dtype=torch.long)
    dead_u8 = dead.to(torch.uint8) if dead is not None else torch.empty(0, dtype=torch.uint8)
    cpu_topk().topk_rows(pre, bias, k, vals, idx, dead_u8, k_aux, aux_vals, aux_idx)
    return vals, idx, aux_vals[:, :k_aux], aux_idx[:, :k_aux]


def as_sets(vals, idx):
    order = idx.argsort(dim=1)
    return vals.gather(1, order), idx.gather(1, order)


# (rows, n, k): n a multiple of the kernel's group of 16 or not, k = n, k = 1, fewer groups than k
@pytest.mark.parametrize("rows,n,k", [(64, 4096, 32), (50, 1000, 7), (9, 50, 50), (33, 17, 1), (5, 300, 40)])
@pytest.mark.parametrize("with_aux", [False, True])
def test_kernel_selects_what_torch_topk_selects(rows, n, k, with_aux):
    assert cpu_topk() is not None, "the kernel did not build (scripts/setup.sh builds it)"
    g = torch.Generator().manual_seed(rows * n + k)
    pre, bias = torch.randn(rows, n, generator=g), torch.randn(n, generator=g)
    dead = torch.rand(n, generator=g) < 0.4 if with_aux else None
    k_aux = min(max(1, n // 3), int(dead.sum())) if with_aux else 0
    vals, idx, aux_vals, aux_idx = kernel_topk(pre, bias, k, dead, k_aux)
    ref_vals, ref_idx = (pre + bias).topk(k, dim=-1)
    for a, b in zip(as_sets(vals, idx), as_sets(ref_vals, ref_idx)):
        assert torch.equal(a, b)
    if with_aux:
        ref = (pre + bias).masked_fill(~dead, float("-inf")).topk(k_aux, dim=-1)
        for a, b in zip(as_sets(aux_vals, aux_idx), as_sets(ref.values, ref.indices)):
            assert torch.equal(a, b)


@pytest.mark.slow
def test_without_a_compiler_training_uses_torch_topk(tmp_path):
    """No compiler: one warning, and the stock path trains (a missing kernel costs speed only)."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "CXX": "/bin/false"}
    code = ("import logging; logging.basicConfig(level=logging.INFO);"
            "import torch; from sae_dist.models.kernels import cpu_topk; assert cpu_topk() is None;"
            "from sae_dist.models.sae import SparseAutoencoder;"
            "sae = SparseAutoencoder(16, 64, 'topk', 4, seed=0); out = sae(torch.randn(8, 16)); out.loss.backward();"
            "print('trained', float(out.loss) > 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "trained True" in result.stdout
    assert "could not build the topk_cpu kernel" in result.stderr and "using stock PyTorch" in result.stderr


def test_a_build_is_named_by_its_source_and_torch_so_checkouts_never_rebuild_each_others():
    """torch's extension cache is per user: under one name, two checkouts (or one before and after
    an update) rebuilt the kernel in turn at their jobs' start. Alike sources share a build."""
    same = build_name("topk_cpu", b"int f();", "2.13.0+cpu")
    assert same == build_name("topk_cpu", b"int f();", "2.13.0+cpu") and same.startswith("sae_dist_topk_cpu_")
    assert build_name("topk_cpu", b"int f(); // changed", "2.13.0+cpu") != same
    assert build_name("topk_cpu", b"int f();", "2.11.0+cu130") != same
    # Two virtualenvs of one torch: the build names each one's headers, so each has its own.
    assert build_name("topk_cpu", b"int f();", "2.13.0+cpu", "/a/.venv/torch") != \
        build_name("topk_cpu", b"int f();", "2.13.0+cpu", "/b/.venv/torch")
    import torch

    source = (REPO / "sae_dist" / "models" / "kernels" / "topk_cpu.cpp").read_bytes()
    assert module_name("topk_cpu") == build_name("topk_cpu", source, torch.__version__, os.path.dirname(torch.__file__))


@pytest.mark.slow
def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next(tmp_path):
    """torch's build lock is a file: a process killed mid-build (a job cancelled at its start) left
    it behind and every later training waited for it forever. A builder of ours holds an flock
    while torch's lock file exists; killed, it leaves the file but not the flock, and the next
    builder removes the file. (A real kernel copied elsewhere is rebuilt, a minute of g++: the
    build directory here is an empty one, and torch's load is the next test's.)"""
    build_dir = tmp_path / "ext" / "sae_dist_topk_cpu_test"
    build_dir.mkdir(parents=True)
    enter = ("import logging, sys, time; from pathlib import Path; logging.basicConfig(level=logging.INFO);"
             "from sae_dist.models.kernels import _only_builder\n"
             "with _only_builder(Path(sys.argv[1])):\n"
             "    if sys.argv[2] == 'hold':\n"
             "        (Path(sys.argv[1]) / 'lock').touch()  # as torch's FileBaton does\n"
             "        print('holding', flush=True); time.sleep(600)\n"
             "    print('in', flush=True)\n")
    holder = subprocess.Popen([sys.executable, "-c", enter, str(build_dir), "hold"], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(filelock.Timeout):  # a live builder keeps every other one of ours out
            _builders_lock(build_dir).acquire(timeout=0)
    finally:
        holder.kill()  # SIGKILL: no cleanup runs
        holder.wait()
    assert (build_dir / "lock").exists()  # torch's lock outlived its builder
    nxt = subprocess.run([sys.executable, "-c", enter, str(build_dir), "build"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert nxt.returncode == 0 and nxt.stdout.strip() == "in", nxt.stderr
    assert "left by a build that was killed" in nxt.stderr
    assert not (build_dir / "lock").exists()


def test_what_a_job_waits_for_at_its_start_is_logged_before_and_after_the_wait(caplog):
    """The Monitor shows a job's last log line: at its start, that is the kernel's build, and then
    how long it waited. The wait is made here by holding the builders' flock until the load has
    begun and 2.5 s more, so it is at least that long whatever the machine's load."""
    assert cpu_topk() is not None  # built (or loaded) once: the load below is a wait, not a build
    held = _builders_lock(_build_directory(module_name("topk_cpu")))
    loaded = []
    with caplog.at_level(logging.INFO, logger="sae_dist.models.kernels"):
        with held:
            loader = threading.Thread(target=lambda: loaded.append(_build("topk_cpu")))
            loader.start()
            deadline = time.monotonic() + 120
            while "loading the topk_cpu kernel" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(2.5)
        loader.join(120)
    assert loaded and loaded[0] is not None
    assert "loading the topk_cpu kernel (built once per source and torch version" in caplog.text
    assert re.search(r"the topk_cpu kernel was ready after \d+ s", caplog.text), caplog.text
