"""A benchmark as display strings: the tables and lines that the Benchmarks page and the
md/html report (`python -m sae_dist report`) both show, so they read the same in both.

Pure functions of the summary rows (`sae_dist.bench.summary.summarize`), the projection
(`summary.projection_rows`) and the stored points; a value not recorded reads "—".
"""

from __future__ import annotations

import json

from sae_dist.bench import reliability as R
from sae_dist.bench import summary as S
from sae_dist.format import MISSING, fmt_bytes, fmt_util


def _num(value, fmt: str = ",.0f") -> str:
    return MISSING if value is None else format(value, fmt)


def fmt_other_load(row: dict) -> str:
    """The most other load a device count's points saw, as text ('—': not recorded)."""
    parts = []
    if row.get("other_cpu_pct") is not None:
        parts.append(f"{fmt_util(row['other_cpu_pct'])} of a core")
    if row.get("other_gpu_pct"):
        parts.append(f"GPU {fmt_util(row['other_gpu_pct'])} SM")
    if row.get("other_gpu_unknown"):
        parts.append(f"{row['other_gpu_unknown']} GPU process(es), utilisation unknown")
    return ", ".join(parts) or MISSING


def measured_table(rows: list[dict]) -> list[dict[str, str]]:
    """The measured rows as display strings (shared by md, html and the app)."""
    return [{
        "Reliable": "yes" if r.get("reliable", True) else "NO",
        "Devices": str(r["devices"]), "Batch/device": f"{r['per_device_batch']:,}",
        "Samples/s": _num(r["samples_per_s"]) + (f" ± {r['spread']:.0%}" if r["repeats"] > 1 else ""),
        "Step": f"{r['step_s'] * 1e3:.1f} ms",
        "Speedup": _num(r["speedup"], ".2f") + (f" (target {r['target_speedup']})" if r["target_speedup"] else ""),
        "Efficiency": _num(r["efficiency"], ".0%"),
        "Ceiling samples/s": _num(r["ceiling_samples_per_s"]) + (
            f" ± {r['ceiling_spread']:.0%}" if r.get("ceiling_spread") is not None and r["repeats"] > 1 else ""),
        "Efficiency vs ceiling": _num(r["efficiency_vs_ceiling"], ".0%"),
        "Communication": _num(r["comm_share"], ".0%"),
        "Peak memory/device": fmt_bytes(r["peak_memory"]),
        "Mean utilisation": fmt_util(r["mean_utilization_pct"]),
        "Gradient all-reduced/step": fmt_bytes(r["grad_bytes"]),
        "All-reduce bandwidth": (MISSING if r["allreduce_bytes_per_s"] is None
                                 else f"{r['allreduce_bytes_per_s'] / 1e9:.2f} GB/s"),
        "Other load (most, while running)": fmt_other_load(r),
        "Why unreliable": r.get("reason") or "",
    } for r in rows]


# The measured table in parts that each fit a laptop's window (17 columns did not: every column
# from the peak memory on was cut off at 1,400 px), each part led by its device count.
MEASURED_PARTS = {
    "Scaling": ("Reliable", "Devices", "Batch/device", "Samples/s", "Step", "Speedup", "Efficiency"),
    "Against the ceiling and the link": ("Devices", "Ceiling samples/s", "Efficiency vs ceiling", "Communication",
                                         "Gradient all-reduced/step", "All-reduce bandwidth"),
    "Resources and load": ("Devices", "Peak memory/device", "Mean utilisation", "Other load (most, while running)",
                           "Why unreliable"),
}


def measured_parts(table: list[dict[str, str]]) -> list[tuple[str, list[dict[str, str]]]]:
    """`measured_table`'s rows cut into `MEASURED_PARTS`: (title, rows) each. The last part loses
    "Why unreliable" when no row has a reason."""
    parts = []
    for title, columns in MEASURED_PARTS.items():
        kept = [c for c in columns if c != "Why unreliable" or any(r[c] for r in table)]
        parts.append((title, [{c: r[c] for c in kept} for r in table]))
    return parts


# The app leaves out what no point saw (`tables.drop_quiet_columns`): no other job, no GPU.
OTHER_LOAD_QUIET = {"Jobs running": MISSING, "GPU processes": MISSING}
# Free text cut to a width, so that each table fits a 1,400 px window; the warning above the
# tables says each unreliable point's reason whole.
TEXT_WIDTHS = {"Other load (most, while running)": 200, "Why unreliable": 360, "Busiest processes": 220,
               "Jobs running": 150, "GPU processes": 130}


def other_load_table(points: list[dict]) -> list[dict[str, str]]:
    """Each point in the order it ran (repeats interleave across device counts): the other
    processes' CPU (percent of one core) just before it and while it ran, the busiest of them,
    other scheduler jobs seen running, and other GPU processes."""
    out = []
    for p in sorted(points, key=lambda p: (p.get("created_at") is None, p.get("created_at"), p.get("id") or 0)):
        load = R.point_load(p.get("other_load_json"))
        gpu = MISSING
        if load["gpu_pct"] is not None or load["gpu_unknown"]:
            gpu = (f"{fmt_util(load['gpu_pct'])} SM" if load["gpu_pct"] is not None else "") + (
                f" ({load['gpu_unknown']} of unknown use)" if load["gpu_unknown"] else "")
        out.append({
            "Devices": str(p["devices"]), "Kind": p["kind"], "Repeat": str(p["repeat"] + 1),
            "Samples/s": _num(p["samples_per_s"]),
            "CPU before": fmt_util(load["before_cpu_pct"]),
            "CPU while running": fmt_util(load["cpu_pct"]),
            "Busiest processes": load["top"] or MISSING,
            "Jobs running": ", ".join(f"{j['id']} {j['name']} ({j['user']})" for j in load["jobs"]) or MISSING,
            "GPU processes": gpu,
        })
    return out


def headline_text(rows: list[dict]) -> str:
    """The best speedup, from reliable rows only."""
    best = S.best_speedup(rows)
    if best is None:
        multi = [r for r in rows if r["devices"] > 1]
        return ("Best speedup: none — no multi-device point is reliable" if multi
                else "Best speedup: none — no multi-device point measured")
    return (f"Best speedup: {best['speedup']:.2f}x on {best['devices']} devices "
            f"(efficiency {best['efficiency']:.0%}; reliable points only)")


def fmt_batch(value: float) -> str:
    """A break-even batch: whole samples from 10 up, two significant digits under."""
    return f"{value:,.0f}" if value >= 10 else f"{value:.2g}"


def projection_table(projection: list[dict]) -> list[dict[str, str]]:
    """The projected device counts (`summary.projection_rows`) as display strings."""
    return [{
        "Devices": str(p["devices"]), "All-reduce": f"{p['allreduce_s'] * 1e3:.2f} ms",
        "Speedup, no overlap": f"{p['speedup_no_overlap']:.2f}",
        "Speedup, full overlap": f"{p['speedup_overlap']:.2f}",
        "Break-even batch/device": fmt_batch(p["break_even_batch"]),
    } for p in projection]


def environment_lines(run: dict) -> list[str]:
    """Where and how the benchmark ran (a benchmark_runs row), a line each."""
    names = json.loads(run["device_names"])
    lines = [f"Benchmark {run['id']} ({run['name']}): {run['mode']} scaling, devices {run['device_counts']}, "
             f"{run['steps']} timed steps after {run['warmup_steps']} warm-up, {run['repeats']} repeat(s), "
             f"{'scheduler jobs' if run['queued'] else 'run directly (--no-queue)'}; status {run['status']}",
             f"Devices: {', '.join(sorted(set(names)))}" + (" — virtual (CPU-backed): the figures are the "
                                                            "CPU's, not a GPU's" if run["virtual"] else ""),
             f"Backend {run['backend']}, torch {run['torch_version']}, link {run['link'] or 'unknown'}, "
             f"host {run['host']}, started {run['created_at']:%Y-%m-%d %H:%M} UTC"]
    if run.get("error"):
        lines.append(f"Error: {run['error']}")
    return lines


def projection_note(rows: list[dict]) -> str | None:
    """Why there is no projection (None when there is one to draw)."""
    one = next((r for r in rows if r["devices"] == 1), None)
    if one is None:
        return "No projection: no 1-device point to project from."
    if not one.get("reliable", True):
        return (f"No projection: the 1-device point is unreliable ({one['reason']}); "
                f"measure it again on a quiet machine.")
    if not one.get("grad_bytes"):
        return "No projection: the 1-device point recorded no gradient size."
    return None


MODEL_TEXT = ("Projection (a model, not a measurement): ring all-reduce time = 2(N-1)/N x gradient "
              "bytes / bandwidth; step time = compute + all-reduce without overlap, max(compute, "
              "all-reduce) with full overlap of the backward pass; compute per device = the measured "
              "1-device step / N for strong scaling, unchanged for weak scaling. Break-even batch: "
              "the per-device batch at which compute equals the all-reduce (compute taken as "
              "proportional to the batch); below it, communication dominates the step.")
