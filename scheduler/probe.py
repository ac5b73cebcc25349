"""`python -m scheduler.probe DEVICE_UUID`: does this device work? Prints HEALTHY last when it does.

Run by the health check (`scheduler.health`) in a subprocess with a timeout, since a sick GPU
can hang or crash whoever touches it. A real GPU must be read by NVML (by its uuid: found, and
its memory and utilisation readable) and take a small CUDA allocation, a computation and a
synchronize; the caller sets CUDA_VISIBLE_DEVICES to that uuid, so CUDA sees that one device only.
Where this Python's torch is built without CUDA (a CPU-only install, or a machine whose NVML is
emulated for tests), no job here can use CUDA either: the probe checks NVML alone and says so on
the line before HEALTHY ("checked: ..."), which the fault's cleared reason keeps. A CUDA build
that cannot see the GPU fails the probe: that is what a sick GPU looks like.
A virtual device is a CPU rank: a tiny torch computation on the CPU checks what a rank there
needs (this Python, torch).
"""

from __future__ import annotations

import sys

from scheduler.devices import VIRTUAL_PREFIX

HEALTHY = "HEALTHY"
CHECKED = "checked: "  # the line before HEALTHY says what was checked, when not everything was


def probe_nvml(uuid: str) -> None:
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        pynvml.nvmlDeviceGetMemoryInfo(handle)
        pynvml.nvmlDeviceGetUtilizationRates(handle)
    finally:
        pynvml.nvmlShutdown()


def probe_gpu(uuid: str) -> str | None:
    """Raises when the GPU fails; else None, or what was checked when CUDA could not be."""
    import torch

    probe_nvml(uuid)
    if torch.version.cuda is None:
        return f"{CHECKED}NVML only (torch {torch.__version__} has no CUDA here)"
    if torch.cuda.device_count() != 1:  # CUDA_VISIBLE_DEVICES=<uuid> shows exactly that GPU
        raise RuntimeError(f"CUDA sees {torch.cuda.device_count()} devices for {uuid}, expected 1")
    x = torch.ones(1 << 20, device="cuda")  # 4 MiB
    total = float((x * 2).sum())
    torch.cuda.synchronize()
    if total != 2 * (1 << 20):
        raise RuntimeError(f"wrong result on {uuid}: {total}")
    return None


def probe_cpu() -> None:
    import torch

    total = float((torch.ones(1024) * 2).sum())
    if total != 2048.0:
        raise RuntimeError(f"wrong result on the CPU: {total}")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m scheduler.probe DEVICE_UUID", file=sys.stderr)
        return 2
    uuid = argv[0]
    if uuid.startswith(VIRTUAL_PREFIX):
        probe_cpu()
    else:
        try:
            note = probe_gpu(uuid)
        except Exception as exc:  # the verdict is the last line: make it the reason, not a traceback's
            print(f"{uuid} failed its health check: {type(exc).__name__}: {exc}", flush=True)
            return 1
        if note:
            print(note, flush=True)
    print(HEALTHY, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
