"""`python -m sae_dist report RUN_ID --format md|csv|html`: a benchmark's report in a file.

md: tables (measured, projected, environment, each point's other load) and the speedup chart as
an embedded Vega-Lite spec in a fenced block; csv: one row per device count, with `reliable`
(true/false) and `reason`; html: a standalone page with the tables and the charts (Vega-Lite,
embedded). md and html put a warning above the measured table naming every unreliable device
count and why (sae_dist.bench.reliability). The queries live here too: the app's page uses them.
"""

from __future__ import annotations

import csv
import html
import io
import json
from pathlib import Path

from sqlmodel import Session, select

from sae_dist.bench import reliability as R
from sae_dist.bench import summary as S
from sae_dist.db import BenchmarkPoint, BenchmarkRun, get_engine
from sae_dist.errors import UserError

MISSING = "—"
CSV_FIELDS = ("devices", "repeats", "per_device_batch", "samples_per_s", "spread", "step_s", "speedup",
              "efficiency", "ceiling_samples_per_s", "efficiency_vs_ceiling", "comm_share", "peak_memory",
              "mean_utilization_pct", "grad_bytes", "target_speedup", "ceiling_spread", "other_cpu_pct",
              "other_gpu_pct", "reliable", "reason")


def list_benchmarks(engine=None) -> list[dict]:
    engine = engine or get_engine()
    with Session(engine) as s:
        runs = s.exec(select(BenchmarkRun).order_by(BenchmarkRun.id.desc())).all()
        return [r.model_dump() for r in runs]


def load_benchmark(bench_id: int, engine=None) -> tuple[dict, list[dict]]:
    """The benchmark's row and its points as plain dicts; a UserError names a missing id."""
    engine = engine or get_engine()
    with Session(engine) as s:
        run = s.get(BenchmarkRun, bench_id)
        if run is None:
            raise UserError(f"no benchmark {bench_id} in {engine.url.render_as_string(hide_password=True)} "
                            "(python -m sae_dist bench prints the id of each one)")
        points = s.exec(select(BenchmarkPoint).where(BenchmarkPoint.bench_id == bench_id)
                        .order_by(BenchmarkPoint.devices, BenchmarkPoint.repeat)).all()
        return run.model_dump(), [p.model_dump() for p in points]


def _num(value, fmt: str = ",.0f") -> str:
    return MISSING if value is None else format(value, fmt)


def fmt_bytes(value) -> str:
    if value is None:
        return MISSING
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value} B"


def fmt_other_load(row: dict) -> str:
    """The most other load a device count's points saw, as text ('—': not recorded)."""
    parts = []
    if row.get("other_cpu_pct") is not None:
        parts.append(f"{row['other_cpu_pct']:.0f}% of a core")
    if row.get("other_gpu_pct"):
        parts.append(f"GPU {row['other_gpu_pct']:.0f}% SM")
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
        "Mean utilisation": _num(r["mean_utilization_pct"], ".0f") + ("%" if r["mean_utilization_pct"] is not None else ""),
        "Gradient all-reduced/step": fmt_bytes(r["grad_bytes"]),
        "All-reduce bandwidth": (MISSING if r["allreduce_bytes_per_s"] is None
                                 else f"{r['allreduce_bytes_per_s'] / 1e9:.2f} GB/s"),
        "Other load (most, while running)": fmt_other_load(r),
        "Why unreliable": r.get("reason") or "",
    } for r in rows]


def _pct(value) -> str:
    return MISSING if value is None else f"{value:.0f}%"


def other_load_table(points: list[dict]) -> list[dict[str, str]]:
    """Each point in the order it ran (repeats interleave across device counts): the other
    processes' CPU (percent of one core) just before it and while it ran, the busiest of them,
    other scheduler jobs seen running, and other GPU processes."""
    out = []
    for p in sorted(points, key=lambda p: (p.get("created_at") is None, p.get("created_at"), p.get("id") or 0)):
        load = R.point_load(p.get("other_load_json"))
        gpu = MISSING
        if load["gpu_pct"] is not None or load["gpu_unknown"]:
            gpu = (f"{load['gpu_pct']:.0f}% SM" if load["gpu_pct"] is not None else "") + (
                f" ({load['gpu_unknown']} of unknown use)" if load["gpu_unknown"] else "")
        out.append({
            "Devices": str(p["devices"]), "Kind": p["kind"], "Repeat": str(p["repeat"] + 1),
            "Samples/s": _num(p["samples_per_s"]),
            "Other CPU before": _pct(load["before_cpu_pct"]), "Other CPU while running": _pct(load["cpu_pct"]),
            "Busiest other processes": load["top"] or MISSING,
            "Other jobs running": ", ".join(f"{j['id']} {j['name']} ({j['user']})" for j in load["jobs"]) or MISSING,
            "Other GPU processes": gpu,
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
    return f"{value:,.0f}" if value >= 10 else f"{value:.2g}"


def projection_table(projection: list[dict]) -> list[dict[str, str]]:
    return [{
        "Devices": str(p["devices"]), "All-reduce": f"{p['allreduce_s'] * 1e3:.2f} ms",
        "Speedup, no overlap": f"{p['speedup_no_overlap']:.2f}",
        "Speedup, full overlap": f"{p['speedup_overlap']:.2f}",
        "Break-even batch/device": fmt_batch(p["break_even_batch"]),
    } for p in projection]


def environment_lines(run: dict) -> list[str]:
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


def _md_table(rows: list[dict[str, str]]) -> str:
    if not rows:
        return "_none_\n"
    head = list(rows[0])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r[h] for h in head) + " |" for r in rows]
    return "\n".join(out) + "\n"


def _html_table(rows: list[dict[str, str]]) -> str:
    if not rows:
        return "<p><em>none</em></p>"
    head = list(rows[0])
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(r[h])}</td>" for h in head) + "</tr>" for r in rows)
    return ("<table><thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head)
            + f"</tr></thead><tbody>{cells}</tbody></table>")


def render(run: dict, points: list[dict], fmt: str, link: str = "pcie4") -> str:
    rows = S.summarize(points)
    try:
        link_label, bandwidth = S.link_bandwidth(link, rows)
    except ValueError as e:
        raise UserError(f"--link: {e}") from None
    projection = S.projection_rows(rows, run["mode"], bandwidth)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({**r, "reliable": "true" if r["reliable"] else "false", "reason": r["reason"] or ""}
                         for r in rows)
        return out.getvalue()
    warning = R.warning_text(rows)
    no_projection = S.projection_note(rows)
    from sae_dist.bench.charts import efficiency_chart, speedup_chart

    speed = speedup_chart(rows, projection, title=f"Speedup ({run['mode']} scaling; projection: {link_label})")
    title = f"sae-dist scaling benchmark {run['id']}: {run['name']}"
    if fmt == "md":
        parts = [f"# {title}", "", *[f"- {line}" for line in environment_lines(run)], "",
                 "## Measured", "", *([f"> **Warning:** {warning}", ""] if warning else []),
                 f"**{headline_text(rows)}**", "", _md_table(measured_table(rows)),
                 "Speedup and efficiency are against the 1-device median; the ceiling is the same "
                 "per-device work as N independent processes at once, without communication. "
                 "Samples/s: median over repeats ± spread (half the range over the median).", "",
                 R.RULES_TEXT, "",
                 "## Other load, point by point (in the order measured)", "",
                 "CPU of other processes in percent of one core (100% = one core kept busy), from "
                 "/proc: the machine's busy time minus the point's own processes.", "",
                 _md_table(other_load_table(points)),
                 f"## Projected for {link_label}", "", S.MODEL_TEXT, "",
                 *([f"_{no_projection}_", ""] if no_projection else [_md_table(projection_table(projection))]),
                 "## Speedup chart (Vega-Lite)", "", "```vega-lite", speed.to_json(indent=None), "```", ""]
        return "\n".join(parts)
    if fmt == "html":
        eff = efficiency_chart(rows)
        env = "".join(f"<li>{html.escape(line)}</li>" for line in environment_lines(run))
        warn_html = (f'<p class="warning" style="background:#fff8c5;border:1px solid #d4a72c;padding:6px 10px">'
                     f"<strong>Warning:</strong> {html.escape(warning)}</p>" if warning else "")
        return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<script src="https://cdn.jsdelivr.net/npm/vega@5"></script>
<script src="https://cdn.jsdelivr.net/npm/vega-lite@5"></script>
<script src="https://cdn.jsdelivr.net/npm/vega-embed@6"></script>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}</style></head><body>
<h1>{html.escape(title)}</h1><ul>{env}</ul>
<h2>Measured</h2>{warn_html}<p><strong>{html.escape(headline_text(rows))}</strong></p>
{_html_table(measured_table(rows))}<p>{html.escape(R.RULES_TEXT)}</p>
<h2>Charts</h2><div id="speedup"></div><div id="efficiency"></div>
<h2>Other load, point by point (in the order measured)</h2>{_html_table(other_load_table(points))}
<h2>Projected for {html.escape(link_label)}</h2><p>{html.escape(S.MODEL_TEXT)}</p>
{f"<p><em>{html.escape(no_projection)}</em></p>" if no_projection else _html_table(projection_table(projection))}
<script>
vegaEmbed("#speedup", {speed.to_json(indent=None)});
vegaEmbed("#efficiency", {eff.to_json(indent=None)});
</script></body></html>
"""
    raise UserError(f"--format {fmt!r}: choose md, csv or html")


def write_report(bench_id: int, fmt: str = "md", out: str | None = None, link: str = "pcie4") -> Path:
    run, points = load_benchmark(bench_id)
    text = render(run, points, fmt, link)
    path = Path(out or f"bench-{bench_id}.{fmt}")
    try:
        path.write_text(text)
    except OSError as e:
        raise UserError(f"cannot write the report to {path}: {e.strerror}") from None
    return path
