"""Scaling benchmarks: the summary from plain rows, and real 1,2-device benchmarks on virtual
devices (gloo ranks), directly and as scheduler jobs, with their reports and page."""

from __future__ import annotations

import csv
import io
import json

import pytest
from sqlmodel import Session, select

from conftest import REPO, run_cli
from sae_dist.bench import summary as S
from sae_dist.db import BenchmarkPoint, BenchmarkRun, get_engine

SMALL = ["--d-in", "32", "--expansion-factor", "4", "--k", "4", "--batch-size", "256", "--steps", "8",
         "--warmup", "2"]


def point(n, kind, tp, step, repeat=0, share=None, batch=1024, memory=100, grad=4_000_000):
    return {"devices": n, "kind": kind, "samples_per_s": tp, "step_s": step, "repeat": repeat,
            "comm_share": share, "per_device_batch": batch, "peak_memory": memory, "grad_bytes": grad,
            "mean_utilization_pct": None}


def test_summary_against_hand_computed_figures():
    rows = S.summarize([
        point(1, "ddp", 1000.0, 1.0), point(1, "ddp", 1200.0, 0.9, repeat=1),
        point(2, "ddp", 1980.0, 1.05, share=0.2, batch=512), point(2, "ddp", 2000.0, 1.0, repeat=1, share=0.3, batch=512),
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


def bench_rows(bench_id: int):
    with Session(get_engine()) as s:
        run = s.get(BenchmarkRun, bench_id)
        points = s.exec(select(BenchmarkPoint).where(BenchmarkPoint.bench_id == bench_id)).all()
        return run.model_dump(), [p.model_dump() for p in points]


@pytest.mark.slow
def test_direct_benchmark_writes_rows_reports_and_page(tmp_path):
    result = run_cli("bench", "--devices", "1,2", "--no-queue", *SMALL, timeout=300)
    assert result.returncode == 0, result.stderr
    run, points = bench_rows(1)
    assert run["status"] == "COMPLETED" and run["virtual"] and run["backend"] == "gloo"
    assert sorted((p["devices"], p["kind"]) for p in points) == [(1, "ddp"), (2, "ceiling"), (2, "ddp")]
    by = {(p["devices"], p["kind"]): p for p in points}
    assert by[(1, "ddp")]["per_device_batch"] == 256 and by[(2, "ddp")]["per_device_batch"] == 128  # strong
    assert 0 <= by[(2, "ddp")]["comm_share"] <= 1 and by[(1, "ddp")]["comm_share"] is None
    assert by[(2, "ddp")]["grad_bytes"] == (32 * 128 * 2 + 128 + 32) * 4  # W_enc, W_dec, b_enc, b_dec
    assert all(p["samples_per_s"] > 0 and p["mean_utilization_pct"] is None for p in points)
    assert by[(2, "ddp")]["allreduce_bytes_per_s"] > 0 and by[(1, "ddp")]["allreduce_bytes_per_s"] is None

    # csv: the figures of the database, per device count
    out = run_cli("report", "1", "--format", "csv", "-o", str(tmp_path / "r.csv"))
    assert out.returncode == 0, out.stderr
    table = list(csv.DictReader(io.StringIO((tmp_path / "r.csv").read_text())))
    assert [r["devices"] for r in table] == ["1", "2"]
    assert float(table[1]["samples_per_s"]) == pytest.approx(by[(2, "ddp")]["samples_per_s"])
    assert float(table[1]["speedup"]) == pytest.approx(by[(2, "ddp")]["samples_per_s"] / by[(1, "ddp")]["samples_per_s"])
    assert float(table[1]["ceiling_samples_per_s"]) == pytest.approx(by[(2, "ceiling")]["samples_per_s"])
    # md and html: the same figures, the model, and the chart
    assert run_cli("report", "1", "--format", "md", "-o", str(tmp_path / "r.md")).returncode == 0
    md = (tmp_path / "r.md").read_text()
    assert f"{by[(2, 'ddp')]['samples_per_s']:,.0f}" in md and "2(N-1)/N" in md and "```vega-lite" in md
    assert "virtual (CPU-backed)" in md
    json.loads(md.split("```vega-lite\n")[1].split("\n```")[0])  # a valid embedded spec
    assert run_cli("report", "1", "--format", "html", "-o", str(tmp_path / "r.html"), "--link", "25").returncode == 0
    page = (tmp_path / "r.html").read_text()
    assert "vegaEmbed(\"#speedup\"" in page and "measured all-reduce bandwidth 25 GB/s" in page
    assert run_cli("report", "1", "-o", str(tmp_path / "here.md"), "--link", "here").returncode == 0
    gbps = by[(2, "ddp")]["allreduce_bytes_per_s"] / 1e9
    assert f"all-reduce measured here on 2 devices ({gbps:.2f} GB/s)" in (tmp_path / "here.md").read_text()

    # the app's page renders it, alone and side by side, with a measured link
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=60)
    at.run()
    at.switch_page("pages/5_Benchmarks.py").run()
    assert not at.exception
    assert any("Benchmark 1 (" in c.value for c in at.caption)
    at.segmented_control(key="bench_link").set_value("measured").run()
    assert not at.exception and any("Break-even" in c.value for c in at.caption)
    at.segmented_control(key="bench_link").set_value("here").run()
    assert not at.exception and any("measured here on 2 devices" in m.value for m in at.markdown)


@pytest.mark.slow
def test_queued_benchmark_runs_each_point_as_a_job(monkeypatch):
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "2")
    try:
        result = run_cli("bench", "--devices", "2", "--mode", "weak", *SMALL, timeout=300)
        assert result.returncode == 0, result.stderr
    finally:
        run_cli("daemon", "--stop", module="scheduler", timeout=60)
    run, points = bench_rows(1)
    assert run["queued"] and run["mode"] == "weak" and run["status"] == "COMPLETED"
    assert {p["per_device_batch"] for p in points} == {256}  # weak: each device keeps its batch
    assert all(p["job_id"] is not None for p in points)
    listing = run_cli("queue", "--all", "--json", module="scheduler")
    jobs = {j["name"]: j for j in json.loads(listing.stdout)}
    assert {"bench-1-1-ddp-0", "bench-1-2-ddp-0", "bench-1-2-ceiling-0"} <= set(jobs)
    assert all(j["state"] == "COMPLETED" for j in jobs.values())
    assert jobs["bench-1-2-ddp-0"]["gpus"] == 2
    # the daemon sampled the devices while the points ran
    assert any(p["mean_utilization_pct"] is not None for p in points)


@pytest.mark.parametrize("args, message", [
    (["--devices", "0"], "--devices '0': give device counts of 1 or more"),
    (["--devices", "a,b"], "--devices 'a,b': give device counts separated by commas"),
    (["--devices", "1,3", "--batch-size", "1024"], "choose a batch size divisible by 3"),
    (["--devices", "1", "--steps", "0"], "--steps 0: must be 1 or more"),
    (["--devices", "1", "--warmup", "-1"], "--warmup -1: must be 0 or more"),
    (["--devices", "1", "--repeats", "0"], "--repeats 0: must be 1 or more"),
    (["--devices", "1", "--k", "0"], "k"),
])
def test_bad_bench_arguments_are_one_line_and_store_nothing(args, message):
    result = run_cli("bench", "--no-queue", *args, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    with Session(get_engine()) as s:
        assert s.exec(select(BenchmarkRun)).first() is None


def test_report_of_a_missing_benchmark_or_a_bad_link():
    missing = run_cli("report", "7")
    assert missing.returncode == 2 and "no benchmark 7" in missing.stderr
    with Session(get_engine()) as s:
        s.add(BenchmarkRun(name="b", mode="strong", device_counts="[1]", config_json="{}", steps=1, warmup_steps=0,
                           repeats=1, queued=False, device_kind="cpu", device_names="[]", virtual=True,
                           backend="gloo", torch_version="x", host="h"))
        s.commit()
    bad = run_cli("report", "1", "--link", "fast")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --link: link 'fast'")
