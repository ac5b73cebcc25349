"""Overview and Monitor (both views) under Streamlit's AppTest, reading what the daemon sampled
from the real driver.

    python3 scripts/gpu_check/app_views.py HOME              # the GPUs NVML shows
    python3 scripts/gpu_check/app_views.py HOME --virtual    # the rehearsal: one CPU-backed device

The pages run without an exception or a warning; on a GPU every figure is a reading (name,
temperature, power, memory, utilisation), never the dash of an unknown one; a virtual device says
it is virtual and shows its temperature and power as unknown.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from harness import REPO, Daemon, cli_json, expect, run_step, use_home, wait_for

PAGES = REPO / "tests" / "fake_nvml" / "app_pages.py"  # prints what each page shows, as JSON


def main() -> int:
    home, virtual = Path(sys.argv[1]), "--virtual" in sys.argv[2:]
    use_home(home, 1 if virtual else None)
    with Daemon(home):
        wait_for(lambda: min(samples() or [0]) >= 2, 60, "two samples of each device", every=0.5)
    devices = cli_json("info")
    out = subprocess.run([sys.executable, str(PAGES), str(REPO)], cwd=REPO, capture_output=True, text=True,
                         timeout=240)
    expect(out.returncode == 0, f"the pages did not run: {out.stderr.strip()[-400:]}")
    shown = json.loads(out.stdout)
    expect(not shown["overview_exception"], f"Overview raised {shown['overview_exception']}")
    said_virtual = any("virtual" in c.lower() for c in shown["overview_caption"])
    temperatures = [m for m in shown["overview_markdown"] if m.startswith(":small[Temperature")]
    print("Overview:", temperatures)
    for view in ("Aggregated", "Per-GPU"):
        page = shown[view]
        print(f"Monitor, {view}: {page['metrics']}")
        expect(not page["exception"] and not page["warning"], f"Monitor {view}: {page['exception'] or page['warning']}")
    per_gpu = dict(shown["Per-GPU"]["metrics"])  # one GPU, or the first one's
    titles = [m for m in shown["Per-GPU"]["markdown"] if m.startswith("**GPU ")]
    if virtual:
        expect(said_virtual, "Overview does not say its devices are virtual")
        expect(per_gpu.get("Temperature") == "—" and per_gpu.get("Power") == "—",
               f"a virtual device's temperature and power must be unknown: {per_gpu}")
    else:
        expect(not said_virtual, f"Overview calls the GPUs virtual: {shown['overview_caption']}")
        expect(len(titles) == len(devices) and all(d["name"] in t for d, t in zip(devices, titles)),
               f"Per-GPU titles {titles} do not name the GPUs {[d['name'] for d in devices]}")
        unknown = [label for label, value in shown["Per-GPU"]["metrics"] if value == "—"]
        expect(not unknown and temperatures and "—" not in temperatures[0],
               f"a reading the driver gives is shown unknown: {unknown or temperatures}")
    print(f"Overview and Monitor (aggregated, per GPU) drew {len(devices)} device(s) without an exception: "
          + ", ".join(f"{k} {v}" for k, v in per_gpu.items()))
    return 0


def samples() -> list[int]:
    """How many samples the database holds of each device."""
    from sqlalchemy import func, select

    from sae_dist.db import GpuSample, get_engine

    with get_engine().connect() as conn:
        counts = conn.execute(select(GpuSample.device_uuid, func.count()).group_by(GpuSample.device_uuid)).all()
    return [n for _, n in counts]


if __name__ == "__main__":
    run_step(main)
