"""The GPUs each host's NVML listed, as last seen, kept in the state home for the next process.

A process that starts while NVML is broken (`info`, the daemon, `submit`, the app) lists them
as unavailable instead of offering virtual devices in their place, and one that starts while a
GPU is lost gives it its uuid and bus id back (scheduler.devices). A state home may be shared
between machines (a home directory on NFS), so the GPUs are kept per host name: another
host's GPUs are never this one's.

The file, `nvml_devices.json`:
    {"hosts": {"<hostname>": {"<NVML index>": {"uuid": ..., "name": ..., "pci_bus_id": ...}}}}
The decisions (`parse`, `merged`) are pure; `load` and `save` are the file's edges.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

FILE = "nvml_devices.json"

Identity = tuple[str, str, "str | None"]  # (uuid, name, PCI bus id)


def host() -> str:
    return socket.gethostname()


def parse(text: str, host_name: str) -> dict[int, Identity]:
    """`host_name`'s GPUs by NVML index from the file's text; {} for a host never seen, or a
    file that is not of this format (damaged, or from before it was kept per host)."""
    try:
        rows = json.loads(text)["hosts"][host_name]
        return {int(i): (str(r["uuid"]), str(r["name"]), None if r["pci_bus_id"] is None else str(r["pci_bus_id"]))
                for i, r in rows.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}


def merged(text: str | None, host_name: str, by_index: dict[int, Identity]) -> str:
    """The file's new text: `host_name`'s GPUs replaced by `by_index`, every other host's kept."""
    try:
        hosts = json.loads(text)["hosts"] if text else {}
        hosts = hosts if isinstance(hosts, dict) else {}
    except (ValueError, KeyError, TypeError):
        hosts = {}
    hosts[host_name] = {str(i): {"uuid": u, "name": n, "pci_bus_id": b} for i, (u, n, b) in sorted(by_index.items())}
    return json.dumps({"hosts": hosts}, indent=1, sort_keys=True)


def path() -> Path:
    from sae_dist.paths import state_home

    return state_home() / FILE


def load() -> dict[int, Identity]:
    """This host's GPUs as last seen, by NVML index; {} when none was kept."""
    try:
        return parse(path().read_text(), host())
    except OSError:
        return {}


def save(by_index: dict[int, Identity]) -> None:
    """Keep this host's GPUs (a whole file renamed into place; other hosts' entries kept).
    Raises OSError where the state home cannot be written."""
    target = path()
    try:
        before = target.read_text()
    except OSError:
        before = None
    partial = target.with_name(f"{target.name}.{os.getpid()}")
    partial.write_text(merged(before, host(), by_index))
    partial.replace(target)
