"""A rank's free GPU memory for `--balance memory`: NVML's reading where NVML answers for the
rank's GPU, else CUDA's (`torch.cuda.mem_get_info`), and which of the two it was.

NVML is what `info`, `recommend` and the Train page read, so the shares follow the same
figures (and the emulated driver of tests/fake_nvml reaches them without a GPU). The GPU is
found in NVML by its UUID from CUDA's own device properties, never by an index: NVML's
enumeration order is not CUDA's (the scheduler numbers GPUs by PCI bus id, and sets
CUDA_DEVICE_ORDER=PCI_BUS_ID for jobs). A torch too old to report a UUID falls back to the PCI
bus id. A UUID NVML does not know (a MIG slice, whose parent's reading would be wrong) falls
back to CUDA, which measures the slice itself.

nvidia-ml-py is imported inside the function (sae_dist never imports scheduler).
"""

from __future__ import annotations

from typing import Any


def nvml_free_memory(uuid: str | None, pci_bus_id: str | None = None) -> tuple[int | None, str | None]:
    """(free bytes NVML reports for the GPU with this UUID, else this PCI bus id; None), or
    (None, why NVML could not say). Never raises."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    if not uuid and not pci_bus_id:
        return None, "the GPU has neither a UUID nor a PCI bus id"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # no driver library, driver not loaded...
        return None, f"NVML did not start: {exc}"
    try:
        handle = (pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid
                  else pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id))
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).free), None
    except Exception as exc:
        return None, f"NVML could not read {uuid or pci_bus_id}: {exc}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # nothing to do about it here; the reading stands
            pass


def choose(nvml: int | None, nvml_why: str | None, cuda: int | None) -> tuple[int | None, str]:
    """(free bytes, where they came from) from NVML's reading (or why there is none) and CUDA's."""
    if nvml is not None:
        return nvml, "from NVML"
    if cuda is not None:
        return cuda, f"from CUDA ({nvml_why})" if nvml_why else "from CUDA"
    return None, f"unknown ({nvml_why})" if nvml_why else "unknown"


def sources_line(sources: list[str]) -> str:
    """One phrase for the log naming where each rank's free memory came from, ranks grouped:
    "free memory from NVML", or "free memory from NVML (ranks 0, 1), from CUDA (...) (rank 2)"."""
    if len(set(sources)) == 1:
        return f"free memory {sources[0]}"
    groups: dict[str, list[int]] = {}
    for rank, source in enumerate(sources):
        groups.setdefault(source, []).append(rank)
    return "free memory " + ", ".join(
        f"{source} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
        for source, ranks in groups.items())


def cuda_identity(device: Any) -> tuple[str | None, str | None]:
    """(UUID as NVML writes it, PCI bus id as NVML writes it) of a CUDA device, each None where
    this torch does not report it."""
    import torch

    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    ids = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    bus = None if None in ids else f"{ids[0]:08X}:{ids[1]:02X}:{ids[2]:02X}.0"
    return (None if uuid is None else f"GPU-{uuid}"), bus


def free_memory(device: Any) -> tuple[int | None, str]:
    """(free bytes on this rank's device, where they came from); none for CPU ranks, which
    share one memory (no share of it is theirs)."""
    if device.type != "cuda":
        return None, "not read (a CPU rank)"
    import torch

    nvml, why = nvml_free_memory(*cuda_identity(device))
    cuda = int(torch.cuda.mem_get_info(device)[0]) if nvml is None else None
    return choose(nvml, why, cuda)
