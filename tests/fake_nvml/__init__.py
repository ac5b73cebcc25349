"""The emulated NVIDIA driver for tests: builds libnvidia-ml.so.1 from fake_nvml.c against
NVIDIA's nvml.h (PyPI's nvidia-nvml-dev), and writes the scenario files it answers from.

The real nvidia-ml-py finds the library through LD_LIBRARY_PATH (`environment`), exactly as it
finds a driver's; nothing in pynvml or in the product is patched. See README.md beside this file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SOURCES = ["fake_nvml.c", "scenario.c", "json.c"]
LIBRARY = "libnvidia-ml.so.1"
SCENARIO_ENV = "FAKE_NVML_SCENARIO"
GIB = 2**30


# The health probe checks NVML alone where torch has no CUDA (here); with CUDA it also needs
# CUDA to find the GPU, which an emulated one never is: those tests run on CPU-only torch.
CPU_TORCH = pytest.mark.skipif("__import__('torch').version.cuda is not None",  # evaluated when run
                               reason="torch has CUDA here: the probe's CUDA path cannot find an emulated GPU")

A100 = "NVIDIA A100-SXM4-80GB"
# PCI bus numbers of an 8-GPU A100 server (as on a DGX A100), listed here in the order the
# emulated driver enumerates them: deliberately not the bus order, which the product must sort by.
A100_BUSES = [0xB7, 0x07, 0x4E, 0x0F, 0xBD, 0x47, 0x87, 0x90]


def header_dir() -> Path:
    """The folder holding nvml.h from the installed nvidia-nvml-dev (its version's cuXX folder)."""
    from importlib.metadata import PackageNotFoundError, files

    try:
        found = [f.locate() for f in files("nvidia-nvml-dev") or () if f.name == "nvml.h"]
    except PackageNotFoundError:
        found = []
    if not found:
        raise RuntimeError("nvml.h not found: install the test extra (pip install -e '.[dev]': nvidia-nvml-dev)")
    return Path(found[0]).parent


def build(dest: Path, old_driver: bool = False) -> Path:
    """Compile the library into `dest` (a folder, created) unless an identical build is there;
    returns the folder to put on LD_LIBRARY_PATH. `old_driver` leaves out the calls a driver
    older than the bindings lacks."""
    include = header_dir()
    flags = ["-shared", "-fPIC", "-O2", "-std=gnu11", "-pthread", "-Wall", "-Wextra", "-Werror",
             "-Wno-deprecated-declarations", f"-I{include}", f"-Wl,-soname,{LIBRARY}"]
    if old_driver:
        flags.append("-DFAKE_NVML_OLD_DRIVER")
    digest = hashlib.sha256(" ".join(flags).encode())
    for name in [*SOURCES, "scenario.h", "json.h"]:
        digest.update((HERE / name).read_bytes())
    digest.update((include / "nvml.h").read_bytes())
    dest.mkdir(parents=True, exist_ok=True)
    stamp = dest / "build.sha256"
    if (dest / LIBRARY).exists() and stamp.exists() and stamp.read_text() == digest.hexdigest():
        return dest
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc) to build the emulated NVML library")
    partial = dest / f"{LIBRARY}.{os.getpid()}.tmp"
    out = subprocess.run([compiler, *flags, "-o", str(partial), *(str(HERE / s) for s in SOURCES)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"building the emulated NVML library failed:\n{out.stderr}")
    partial.replace(dest / LIBRARY)  # whole, for a process loading it meanwhile
    stamp.write_text(digest.hexdigest())
    return dest


def environment(lib_dir: Path, scenario: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's) with the emulated driver found first, the scenario named,
    and no SAE_DIST_VIRTUAL_GPUS (which would skip NVML altogether)."""
    env = dict(os.environ if base is None else base)
    env.pop("SAE_DIST_VIRTUAL_GPUS", None)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(lib_dir), env.get("LD_LIBRARY_PATH", "")) if p)
    env[SCENARIO_ENV] = str(scenario)
    return env


def a100(bus: int, i: int, **fields) -> dict:
    """One idle A100-80GB on PCI bus `bus`; `fields` override its readings."""
    device = {"name": A100, "uuid": f"GPU-{bus:02x}a100e5-0000-4000-8000-00000000{i:04x}",
              "pci_bus_id": f"00000000:{bus:02X}:00.0", "memory_total": 80 * GIB, "memory_used": 0,
              "utilization": 0, "memory_utilization": 0, "temperature": 30 + i, "power_w": 60.0 + i,
              "power_limit_w": 400.0, "pcie_gen": 4, "pcie_width": 16, "nvlink": [1] * 12, "processes": []}
    device.update(fields)
    return device


def eight_a100s() -> dict:
    """The scenario of an 8-GPU A100 server, enumerated out of PCI bus order."""
    return {"driver_version": "550.54.15", "devices": [a100(bus, i) for i, bus in enumerate(A100_BUSES)]}


def in_bus_order(scenario: dict) -> list[dict]:
    """The scenario's devices in PCI bus order: the order the product must number them in."""
    return sorted(scenario["devices"], key=lambda d: d["pci_bus_id"])


def write(path: Path, scenario: dict | str) -> Path:
    """Write a scenario (a dict, or raw text for bad ones) whole and rename it into place: the
    library sees a new file (a new inode) at its next call, never half of one."""
    text = scenario if isinstance(scenario, str) else json.dumps(scenario, indent=1)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(text)
    partial.replace(path)
    return path
