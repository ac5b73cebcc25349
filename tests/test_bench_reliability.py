"""Benchmarks that refuse to mislead: the reliability rule on hand-made rows, the projection and
the headline without unreliable points, the other-load record of real processes, the csv/md/html
reports, the charts' data and the app's page warning."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone

import pytest
from sqlmodel import Session

from conftest import REPO
from sae_dist.analytics import bench_charts, bench_tables
from sae_dist.analytics import bench_report as report
from sae_dist.bench import load
from sae_dist.bench import reliability as R
from sae_dist.bench import summary as S
from sae_dist.db import BenchmarkPoint, BenchmarkRun, get_engine


def row(n=2, speedup=1.8, vs_ceiling=0.95, spread=0.05, ceiling_spread=0.05, cpu=2.0, **extra):
    return {"devices": n, "speedup": speedup, "efficiency_vs_ceiling": vs_ceiling, "spread": spread,
            "ceiling_spread": ceiling_spread, "other_cpu_pct": cpu, **extra}


def test_a_clean_row_is_reliable():
    assert R.reasons(row()) == []
    assert R.reasons(row(n=1, speedup=1.0, vs_ceiling=1.0, ceiling_spread=None)) == []
    # unknown figures are no reason (an old benchmark recorded no other load)
    assert R.reasons({"devices": 2, "speedup": None}) == []


def test_beating_its_own_ceiling():
    why = R.reasons(row(vs_ceiling=1.10))
    assert len(why) == 1 and why[0].startswith("beats its own ceiling (110%")
    assert R.reasons(row(vs_ceiling=1.05)) == []  # within the 5% tolerance


def test_superlinear_speedup():
    why = R.reasons(row(speedup=2.2))
    assert len(why) == 1 and why[0] == "superlinear speedup (2.20x on 2 devices, efficiency 110%)"
    assert R.reasons(row(speedup=2.08)) == []  # efficiency 104%: within the 5% tolerance
    assert R.reasons(row(n=4, speedup=4.3)) == ["superlinear speedup (4.30x on 4 devices, efficiency 108%)"]


def test_a_wide_spread():
    assert R.reasons(row(spread=0.25)) == ["its repeats spread ±25%"]
    assert R.reasons(row(ceiling_spread=0.3)) == ["its ceiling's repeats spread ±30%"]
    assert R.reasons(row(spread=0.20)) == []  # the limit itself passes


def test_other_load():
    why = R.reasons(row(cpu=35.0, other_cpu_top="python (pid 7) 30%"))
    assert why == ["other processes used 35% of a core while it ran (python (pid 7) 30%)"]
    assert R.reasons(row(cpu=10.0)) == []  # the limit itself passes
    assert R.reasons(row(other_gpu_pct=50.0)) == ["another process used a GPU at 50% SM utilisation while it ran"]
    assert R.reasons(row(other_gpu_unknown=1)) == ["1 other process(es) on the GPUs, utilisation unknown"]


def test_the_user_report_is_unreliable_on_every_count():
    """7.21x on 2 devices, 360% efficiency, DDP over its ceiling, a 1-device point under load."""
    rows = R.judge([row(n=1, speedup=1.0, vs_ceiling=1.0, ceiling_spread=None, cpu=95.0),
                    row(speedup=7.21, vs_ceiling=50186 / 18563)])
    one, two = rows
    assert not one["reliable"] and one["reason"] == "other processes used 95% of a core while it ran"
    assert not two["reliable"]
    assert two["reason"].split("; ") == [
        "beats its own ceiling (270% of the no-communication throughput)",
        "superlinear speedup (7.21x on 2 devices, efficiency 360%)",
        "its 1-device baseline is unreliable, so its speedup is too"]
    assert R.unreliable_lines(rows)[0] == "1 device: other processes used 95% of a core while it ran"


def test_an_unreliable_baseline_taints_every_speedup():
    rows = R.judge([row(n=1, speedup=1.0, vs_ceiling=1.0, spread=0.4, ceiling_spread=None), row()])
    assert [r["reliable"] for r in rows] == [False, False]
    assert rows[1]["reason"] == "its 1-device baseline is unreliable, so its speedup is too"
    clean = R.judge([row(n=1, speedup=1.0, vs_ceiling=1.0, ceiling_spread=None), row()])
    assert [r["reliable"] for r in clean] == [True, True] and clean[1]["reason"] is None
    assert R.warning_text(clean) is None


def point(n, kind, tp, step=0.01, repeat=0, cpu=None, batch=1024, grad=32_000_000):
    load_json = None if cpu is None else json.dumps(
        {"cores": 2, "cpu": {"before": {"other_cpu_pct": 1.0, "top": []},
                             "during": {"other_cpu_pct": cpu, "top": [{"pid": 42, "name": "yes", "cpu_pct": cpu}]}},
         "jobs": []})
    return {"devices": n, "kind": kind, "samples_per_s": tp, "step_s": step, "repeat": repeat, "comm_share": None,
            "per_device_batch": batch, "peak_memory": None, "grad_bytes": grad, "mean_utilization_pct": None,
            "other_load_json": load_json}


def test_summary_judges_from_the_points_other_load():
    rows = S.summarize([point(1, "ddp", 1000.0, cpu=1.0), point(2, "ddp", 1800.0, batch=512, cpu=3.0),
                        point(2, "ceiling", 2000.0, batch=512, cpu=60.0)])  # the ceiling ran under load
    one, two = rows
    assert one["reliable"] and one["other_cpu_pct"] == 1.0
    assert not two["reliable"] and two["other_cpu_pct"] == 60.0
    assert two["reason"] == "other processes used 60% of a core while it ran (yes (pid 42) 60%)"
    assert S.best_speedup(rows) is None  # the only multi-device row is unreliable


def test_other_gpu_processes_in_the_record():
    gpu = {"gpus": 2, "other_processes": [
        {"gpu": 1, "pid": 77, "name": "python", "attributable": True, "used_memory": 2**30, "sm_pct": 50.0},
        {"gpu": 0, "pid": 4242, "name": None, "attributable": False, "used_memory": 2**30, "sm_pct": None}]}
    busy = point(2, "ddp", 1800.0, batch=512)
    busy["other_load_json"] = json.dumps({"cpu": {}, "gpu": gpu, "jobs": [{"id": 3, "name": "t", "user": "u"}]})
    figures = R.point_load(busy["other_load_json"])
    assert figures["gpu_pct"] == 50.0 and figures["gpu_unknown"] == 0  # another container's pid is not judged
    assert figures["jobs"] == [{"id": 3, "name": "t", "user": "u"}]
    two = S.summarize([point(1, "ddp", 1000.0, cpu=0.0), busy])[1]
    assert two["reason"] == "another process used a GPU at 50% SM utilisation while it ran"
    assert two["other_jobs"] == [(3, "t", "u")]
    unknown = dict(gpu, other_processes=[dict(gpu["other_processes"][0], sm_pct=None)])
    assert R.point_load(json.dumps({"gpu": unknown}))["gpu_unknown"] == 1
    quiet = R.point_load(json.dumps({"gpu": {"gpus": 1, "other_processes": []}}))
    assert quiet["gpu_pct"] == 0.0 and quiet["cpu_pct"] is None


def test_projection_and_headline_use_reliable_points_only():
    quiet = S.summarize([point(1, "ddp", 1024.0, cpu=0.5), point(2, "ddp", 1800.0, batch=512, cpu=0.5),
                         point(4, "ddp", 9000.0, batch=256, cpu=0.5)])  # 4 devices: superlinear
    assert S.best_speedup(quiet)["devices"] == 2  # not the (bigger, impossible) 4-device figure
    assert "1.76x on 2 devices" in bench_tables.headline_text(quiet)
    bandwidth = S.link_bandwidth("pcie4")[1]
    assert [p["devices"] for p in S.projection_rows(quiet, "strong", bandwidth)] == [2, 4, 8]
    assert bench_tables.projection_note(quiet) is None

    busy = S.summarize([point(1, "ddp", 1024.0, cpu=80.0), point(2, "ddp", 1800.0, batch=512, cpu=0.5)])
    assert S.projection_rows(busy, "strong", bandwidth) == []
    assert bench_tables.projection_note(busy).startswith("No projection: the 1-device point is unreliable "
                                                         "(other processes used 80%")
    assert bench_tables.headline_text(busy) == "Best speedup: none — no multi-device point is reliable"


def _layer_rows(spec: dict) -> list[tuple[dict, list[dict]]]:
    """Each layer of a chart's spec with the rows it draws."""
    return [(layer, spec["datasets"][layer["data"]["name"]]) for layer in spec["layer"] if "data" in layer]


def test_chart_data_marks_unreliable_points():
    rows = S.summarize([point(1, "ddp", 1000.0, cpu=0.0), point(2, "ddp", 7210.0, batch=512, cpu=0.0),
                        point(2, "ceiling", 2000.0, batch=512, cpu=0.0)])
    spec = bench_charts.speedup_chart(rows, []).to_dict()
    layers = _layer_rows(spec)
    measured = {(v["devices"], v["series"]): v for _, data in layers for v in data
                if v["series"] in bench_charts.MEASURED}
    assert measured[(1, "measured (DDP)")]["reliable"] is True
    bad = measured[(2, "measured (DDP)")]
    assert bad["reliable"] is False and "superlinear" in bad["reason"]
    # the measured line only through reliable points; unreliable ones hollow and grey, in a layer of their own
    solid = next(data for layer, data in layers if layer["mark"]["type"] == "line"
                 and any(v["series"] in bench_charts.MEASURED for v in data))
    assert {(v["devices"], v["reliable"]) for v in solid} == {(1, True)}
    hollow, hollow_rows = next((layer, data) for layer, data in layers if layer["mark"].get("filled") is False
                               and layer["mark"]["type"] == "point")
    assert hollow["encoding"]["color"] == {"value": bench_charts.UNRELIABLE_COLOR}
    assert {(v["devices"], v["series"]) for v in hollow_rows} == {(2, "measured (DDP)"),
                                                                  (2, "ceiling (no communication)")}
    eff = bench_charts.efficiency_chart(rows).to_dict()
    bars = [(layer, data) for layer, data in _layer_rows(eff) if layer["mark"]["type"] == "bar"]
    assert [{(v["devices"], v["reliable"]) for v in data} for _, data in bars] == [{("1", True)}, {("2", False)}]
    assert bars[1][0]["mark"]["filled"] is False


def test_scaling_charts_draw_no_empty_layer_and_key_every_series_they_colour():
    """No layer without rows (Vega warned "Infinite extent" for each), the colour key holds the
    series drawn in colour and only those (all measured points unreliable: no measured colour),
    and every key sits below the plot with its labels whole."""
    clean = S.summarize([point(1, "ddp", 1000.0, cpu=0.0), point(2, "ddp", 1800.0, batch=512, cpu=0.0),
                         point(2, "ceiling", 1900.0, batch=512, cpu=0.0)])
    busy = S.summarize([point(1, "ddp", 1000.0, cpu=95.0), point(2, "ddp", 1800.0, batch=512, cpu=95.0)])
    projection = S.projection_rows(clean, "strong", S.link_bandwidth("pcie4")[1])
    for rows, proj in ((clean, projection), (clean, []), (busy, [])):
        for chart in (bench_charts.speedup_chart(rows, proj), bench_charts.efficiency_chart(rows)):
            spec = chart.to_dict()
            assert all(data for _, data in _layer_rows(spec)), spec["layer"]
            for layer in spec["layer"]:
                for channel in layer.get("encoding", {}).values():
                    key = channel.get("legend") if isinstance(channel, dict) else None
                    if key:
                        assert key["orient"] == "bottom" and key["labelLimit"] == 0
    domain = lambda spec: next(layer["encoding"]["color"]["scale"]["domain"] for layer in spec["layer"]  # noqa: E731
                               if "scale" in layer["encoding"].get("color", {}))
    assert domain(bench_charts.speedup_chart(clean, projection).to_dict()) == bench_charts.SERIES_ORDER
    assert domain(bench_charts.speedup_chart(busy, []).to_dict()) == ["ideal (N x)", bench_charts.TARGET]
    assert "(1.8x on 2, 3.2x on 4)" in bench_charts.TARGET


def run_row(**extra):
    return {"id": 1, "name": "b", "mode": "strong", "device_counts": "[1, 2]", "steps": 8, "warmup_steps": 2,
            "repeats": 1, "queued": False, "status": "COMPLETED", "device_names": "[]", "virtual": True,
            "backend": "gloo", "torch_version": "x", "link": None, "host": "h",
            "created_at": datetime(2026, 11, 24, tzinfo=timezone.utc), "error": None, **extra}


def test_reports_say_which_points_are_unreliable():
    points = [point(1, "ddp", 1000.0, cpu=95.0), point(2, "ddp", 7210.0, batch=512, cpu=0.0),
              point(2, "ceiling", 2000.0, batch=512, cpu=0.0)]
    table = list(csv.DictReader(io.StringIO(report.render(run_row(), points, "csv"))))
    assert {"reliable", "reason", "spread", "ceiling_spread", "other_cpu_pct"} <= set(table[0])
    assert [r["reliable"] for r in table] == ["false", "false"]
    assert table[0]["reason"] == "other processes used 95% of a core while it ran (yes (pid 42) 95%)"
    assert "superlinear speedup (7.21x on 2 devices" in table[1]["reason"]
    clean = list(csv.DictReader(io.StringIO(report.render(run_row(), [point(1, "ddp", 1000.0, cpu=0.0)], "csv"))))
    assert clean[0]["reliable"] == "true" and clean[0]["reason"] == ""

    md = report.render(run_row(), points, "md")
    warning = next(line for line in md.splitlines() if line.startswith("> **Warning:**"))
    assert md.index(warning) < md.index("| Reliable |")  # above the table
    assert "1 device: other processes used 95% of a core" in warning and "2 devices: beats its own ceiling" in warning
    assert "Best speedup: none" in md and "_No projection: the 1-device point is unreliable" in md
    assert R.RULES_TEXT in md and "| yes (pid 42) 95% |" in md  # the other-load table
    page = report.render(run_row(), points, "html")
    assert page.index('class="warning"') < page.index("<th>Reliable</th>")
    assert "2 devices: beats its own ceiling" in page and "No projection: the 1-device point is unreliable" in page


def test_mine_ticks_counts_a_reaped_child_and_gives_up_on_an_orphan():
    # pid -> (parent, start, own ticks, own + reaped children's ticks, name)
    before = {10: (1, 5, 100, 100, "root"), 11: (10, 6, 50, 50, "rank"), 99: (1, 2, 7, 7, "other")}
    # the rank used 20 more ticks, ended, and its parent reaped it (70 into its children's time)
    after = {10: (1, 5, 130, 200, "root"), 99: (1, 2, 9, 9, "other")}
    assert load.mine_ticks(before, {10, 11}, after, {10}) == (200 - 100) - 50  # root's 30 + the rank's 20
    # the root itself ended (reaped outside the tree): its last moments are unknown
    assert load.mine_ticks(before, {10, 11}, {99: before[99]}, set()) is None
    # a process first known as ours now (a job whose pid came late) counts from the earlier reading
    assert load.mine_ticks(before, set(), {**before, 11: (10, 6, 80, 80, "rank")}, {10, 11}) == 30


def spin(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c",
                             f"import time\nt = time.time()\nwhile time.time() - t < {seconds}: pass"])


def outside_spinner(seconds: float) -> int:
    """A busy process that is not below this one (the monitor counts its own process tree as the
    benchmark's): started through a shell that exits at once, so it is reparented away."""
    code = f"import time\nt = time.time()\nwhile time.time() - t < {seconds}: pass"
    done = subprocess.run(["sh", "-c", '"$0" -c "$1" >/dev/null 2>&1 & echo $!', sys.executable, code],
                          capture_output=True, text=True, check=True)
    return int(done.stdout.strip())


@pytest.mark.slow
def test_load_monitor_tells_the_points_processes_from_others():
    """Real processes: the point's own busy process is never 'other'; a busy process outside it is."""
    monitor = load.LoadMonitor("cpu")
    outsider = outside_spinner(4.0)
    try:
        monitor.baseline(0.5)
        own = spin(2.5)
        monitor.start_point()
        while own.poll() is None:
            monitor.tick({own.pid})
            time.sleep(0.1)
    finally:
        try:
            os.kill(outsider, signal.SIGKILL)
        except ProcessLookupError:
            pass
    record = json.loads(monitor.finish())
    during, before = record["cpu"]["during"], record["cpu"]["before"]
    assert record["cores"] >= 1 and "gpu" not in record and record["jobs"] == []
    assert before["samples"] == 1 and during["samples"] >= 1 and during["other_cpu_pct"] >= 0
    seen = {pid for (pid, _start) in monitor.during.by_process}
    assert outsider in seen and own.pid not in seen
    assert all(t["pid"] != own.pid for t in during["top"])
    assert R.point_load(json.dumps(record))["cpu_pct"] == during["other_cpu_pct"]


def test_gpu_watch_without_nvml_records_unknown_not_zero():
    """kind cuda on a machine without NVML (as here, or a driver that fails): the CPU figures
    still come, the GPU part says why it is missing, and nothing counts as a GPU reason."""
    monitor = load.LoadMonitor("cuda")
    monitor.baseline(0.2)
    monitor.start_point()
    monitor.tick(set(), force=True)
    record = json.loads(monitor.finish())
    assert record["cpu"]["during"]["samples"] == 1 and "gpu" in record
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        has_nvml = True
    except Exception:
        has_nvml = False
    if not has_nvml:
        assert record["gpu"]["gpus"] == 0 and record["gpu"]["error"].startswith("NVML unavailable")
        figures = R.point_load(json.dumps(record))
        assert figures["gpu_pct"] is None and figures["gpu_unknown"] == 0


def test_page_warns_about_unreliable_points():
    from streamlit.testing.v1 import AppTest

    engine = get_engine()
    with Session(engine) as s:
        bench = BenchmarkRun(name="shared-cores", mode="strong", device_counts="[1, 2]", config_json="{}", steps=8,
                             warmup_steps=2, repeats=1, queued=True, device_kind="cpu", device_names="[]",
                             virtual=True, backend="gloo", torch_version="x", host="h")
        s.add(bench)
        s.commit()
        for p in (point(1, "ddp", 6963.0, cpu=95.0), point(2, "ddp", 50186.0, batch=512, cpu=0.0),
                  point(2, "ceiling", 18563.0, batch=512, cpu=0.0)):
            s.add(BenchmarkPoint(bench_id=bench.id, **{k: v for k, v in p.items()}))
        s.commit()
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=60).run()
    at.switch_page("pages/5_Benchmarks.py").run()
    assert not at.exception, at.exception
    warning = next(w for w in at.warning if "1 device: other processes used 95% of a core" in w.value)
    assert "2 devices: beats its own ceiling" in warning.value and "superlinear" in warning.value
    best = next(m for m in at.metric if m.label == "Best speedup")
    assert best.value == "—"
    assert any("No projection: the 1-device point is unreliable" in c.value for c in at.caption)
