"""Which of a benchmark's figures can be trusted. Pure functions over plain rows (the summary's
rows, one per device count), so the runner, the reports, the app and the tests share one rule.

A device count N is unreliable when any of these holds (each one a reason, all of them listed):

- it beats its own ceiling: DDP over N devices above CEILING_TOLERANCE (105%) of the same work
  run as N processes without any communication, which it cannot do for real;
- its speedup is superlinear: above N x SUPERLINEAR_TOLERANCE (efficiency over 105%);
- its measurements disagree: the spread over repeats (half the range over the median) of its DDP
  or its ceiling throughput is over SPREAD_LIMIT (20%);
- the machine was busy with other work while one of its points (DDP or ceiling, any repeat) ran:
  other processes used more than OTHER_CPU_LIMIT_PCT (10%) of one core on average, or another
  process on a GPU averaged more than OTHER_GPU_LIMIT_PCT (10%) SM utilisation (or was there
  while the driver could not say how busy it was).

The 1-device point is every speedup's baseline: when it is unreliable, so is every other row.
Unreliable rows never enter a headline figure or the projection.
"""

from __future__ import annotations

import json

CEILING_TOLERANCE = 1.05
SUPERLINEAR_TOLERANCE = 1.05
SPREAD_LIMIT = 0.20
OTHER_CPU_LIMIT_PCT = 10.0
OTHER_GPU_LIMIT_PCT = 10.0

RULES_TEXT = (
    f"A device count is unreliable when DDP beats its own no-communication ceiling (over "
    f"{CEILING_TOLERANCE:.0%} of it), when its speedup is superlinear (over {SUPERLINEAR_TOLERANCE:g} x N, "
    f"efficiency over {SUPERLINEAR_TOLERANCE:.0%}), when its repeats spread over {SPREAD_LIMIT:.0%} "
    f"(half the range over the median, DDP or ceiling), or when other processes used over "
    f"{OTHER_CPU_LIMIT_PCT:g}% of one core on average while one of its points ran (on GPUs: another "
    f"process over {OTHER_GPU_LIMIT_PCT:g}% SM utilisation, or of unknown utilisation). An unreliable "
    f"1-device baseline makes every speedup unreliable. Unreliable points are drawn hollow and grey and "
    f"left out of the best speedup and the projection.")


def point_load(other_load_json: str | None) -> dict:
    """One point's other load as figures: cpu_pct (other processes, percent of one core, averaged
    while it ran), top (its busiest other processes, as text), gpu_pct (the busiest other GPU
    process's mean SM utilisation), gpu_unknown (other GPU processes of unknown utilisation),
    jobs (other scheduler jobs seen running). None where not recorded."""
    out = {"cpu_pct": None, "before_cpu_pct": None, "top": "", "gpu_pct": None, "gpu_unknown": 0, "jobs": []}
    if not other_load_json:
        return out
    try:
        load = json.loads(other_load_json)
    except ValueError:
        return out
    cpu = load.get("cpu") or {}
    during, before = cpu.get("during"), cpu.get("before")
    if during:
        out["cpu_pct"] = during.get("other_cpu_pct")
        out["top"] = ", ".join(f"{t['name']} (pid {t['pid']}) {t['cpu_pct']:.0f}%" for t in during.get("top", [])
                               if t.get("cpu_pct", 0) >= 1)
    if before:
        out["before_cpu_pct"] = before.get("other_cpu_pct")
    gpu = load.get("gpu") or {}
    gpu_procs = [p for p in gpu.get("other_processes", []) if p.get("attributable", True)]
    known = [p["sm_pct"] for p in gpu_procs if p.get("sm_pct") is not None]
    # No GPU seen (NVML missing): unknown, not 0
    out["gpu_pct"] = max(known) if known else (0.0 if gpu.get("gpus") else None)
    out["gpu_unknown"] = sum(1 for p in gpu_procs if p.get("sm_pct") is None)
    out["jobs"] = load.get("jobs") or []
    return out


def reasons(row: dict, baseline: dict | None = None) -> list[str]:
    """Why one summary row (a device count) cannot be trusted; empty when it can. `baseline` is
    the 1-device row (judged first) for rows with N > 1.

    Reads: devices, speedup, efficiency_vs_ceiling, spread, ceiling_spread, other_cpu_pct,
    other_cpu_top, other_gpu_pct, other_gpu_unknown (missing keys and None: not known, no reason).
    """
    n = row["devices"]
    out = []
    vs_ceiling = row.get("efficiency_vs_ceiling")
    if n > 1 and vs_ceiling is not None and vs_ceiling > CEILING_TOLERANCE:
        out.append(f"beats its own ceiling ({vs_ceiling:.0%} of the no-communication throughput)")
    speedup = row.get("speedup")
    if n > 1 and speedup is not None and speedup > SUPERLINEAR_TOLERANCE * n:
        out.append(f"superlinear speedup ({speedup:.2f}x on {n} devices, efficiency {speedup / n:.0%})")
    for key, what in (("spread", "its repeats"), ("ceiling_spread", "its ceiling's repeats")):
        value = row.get(key)
        if value is not None and value > SPREAD_LIMIT:
            out.append(f"{what} spread ±{value:.0%}")
    cpu = row.get("other_cpu_pct")
    if cpu is not None and cpu > OTHER_CPU_LIMIT_PCT:
        top = row.get("other_cpu_top")
        out.append(f"other processes used {cpu:.0f}% of a core while it ran" + (f" ({top})" if top else ""))
    gpu = row.get("other_gpu_pct")
    if gpu is not None and gpu > OTHER_GPU_LIMIT_PCT:
        out.append(f"another process used a GPU at {gpu:.0f}% SM utilisation while it ran")
    if row.get("other_gpu_unknown"):
        out.append(f"{row['other_gpu_unknown']} other process(es) on the GPUs, utilisation unknown")
    if n > 1 and baseline is not None and not baseline.get("reliable", True):
        out.append("its 1-device baseline is unreliable, so its speedup is too")
    return out


def judge(rows: list[dict]) -> list[dict]:
    """The rows with `reliable` (bool) and `reason` (the reasons joined by '; ', None when
    reliable) added, the 1-device row judged first: its verdict carries to the others."""
    baseline = next((r for r in rows if r["devices"] == 1), None)
    out = []
    if baseline is not None:
        why = reasons(baseline)
        baseline = {**baseline, "reliable": not why, "reason": "; ".join(why) or None}
    for r in rows:
        if r["devices"] == 1 and baseline is not None:
            out.append(baseline)
            continue
        why = reasons(r, baseline)
        out.append({**r, "reliable": not why, "reason": "; ".join(why) or None})
    return out


def unreliable_lines(rows: list[dict]) -> list[str]:
    """One line per unreliable device count: 'N device(s): reasons'."""
    return [f"{r['devices']} device{'s' if r['devices'] > 1 else ''}: {r['reason']}"
            for r in rows if not r.get("reliable", True)]


def warning_text(rows: list[dict]) -> str | None:
    """The warning above a benchmark's table, or None when every row is reliable."""
    lines = unreliable_lines(rows)
    if not lines:
        return None
    return ("Unreliable, left out of the best speedup and the projection — " + " | ".join(lines))
