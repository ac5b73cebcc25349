"""The GPU check (scripts/gpu_check.sh): its verdict and its fit to the device tool's limits as
pure functions, and its rehearsal here, which runs every step that needs no CUDA the way the
GPU machine runs them (the carried wheels installed for CPython 3.12, each step a process under
its own time limit) and says which steps were left for the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts" / "gpu_check"))

from travel import BACK_FILES, MIB, back_problems, travel_problems  # noqa: E402
from verdict import Row, detail_of, exit_code, markdown, to_json, verdict_of  # noqa: E402


def test_a_steps_verdict_comes_from_how_its_process_ended():
    assert [verdict_of(0, False), verdict_of(1, False), verdict_of(3, False), verdict_of(-9, True)] == \
        ["PASS", "FAIL", "SKIP", "TIMEOUT"]
    assert verdict_of(0, True) == "TIMEOUT"  # killed at its limit, whatever it returned


def test_the_detail_is_the_last_line_that_says_something_shortened():
    assert detail_of("first\n\nsummary: 3 of 3\n  \n") == "summary: 3 of 3"
    assert detail_of("") == "(no output)"
    long = detail_of("x" * 1000)
    assert len(long) == 240 and long.endswith("…")


def test_the_table_escapes_pipes_and_a_skip_fails_nothing():
    rows = [Row("machine", "PASS", 11.4, "NVIDIA H200"), Row("two GPUs", "SKIP", None, "needs 2 GPUs"),
            Row("bench", "PASS", 34.0, "| floor | 0.54 |")]
    text = markdown(rows, {"gpu": "NVIDIA H200, 143771 MiB", "torch": "2.11.0"})
    assert "- gpu: NVIDIA H200, 143771 MiB" in text and "- verdicts: 2 PASS, 1 SKIP" in text
    assert "| machine | PASS | 11 s | NVIDIA H200 |" in text and "| two GPUs | SKIP | - | needs 2 GPUs |" in text
    assert "\\| floor \\| 0.54 \\|" in text  # a detail's pipes do not break the table
    assert exit_code(rows) == 0 and json.loads(to_json(rows, {}))["passed"] is True
    for bad in ("FAIL", "TIMEOUT"):
        failing = rows + [Row("x", bad, 1.0, "")]
        assert exit_code(failing) == 1 and json.loads(to_json(failing, {}))["passed"] is False


def test_what_travels_and_comes_back_must_fit_the_device_tools_limits():
    assert travel_problems(3 * MIB, 21 * MIB) == []
    [over] = travel_problems(20 * MIB, 45 * MIB)
    assert "65.0 MiB would travel" in over
    assert back_problems({"verdict.md": 100, "verdict.json": 100, "logs.tar.gz": MIB}) == []
    many = {f"f{i}": 1 for i in range(BACK_FILES + 1)}
    assert back_problems(many) == [f"{BACK_FILES + 1} files in OUT, at most {BACK_FILES} come back"]
    assert back_problems({"a/b/c/deep.log": 1}) == ["a/b/c/deep.log: more than 2 folders down"]
    assert back_problems({"big.tar.gz": 17 * MIB}) == ["big.tar.gz: 17.0 MiB, over 16 MiB a file"]


def test_bench_step_reads_its_shapes_and_refuses_a_bad_one():
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_step import parse_shapes

    assert parse_shapes("768x24576x32, 4096X65536x64") == [(768, 24576, 32), (4096, 65536, 64)]
    for bad in ("768x24576", "0x10x1", "8x16x32", "axbxc"):
        with pytest.raises(SystemExit, match="--shapes"):
            parse_shapes(bad)


def test_the_rehearsal_runs_every_step_that_needs_no_cuda_and_names_the_rest(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_SITE": str(tmp_path / "site"), "PYTHON": sys.executable}
    done = subprocess.run(["scripts/gpu_check.sh", "--rehearse"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    verdict = json.loads((out / "verdict.json").read_text())
    rows = {r["step"]: r for r in verdict["steps"]}
    ran = {name for name, r in rows.items() if r["verdict"] == "PASS"}
    assert ran == {"machine and imports", "training through the daemon", "NCCL one-rank group",
                   "memory estimate vs measured", "bench_step fp32", "bench_step bf16", "app: Overview and Monitor",
                   "sharing and preemption"}
    left = {name: r["detail"] for name, r in rows.items() if r["verdict"] == "SKIP"}
    assert set(left) == {"tests marked cuda", "a stranger makes the GPU busy", "daemon sampling the real driver",
                         "two GPUs: NCCL scaling 1,2"}
    assert all(detail.startswith("left for the GPU: ") for detail in left.values()), left
    assert "the carried wheels install for CPython 3.12 manylinux" in done.stdout
    assert "travels:" in done.stdout and "over the device's limits" not in done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "verdict.json", "verdict.md"]
    assert "| training through the daemon | PASS |" in (out / "verdict.md").read_text()
