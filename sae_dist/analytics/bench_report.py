"""`python -m sae_dist report RUN_ID --format md|csv|html`: a benchmark's report in a file.

md: tables (measured, projected, environment, each point's other load) and the speedup chart as
an embedded Vega-Lite spec in a fenced block; csv: one row per device count, with `reliable`
(true/false) and `reason`; html: a standalone page with the tables and the charts (Vega-Lite,
drawn by JavaScript inlined in the page, so it needs no network: `offline_vega`), a wide table
scrolling sideways in its own box rather than widening the page. md and html put a warning
above the measured table naming every unreliable device count and why
(sae_dist.bench.reliability). The tables and charts are the Benchmarks page's
(`sae_dist.analytics.bench_tables`, `sae_dist.analytics.bench_charts`): this module only lays
them out in a file.
"""

from __future__ import annotations

import csv
import html
import io
from pathlib import Path

from sae_dist.analytics import bench_tables as T
from sae_dist.analytics.queries import load_benchmark
from sae_dist.bench import reliability as R
from sae_dist.bench import summary as S
from sae_dist.db import get_engine
from sae_dist.errors import UserError

CSV_FIELDS = ("devices", "repeats", "per_device_batch", "samples_per_s", "spread", "step_s", "speedup",
              "efficiency", "ceiling_samples_per_s", "efficiency_vs_ceiling", "comm_share", "peak_memory",
              "mean_utilization_pct", "grad_bytes", "target_speedup", "ceiling_spread", "other_cpu_pct",
              "other_gpu_pct", "reliable", "reason")


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
    return ('<div class="table-wrap"><table><thead><tr>' + "".join(f"<th>{html.escape(h)}</th>" for h in head)
            + f"</tr></thead><tbody>{cells}</tbody></table></div>")


def render(run: dict, points: list[dict], fmt: str, link: str = "pcie4") -> str:
    """The report of a benchmark (`run`, its `points`) as md, csv or html text; the projection
    for `link` (a name in scaling.LINKS, "here", or GB/s)."""
    rows = S.summarize(points)
    try:
        link_label, bandwidth = S.link_bandwidth(link, rows)
    except ValueError as e:
        raise UserError(f"--link: {e}") from None
    projection = S.projection_rows(rows, run["mode"], bandwidth)
    if fmt == "csv":
        return _csv(rows)
    if fmt == "md":
        return _markdown(run, points, rows, projection, link_label)
    if fmt == "html":
        return _html(run, points, rows, projection, link_label)
    raise UserError(f"--format {fmt!r}: choose md, csv or html")


def _csv(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows({**r, "reliable": "true" if r["reliable"] else "false", "reason": r["reason"] or ""}
                     for r in rows)
    return out.getvalue()


def _title(run: dict) -> str:
    return f"sae-dist scaling benchmark {run['id']}: {run['name']}"


def _speedup_chart(run: dict, rows: list[dict], projection: list[dict], link_label: str):
    # Altair is imported here, not at the top: the csv format and the CLI's other commands need none.
    from sae_dist.analytics.bench_charts import speedup_chart

    return speedup_chart(rows, projection, title=f"Speedup ({run['mode']} scaling; projection: {link_label})"
                         ).properties(width=REPORT_CHART_WIDTH)


def _markdown(run: dict, points: list[dict], rows: list[dict], projection: list[dict], link_label: str) -> str:
    warning = R.warning_text(rows)
    no_projection = T.projection_note(rows)
    speed = _speedup_chart(run, rows, projection, link_label)
    parts = [f"# {_title(run)}", "", *[f"- {line}" for line in T.environment_lines(run)], "",
             "## Measured", "", *([f"> **Warning:** {warning}", ""] if warning else []),
             f"**{T.headline_text(rows)}**", "", _md_table(T.measured_table(rows)),
             "Speedup and efficiency are against the 1-device median; the ceiling is the same "
             "per-device work as N independent processes at once, without communication. "
             "Samples/s: median over repeats ± spread (half the range over the median).", "",
             R.RULES_TEXT, "",
             "## Other load, point by point (in the order measured)", "",
             "CPU of other processes in percent of one core (100% = one core kept busy), from "
             "/proc: the machine's busy time minus the point's own processes.", "",
             _md_table(T.other_load_table(points)),
             f"## Projected for {link_label}", "", T.MODEL_TEXT, "",
             *([f"_{no_projection}_", ""] if no_projection else [_md_table(T.projection_table(projection))]),
             "## Speedup chart (Vega-Lite)", "", "```vega-lite", speed.to_json(indent=None), "```", ""]
    return "\n".join(parts)


REPORT_CHART_WIDTH = 900  # px: a report has no container to fit (the app's charts take its width)

# Readable at 1,280 px: the text keeps a line length one can read, a table or a chart wider
# than the page scrolls sideways in its own box (the page itself never does).
STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
         ".table-wrap,.chart{max-width:100%;overflow-x:auto;margin:0.5em 0 1em}"
         "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right;"
         "white-space:nowrap}th{background:#f6f8fa}")


def _html(run: dict, points: list[dict], rows: list[dict], projection: list[dict], link_label: str) -> str:
    from sae_dist.analytics.bench_charts import efficiency_chart
    from sae_dist.analytics.offline_vega import charts_script

    warning = R.warning_text(rows)
    no_projection = T.projection_note(rows)
    speed = _speedup_chart(run, rows, projection, link_label)
    eff = efficiency_chart(rows).properties(width=REPORT_CHART_WIDTH)
    title = _title(run)
    env = "".join(f"<li>{html.escape(line)}</li>" for line in T.environment_lines(run))
    warn_html = (f'<p class="warning" style="background:#fff8c5;border:1px solid #d4a72c;padding:6px 10px">'
                 f"<strong>Warning:</strong> {html.escape(warning)}</p>" if warning else "")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{STYLE}</style></head><body>
<h1>{html.escape(title)}</h1><ul>{env}</ul>
<h2>Measured</h2>{warn_html}<p><strong>{html.escape(T.headline_text(rows))}</strong></p>
{_html_table(T.measured_table(rows))}<p>{html.escape(R.RULES_TEXT)}</p>
<h2>Charts</h2><div id="speedup" class="chart"></div><div id="efficiency" class="chart"></div>
<h2>Other load, point by point (in the order measured)</h2>{_html_table(T.other_load_table(points))}
<h2>Projected for {html.escape(link_label)}</h2><p>{html.escape(T.MODEL_TEXT)}</p>
{f"<p><em>{html.escape(no_projection)}</em></p>" if no_projection else _html_table(T.projection_table(projection))}
{charts_script({"speedup": speed.to_dict(), "efficiency": eff.to_dict()})}
</body></html>
"""


def report_text(bench_id: int, fmt: str = "md", link: str = "pcie4") -> str:
    run, points = load_benchmark(get_engine(), bench_id)
    return render(run, points, fmt, link)


def write_report(bench_id: int, fmt: str = "md", out: str = "", link: str = "pcie4") -> Path:
    text = report_text(bench_id, fmt, link)
    path = Path(out)
    try:
        path.write_text(text)
    except OSError as e:
        raise UserError(f"cannot write the report to {path}: {e.strerror}") from None
    return path
