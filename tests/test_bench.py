"""Scaling benchmarks: the summary from plain rows, and real 1,2-device benchmarks on virtual
devices (gloo ranks), directly and as scheduler jobs, with their reports and page."""

from __future__ import annotations

import csv
import io
import json
import sys

import pytest
from sqlmodel import Session, select

from conftest import REPO, main_here, run_cli, wait_for
from sae_dist.bench import summary as S
from sae_dist.contract import BENCH_WAIT_SCALE_ENV
from sae_dist.db import BenchmarkPoint, BenchmarkRun, get_engine

# The benchmark's fixed waits (the quiet before each point, the ceiling's common start) at a fifth:
# what these tests check is that each is measured and recorded, not how quiet or aligned it was.
QUICK_WAITS = {BENCH_WAIT_SCALE_ENV: "0.2"}
SMALL = ["--d-in", "32", "--expansion-factor", "4", "--k", "4", "--batch-size", "256", "--steps", "8",
         "--warmup", "2"]


def point(n, kind, tp, step, repeat=0, share=None, batch=1024, memory=100, grad=4_000_000):
    return {"devices": n, "kind": kind, "samples_per_s": tp, "step_s": step, "repeat": repeat,
            "comm_share": share, "per_device_batch": batch, "peak_memory": memory, "grad_bytes": grad,
            "mean_utilization_pct": None}


def test_summary_against_hand_computed_figures():
    rows = S.summarize([
        point(1, "ddp", 1000.0, 1.0), point(1, "ddp", 1200.0, 0.9, repeat=1),
        point(2, "ddp", 1980.0, 1.05, share=0.2, batch=512),
        point(2, "ddp", 2000.0, 1.0, repeat=1, share=0.3, batch=512),
        point(2, "ceiling", 2200.0, 0.9, batch=512),
    ])
    one, two = rows
    assert one["samples_per_s"] == 1100.0 and one["spread"] == pytest.approx(100 / 1100)
    assert one["ceiling_samples_per_s"] == 1100.0 and one["efficiency_vs_ceiling"] == 1.0
    assert two["samples_per_s"] == 1990.0
    assert two["speedup"] == pytest.approx(1990 / 1100)
    assert two["efficiency"] == pytest.approx(1990 / 1100 / 2)
    assert two["efficiency_vs_ceiling"] == pytest.approx(1990 / 2200)
    assert two["comm_share"] == pytest.approx(0.25)
    assert two["target_speedup"] == 1.8


def test_points_run_repeats_interleaved_across_device_counts():
    from sae_dist.bench.run import point_order

    assert point_order([1, 2], 2) == [(0, 1, "ddp"), (0, 2, "ddp"), (0, 2, "ceiling"),
                                      (1, 1, "ddp"), (1, 2, "ddp"), (1, 2, "ceiling")]
    assert point_order([1, 2, 4], 1) == [(0, 1, "ddp"), (0, 2, "ddp"), (0, 2, "ceiling"),
                                         (0, 4, "ddp"), (0, 4, "ceiling")]


def test_the_measured_table_gives_the_spread_of_repeats():
    from sae_dist.analytics.bench_tables import measured_table

    rows = S.summarize([point(1, "ddp", 1000.0, 1.0), point(1, "ddp", 1200.0, 0.9, repeat=1),
                        point(2, "ddp", 1980.0, 1.05, batch=512), point(2, "ddp", 2000.0, 1.0, repeat=1, batch=512),
                        point(2, "ceiling", 2200.0, 0.9, batch=512),
                        point(2, "ceiling", 2000.0, 0.9, repeat=1, batch=512)])
    one, two = measured_table(rows)
    assert one["Samples/s"] == "1,100 ± 9%" and two["Samples/s"] == "1,990 ± 1%"
    assert two["Ceiling samples/s"].startswith("2,100 ± ")
    single = measured_table(S.summarize([point(1, "ddp", 1000.0, 1.0)]))
    assert single[0]["Samples/s"] == "1,000"  # one repeat: no spread to give


def test_the_measured_table_in_parts_keeps_every_column_once():
    """The app shows the table in parts that fit its width: each led by the device count, every
    other column in exactly one part, "Why unreliable" only where a point has a reason."""
    from sae_dist.analytics.bench_tables import measured_parts, measured_table

    table = measured_table(S.summarize([point(1, "ddp", 1000.0, 1.0), point(2, "ddp", 1900.0, 1.05, batch=512)]))
    parts = measured_parts(table)
    assert all("Devices" in list(rows[0])[:2] for _, rows in parts)
    shown = [c for _, rows in parts for c in rows[0] if c != "Devices"]
    assert sorted(shown) == sorted(c for c in table[0] if c not in ("Devices", "Why unreliable"))
    assert [len(rows) for _, rows in parts] == [2, 2, 2]
    flagged = [dict(table[0], **{"Why unreliable": "superlinear"}), table[1]]
    assert "Why unreliable" in measured_parts(flagged)[-1][1][0]


@pytest.mark.parametrize("raw", ["fast", "0", "-1", "inf", "nan"])
def test_a_bad_wait_scale_knob_is_one_error_before_any_point(raw, tmp_path):
    result = main_here("bench", "--devices", "1", "--no-queue", *SMALL,
                       env={BENCH_WAIT_SCALE_ENV: raw, "SAE_DIST_HOME": str(tmp_path / "home")})
    assert result.returncode == 2, result.stderr
    assert f"{BENCH_WAIT_SCALE_ENV}={raw!r}: give a positive number such as 0.2" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "home" / "state.db").exists()


def test_projection_from_the_one_device_row():
    rows = S.summarize([point(1, "ddp", 1024.0, 0.01, batch=1024, grad=32_000_000)])
    label, bandwidth = S.link_bandwidth("pcie4")
    assert "PCIe 4" in label and bandwidth == 32e9
    two = S.projection_rows(rows, "strong", bandwidth)[0]
    # all-reduce: 2 * 1/2 * 32 MB / 32 GB/s = 1 ms; compute 5 ms; no overlap 6 ms, overlap 5 ms.
    assert two["allreduce_s"] == pytest.approx(0.001)
    assert two["speedup_no_overlap"] == pytest.approx(0.01 / 0.006)
    assert two["speedup_overlap"] == pytest.approx(2.0)
    assert two["break_even_batch"] == pytest.approx(1024 * 0.001 / 0.01)
    assert S.link_bandwidth("18.5") == ("measured all-reduce bandwidth 18.5 GB/s", 18.5e9)
    with pytest.raises(ValueError, match="choose one of"):
        S.link_bandwidth("fast")
    with pytest.raises(ValueError, match="positive"):
        S.link_bandwidth("-3")
    with pytest.raises(ValueError, match="measured no all-reduce"):
        S.link_bandwidth("here", rows)
    two_rows = [*rows, {"devices": 2, "allreduce_bytes_per_s": 3e9}, {"devices": 4, "allreduce_bytes_per_s": 2e9}]
    assert S.link_bandwidth("here", two_rows)[1] == 2e9  # the largest device count's
    assert S.projection_rows([], "strong", bandwidth) == []


def bench_rows(bench_id: int, engine=None):
    with Session(engine or get_engine()) as s:
        run = s.get(BenchmarkRun, bench_id)
        points = s.exec(select(BenchmarkPoint).where(BenchmarkPoint.bench_id == bench_id)).all()
        return run.model_dump(), [p.model_dump() for p in points]


@pytest.fixture(scope="module")
def direct_bench(tmp_path_factory):
    """One direct 1,2-device benchmark, run once for the tests that check its rows, its reports
    and its page, in a state home of its own. One repeat: how repeats interleave is
    point_order's (tested above, and the run follows it), their spread the table's."""
    home = tmp_path_factory.mktemp("direct-bench") / "home"
    result = run_cli("bench", "--devices", "1,2", "--no-queue", "--repeats", "1", *SMALL, timeout=400,
                     env={"SAE_DIST_HOME": str(home), "SAE_DIST_DB_URL": "", **QUICK_WAITS})  # its SQLite file
    assert result.returncode == 0, result.stderr
    run, points = bench_rows(1, get_engine(f"sqlite:///{home / 'state.db'}"))
    rows = S.summarize(points)
    median = {key: S.scaling.median([p[key[2]] for p in points if (p["devices"], p["kind"]) == key[:2]])
              for key in ((1, "ddp", "samples_per_s"), (2, "ddp", "samples_per_s"), (2, "ceiling", "samples_per_s"),
                          (2, "ddp", "allreduce_bytes_per_s"))}
    return {"home": home, "run": run, "points": points, "rows": rows, "median": median,
            "verdict": {r["devices"]: r for r in rows}}


@pytest.fixture
def in_bench_home(direct_bench, monkeypatch):
    """This test reads and reports the shared benchmark's state home."""
    monkeypatch.setenv("SAE_DIST_HOME", str(direct_bench["home"]))
    return direct_bench


@pytest.mark.slow
def test_direct_benchmark_writes_its_rows(direct_bench):
    run, points, rows, verdict = (direct_bench[k] for k in ("run", "points", "rows", "verdict"))
    assert run["status"] == "COMPLETED" and run["virtual"] and run["backend"] == "gloo" and run["repeats"] == 1
    # the points in point_order's order: 1, then 2 as DDP and as its ceiling
    order = [(p["devices"], p["kind"], p["repeat"]) for p in sorted(points, key=lambda p: p["id"])]
    assert order == [(1, "ddp", 0), (2, "ddp", 0), (2, "ceiling", 0)]
    assert [p["created_at"] for p in sorted(points, key=lambda p: p["id"])] == sorted(p["created_at"] for p in points)
    by = {(p["devices"], p["kind"], p["repeat"]): p for p in points}
    assert by[(1, "ddp", 0)]["per_device_batch"] == 256 and by[(2, "ddp", 0)]["per_device_batch"] == 128  # strong
    assert 0 <= by[(2, "ddp", 0)]["comm_share"] <= 1 and by[(1, "ddp", 0)]["comm_share"] is None
    assert by[(2, "ddp", 0)]["grad_bytes"] == (32 * 128 * 2 + 128 + 32) * 4  # W_enc, W_dec, b_enc, b_dec
    assert all(p["samples_per_s"] > 0 and p["mean_utilization_pct"] is None for p in points)
    assert by[(2, "ddp", 0)]["allreduce_bytes_per_s"] > 0 and by[(1, "ddp", 0)]["allreduce_bytes_per_s"] is None
    # every point recorded the machine's other load before and while it ran, and its verdict
    for p in points:
        load = json.loads(p["other_load_json"])
        assert load["cores"] >= 1 and "gpu" not in load and load["jobs"] == []
        assert load["cpu"]["before"]["other_cpu_pct"] >= 0 and load["cpu"]["during"]["other_cpu_pct"] >= 0
        assert p["reliable"] == verdict[p["devices"]]["reliable"] and p["reason"] == verdict[p["devices"]]["reason"]
        assert p["reliable"] or p["reason"]


@pytest.mark.slow
def test_direct_benchmark_csv_report(direct_bench, tmp_path):
    """csv: the figures of the database, per device count, with the verdict (a real `report` process)."""
    rows, median = direct_bench["rows"], direct_bench["median"]
    out = run_cli("report", "1", "--format", "csv", "-o", str(tmp_path / "r.csv"),
                  env={"SAE_DIST_HOME": str(direct_bench["home"]), "SAE_DIST_DB_URL": ""})
    assert out.returncode == 0, out.stderr
    table = list(csv.DictReader(io.StringIO((tmp_path / "r.csv").read_text())))
    assert [r["devices"] for r in table] == ["1", "2"] and [r["repeats"] for r in table] == ["1", "1"]
    assert float(table[1]["samples_per_s"]) == pytest.approx(median[(2, "ddp", "samples_per_s")])
    assert float(table[1]["speedup"]) == pytest.approx(median[(2, "ddp", "samples_per_s")]
                                                       / median[(1, "ddp", "samples_per_s")])
    assert float(table[1]["ceiling_samples_per_s"]) == pytest.approx(median[(2, "ceiling", "samples_per_s")])
    assert [r["reliable"] for r in table] == [str(r["reliable"]).lower() for r in rows]
    assert [r["reason"] for r in table] == [r["reason"] or "" for r in rows]


@pytest.mark.slow
def test_direct_benchmark_md_and_html_reports(in_bench_home, tmp_path, monkeypatch, capsys):
    """md and html: the same figures, the model, the chart, and a warning when something is
    unreliable (`report` called in-process: the csv test runs it as a process)."""
    from sae_dist.cli import main

    rows, median = in_bench_home["rows"], in_bench_home["median"]
    assert main(["report", "1", "--format", "md", "-o", str(tmp_path / "r.md")]) == 0
    md = (tmp_path / "r.md").read_text()
    (tmp_path / "empty").mkdir()
    assert f"| {median[(2, 'ddp', 'samples_per_s')]:,.0f} |" in md and "2(N-1)/N" in md and "```vega-lite" in md
    assert "virtual (CPU-backed)" in md and "## Other load, point by point" in md
    assert ("> **Warning:**" in md) == (not all(r["reliable"] for r in rows))
    json.loads(md.split("```vega-lite\n")[1].split("\n```")[0])  # a valid embedded spec
    assert main(["report", "1", "--format", "html", "-o", str(tmp_path / "r.html"), "--link", "25"]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "vegaEmbed(\"#speedup\"" in page and "measured all-reduce bandwidth 25 GB/s" in page
    # Without -o the report is the command's output, as a tool's is; no file is written.
    monkeypatch.chdir(tmp_path / "empty")
    capsys.readouterr()
    assert main(["report", "1"]) == 0 and not any((tmp_path / "empty").iterdir())
    assert capsys.readouterr().out == md
    assert main(["report", "1", "-o", str(tmp_path / "here.md"), "--link", "here"]) == 0
    gbps = median[(2, "ddp", "allreduce_bytes_per_s")] / 1e9
    assert f"all-reduce measured here on 2 devices ({gbps:.2f} GB/s)" in (tmp_path / "here.md").read_text()


@pytest.mark.slow
def test_direct_benchmark_page(in_bench_home):
    """The app's page renders it, alone and side by side, with a measured link; the shared
    machine may well have been busy: the page says so exactly when the rows say so."""
    from streamlit.testing.v1 import AppTest

    rows, verdict = in_bench_home["rows"], in_bench_home["verdict"]
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=60)
    at.run()
    at.switch_page("pages/5_Benchmarks.py").run()
    assert not at.exception
    assert any("Benchmark 1 (" in c.value for c in at.caption)
    assert any(w.value.startswith("- 1 device") or w.value.startswith("- 2 devices") for w in at.warning) == (
        not all(r["reliable"] for r in rows))
    at.segmented_control(key="bench_link").set_value("measured").run()
    baseline_ok = verdict[1]["reliable"]
    assert not at.exception and any(("Break-even" if baseline_ok else "No projection: the 1-device point is unreliable")
                                     in c.value for c in at.caption)
    at.segmented_control(key="bench_link").set_value("here").run()
    assert not at.exception and any("measured here on 2 devices" in m.value for m in at.markdown)


@pytest.mark.slow
def test_queued_benchmark_runs_each_point_as_a_job(monkeypatch):
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "2")
    monkeypatch.setenv(BENCH_WAIT_SCALE_ENV, QUICK_WAITS[BENCH_WAIT_SCALE_ENV])  # the daemon's jobs inherit it
    try:
        result = run_cli("bench", "--devices", "2", "--mode", "weak", "--repeats", "1", *SMALL, timeout=300)
        assert result.returncode == 0, result.stderr
    finally:
        stop_daemon()
    run, points = bench_rows(1)
    assert run["queued"] and run["mode"] == "weak" and run["status"] == "COMPLETED"
    assert {p["per_device_batch"] for p in points} == {256}  # weak: each device keeps its batch
    assert all(p["job_id"] is not None for p in points)
    listing = run_cli("queue", "--all", "--json", module="scheduler")
    jobs = {j["name"]: j for j in json.loads(listing.stdout)}
    assert {"bench-1-1-ddp-0", "bench-1-2-ddp-0", "bench-1-2-ceiling-0"} <= set(jobs)
    assert all(j["state"] == "COMPLETED" for j in jobs.values())
    assert jobs["bench-1-2-ddp-0"]["gpus"] == 2
    # each point ran alone: an exclusive job, with no other job seen while it ran
    assert all(jobs[f"bench-1-{tag}-0"]["exclusive"] for tag in ("1-ddp", "2-ddp", "2-ceiling"))
    for p in points:
        load = json.loads(p["other_load_json"])
        assert load["jobs"] == [] and load["cpu"]["during"]["other_cpu_pct"] >= 0
    # the daemon sampled the devices while the points ran
    assert any(p["mean_utilization_pct"] is not None for p in points)


@pytest.mark.slow
def test_a_point_that_cannot_get_the_machine_alone_stops_the_benchmark(monkeypatch):
    """Another job holds the machine: the exclusive point waits --start-within seconds, then the
    benchmark ends with one line naming what held it, and its own job is cancelled."""
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "2")
    monkeypatch.setenv(BENCH_WAIT_SCALE_ENV, QUICK_WAITS[BENCH_WAIT_SCALE_ENV])
    sleeper = None
    try:
        sub = run_cli("submit", "-J", "other-training", "--gpus", "1", "--json", "--", sys.executable, "-c",
                      "import time; time.sleep(600)", module="scheduler")
        assert sub.returncode == 0, sub.stderr
        sleeper = json.loads(sub.stdout)["job_id"]

        def jobs():
            return {j["job_id"]: j for j in json.loads(run_cli("queue", "--all", "--json", module="scheduler").stdout)}

        # Waited on in the database (a `queue` process a poll would take the cores the daemon needs);
        # the listing below is still the real `queue` process's.
        from scheduler.store import get_job

        wait_for(lambda: get_job(get_engine(), sleeper).state == "RUNNING", timeout=60, what="the other job to run")
        user = jobs()[sleeper]["user"]
        assert user
        result = run_cli("bench", "--devices", "1", "--repeats", "1", "--start-within", "3", *SMALL, timeout=120)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("error: benchmark point 1-1-ddp-0 could not get the machine alone within 3 s "
                                   f"(held by job {sleeper} 'other-training' (user {user}))"), lines[0]
        run, points = bench_rows(1)
        assert run["status"] == "FAILED" and f"held by job {sleeper} 'other-training'" in run["error"] and not points
        after = jobs()
        assert after[sleeper]["state"] == "RUNNING"  # the other job is left alone
        mine = next(j for j in after.values() if j["name"] == "bench-1-1-ddp-0")
        assert mine["state"] == "CANCELLED" and mine["exclusive"]
    finally:
        if sleeper is not None:
            scheduler_main(["cancel", str(sleeper)])
        stop_daemon()


def scheduler_main(argv: list[str]) -> int:
    """The scheduler's CLI in this process: the clean-up after a queued benchmark (a process each
    took the cores the rest of the run shares)."""
    from scheduler.cli import main

    return main(argv)


def stop_daemon() -> None:
    """`daemon --stop`, in this process: the daemon `bench` started ends, not its jobs."""
    scheduler_main(["daemon", "--stop"])


BAD_ARGUMENTS = [
    (["--devices", "0"], "--devices '0': give device counts of 1 or more"),
    (["--devices", "a,b"], "--devices 'a,b': give device counts separated by commas"),
    (["--devices", "1,3", "--batch-size", "1024"], "choose a batch size divisible by 3"),
    (["--devices", "1", "--steps", "0"], "--steps 0: must be 1 or more"),
    (["--devices", "1", "--warmup", "-1"], "--warmup -1: must be 0 or more"),
    (["--devices", "1", "--repeats", "0"], "--repeats 0: must be 1 or more"),
    (["--devices", "1", "--start-within", "0"], "--start-within 0: must be more than 0 seconds"),
    (["--devices", "1", "--k", "0"], "k"),
]


def assert_nothing_stored() -> None:
    with Session(get_engine()) as s:
        assert s.exec(select(BenchmarkRun)).first() is None


@pytest.mark.slow
def test_a_bad_bench_argument_is_one_line_from_a_real_process():
    args, message = BAD_ARGUMENTS[0]
    result = run_cli("bench", "--no-queue", *args, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert_nothing_stored()


@pytest.mark.parametrize("args, message", BAD_ARGUMENTS)
def test_bad_bench_arguments_are_one_line_and_store_nothing(args, message, capsys):
    """Every bad argument, through the CLI's main in-process (the test above runs one as a process)."""
    from sae_dist.cli import main

    assert main(["bench", "--no-queue", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert_nothing_stored()


@pytest.mark.slow
def test_report_of_a_missing_benchmark_or_a_bad_link(cli):
    """Through the CLI's main in-process (the csv test runs `report` as a process)."""
    code, _, err = cli("report", "7")
    assert code == 2 and "no benchmark 7" in err
    with Session(get_engine()) as s:
        s.add(BenchmarkRun(name="b", mode="strong", device_counts="[1]", config_json="{}", steps=1, warmup_steps=0,
                           repeats=1, queued=False, device_kind="cpu", device_names="[]", virtual=True,
                           backend="gloo", torch_version="x", host="h"))
        s.commit()
    code, _, err = cli("report", "1", "--link", "fast")
    assert code == 2 and err.startswith("error: --link: link 'fast'")
