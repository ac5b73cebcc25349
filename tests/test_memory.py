"""The memory estimate (pure, torch-free, runtime baseline included) and the measured peak (a rank's
anonymous memory: memory-mapped shard pages are not the rank's) against each other, for real."""

from __future__ import annotations

import gc
import mmap
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from sae_dist.config import TrainConfig
from sae_dist.data.shard_format import write_shards
from sae_dist.memory import (
    CPU_RUNTIME_BYTES,
    CUDA_CONTEXT_BYTES,
    MemoryEstimate,
    PeakMemory,
    anonymous_bytes,
    estimate_for_config,
    estimate_memory,
)

MIB = 2**20
FINAL = re.compile(r"peak memory: measured ([\d.]+) MiB, estimated ([\d.]+) MiB")


# ---- the estimate: a pure function ---------------------------------------------------------------

def test_estimate_includes_the_runtime_of_its_device_kind():
    cpu = estimate_memory(64, 256, 1024, device_type="cpu")
    gpu = estimate_memory(64, 256, 1024, device_type="cuda")
    assert cpu.runtime == CPU_RUNTIME_BYTES and gpu.runtime == CUDA_CONTEXT_BYTES
    assert cpu.total == (cpu.params + cpu.grads + cpu.optimizer + cpu.ddp_buckets + cpu.activations + cpu.heap
                         + cpu.runtime)
    # a small model is mostly its runtime: the reported 11 MiB estimate of a run that took 51.5
    assert cpu.total > CPU_RUNTIME_BYTES > 20 * (cpu.total - cpu.runtime)
    assert gpu.heap == 0 and cpu.heap == cpu.activations  # all of its temporaries are small blocks


# Measured on an H200 (torch 2.11, CUDA 13.0, driver 580; 2026-11-27; `scripts/bench_memory.py
# --device cuda` in scripts/gpu_check.sh): the trainer's own runs in bf16 (precision auto), batch
# 4096, as (d_in, d_sae, k, torch.cuda.max_memory_allocated MiB); the CUDA context was 748 MiB.
H200_BF16_PEAKS = [(768, 24576, 32, 781), (2048, 32768, 32, 2508), (4096, 65536, 64, 10584)]
H200_CONTEXT_MIB = 748


@pytest.mark.parametrize("d_in, d_sae, k, allocated", H200_BF16_PEAKS)
def test_the_gpu_estimate_holds_what_an_h200_measured(d_in, d_sae, k, allocated):
    """Within 0-15% above what the GPU took (an estimate that says too little makes a job run out
    of memory; one far above wastes the GPU), for the trainer's default on a GPU (bf16)."""
    cfg = TrainConfig(d_in=d_in, d_sae=d_sae, k=k, batch_size=4096, devices="cuda:1")
    measured = (allocated + H200_CONTEXT_MIB) * MIB
    ratio = estimate_for_config(cfg, 1).total / measured
    assert 1.0 <= ratio <= 1.15, ratio


def test_the_heap_part_holds_the_cpu_temporaries_under_glibcs_mmap_ceiling():
    # standard, batch 1024: 16 MiB matrices at d_sae 4096 stay in the heap, 64 MiB ones at 16384 do not
    small = estimate_memory(128, 4096, 1024, "standard", device_type="cpu")
    large = estimate_memory(128, 16384, 1024, "standard", device_type="cpu")
    assert small.heap == small.activations
    assert large.heap == 8 * 1024 * 128 * 4  # the d_in-wide tensors only


def test_describe_names_the_runtime():
    text = estimate_memory(512, 4096, 4096, device_type="cpu").describe()
    assert re.fullmatch(r"[\d.]+ MiB per device \(params [\d.]+ MiB, grads [\d.]+ MiB, optimizer [\d.]+ MiB, "
                        r"ddp_buckets 0 B, activations [\d.]+ MiB, heap [\d.]+ MiB, runtime [\d.]+ MiB\)",
                        text), text
    assert f"runtime {CPU_RUNTIME_BYTES / MIB:.1f} MiB" in text
    assert MemoryEstimate(1, 2, 3, 4, 5).total == 15  # no heap or runtime given: none counted


def test_estimate_for_config_takes_the_device_kind_from_the_devices():
    cpu = estimate_for_config(TrainConfig(d_in=64, d_sae=1024, devices="cpu:2"), 2)
    gpu = estimate_for_config(TrainConfig(d_in=64, d_sae=1024, devices="cuda:2"), 2)
    assert cpu.runtime == CPU_RUNTIME_BYTES and gpu.runtime == CUDA_CONTEXT_BYTES
    assert cpu.ddp_buckets > 0
    assert estimate_for_config(TrainConfig(d_in=64, d_sae=1024, devices="cuda:2"), 2, "cpu") == cpu


def test_the_estimate_imports_no_torch():
    # The app and the scheduler estimate without paying for torch.
    code = "import sys, sae_dist.memory as m; m.estimate_memory(8, 16, 4); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


# ---- the measure: anonymous memory, in this process -----------------------------------------------

def test_peak_counts_freed_anonymous_memory_but_not_mapped_file_pages(tmp_path):
    path = tmp_path / "pages.bin"
    with open(path, "wb") as f:
        f.write(b"\1" * (128 * MIB))
    gc.collect()  # garbage of earlier tests in this worker, freed mid-window, would lower the baseline
    peak = PeakMemory(torch.device("cpu"))
    peak.reset()
    start = anonymous_bytes()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        touched = sum(mapped[i] for i in range(0, len(mapped), 4096))  # every page resident
        assert touched == 128 * MIB // 4096
        after_file = peak.peak_bytes()
        # The baseline of the tensor is the memory just before it: other threads of this worker
        # (earlier tests' writers) may free some between `start` and here.
        before_tensor = anonymous_bytes()
        block = torch.ones(64 * MIB // 4)  # 64 MiB of anonymous memory, freed before the reading
        del block
        after_tensor = peak.peak_bytes()
    assert after_file - start < 16 * MIB, (start, after_file)  # 128 MiB of file pages: not counted
    # the freed 64 MiB: counted
    assert 60 * MIB < after_tensor - before_tensor < 80 * MIB, (start, before_tensor, after_tensor)
    # Unmapped since: the file pages counted in VmHWM at the window's start are not taken for anonymous.
    assert peak.peak_bytes() == after_tensor  # the peak since reset(), across readings


# ---- the estimate against real training runs --------------------------------------------------------

def _train_sampling_rss(args: list[str]) -> tuple[str, int]:
    """A one-rank training run (in its launcher's process); its output and the largest resident
    size, file pages included, seen by polling /proc/PID/status."""
    proc = subprocess.Popen([sys.executable, "-m", "sae_dist", "train", "--no-db", "--devices", "cpu:1", *args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    largest = 0
    while proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            largest = max(largest, int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) * 1024)
        except (OSError, AttributeError):
            pass
        time.sleep(0.02)
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-3000:]
    return out, largest


def _measured_and_estimated(out: str) -> tuple[float, float]:
    found = FINAL.search(out)
    assert found, out[-3000:]
    return float(found.group(1)) * MIB, float(found.group(2)) * MIB


@pytest.mark.slow
def test_measured_peak_within_25_percent_of_the_estimate_synthetic(tmp_path):
    out, _ = _train_sampling_rss(["--d-in", "64", "--d-sae", "4096", "--k", "16", "--batch-size", "1024",
                                  "--steps", "6", "--log-every", "3", "--checkpoint-every", "0",
                                  "--out-dir", str(tmp_path / "run")])
    measured, estimated = _measured_and_estimated(out)
    assert estimated == pytest.approx(estimate_memory(64, 4096, 1024, k=16, device_type="cpu").total, abs=0.1 * MIB)
    print(f"synthetic: measured {measured / MIB:.1f} MiB, estimated {estimated / MIB:.1f} MiB")
    assert abs(estimated - measured) <= 0.25 * measured


@pytest.mark.slow
def test_measured_peak_leaves_out_the_mapped_shards(tmp_path):
    # One 256 MiB shard of rows 2 KiB wide: a step's random rows fault in most of the 128 MiB its
    # shuffle buffer spans, and refills add more. Counting those pages would put the peak far
    # outside the band (beyond the library pages that a resident size counts too).
    rows = torch.randn(128 * 1024, 512, generator=torch.Generator().manual_seed(0))
    write_shards(tmp_path / "acts", [rows])
    del rows
    out, largest_rss = _train_sampling_rss(["--source", "shards", "--shards-path", str(tmp_path / "acts"),
                                            "--d-sae", "2048", "--batch-size", "2048", "--steps", "10",
                                            "--log-every", "2", "--checkpoint-every", "0",
                                            "--out-dir", str(tmp_path / "run")])
    measured, estimated = _measured_and_estimated(out)
    print(f"shards: measured {measured / MIB:.1f} MiB, estimated {estimated / MIB:.1f} MiB, "
          f"resident with file pages {largest_rss / MIB:.1f} MiB")
    assert abs(estimated - measured) <= 0.25 * measured
    assert largest_rss > 1.25 * estimated + 64 * MIB  # what counting the shard pages would have measured
