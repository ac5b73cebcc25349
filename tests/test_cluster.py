"""The SLURM cluster's answers, parsed (plain text in, states out), and the app's cluster table.
The real cluster runs in tests/test_slurm.py."""

from __future__ import annotations

import json

import pytest
from sqlmodel import Session

from sae_dist.db import ClusterJob, get_engine, utcnow
from sae_dist.errors import UserError
from scheduler.cluster import parse_cluster_id, parse_sacct, parse_squeue_json
from test_app_monitor_queue import open_page

# What squeue --json printed on the one-node test cluster (slurm-wlm 22.05), trimmed.
SQUEUE_2205 = json.dumps({"meta": {"plugin": {"type": "openapi/v0.0.38"}}, "jobs": [
    {"job_id": 12, "name": "x", "job_state": "COMPLETED", "exit_code": 0, "start_time": 1763900000,
     "end_time": 1763900010},
    {"job_id": 13, "name": "y", "job_state": "FAILED", "exit_code": 768, "start_time": 1763900000, "end_time": 0},
    {"job_id": 14, "name": "z", "job_state": "CANCELLED", "exit_code": 15, "start_time": 0, "end_time": 0}]})
# Newer versions: states are lists of flags, numbers are {set, number} objects.
SQUEUE_2405 = json.dumps({"jobs": [
    {"job_id": 20, "job_state": ["RUNNING"], "exit_code": {"return_code": {"set": True, "number": 0},
                                                           "signal": {"id": {"set": False, "number": 0}}},
     "start_time": {"set": True, "number": 1763900000}, "end_time": {"set": True, "number": 0}}]})


def test_squeue_json_of_two_versions():
    states = parse_squeue_json(SQUEUE_2205)
    assert (states["12"].state, states["12"].exit_code, states["12"].signal) == ("COMPLETED", 0, None)
    assert states["12"].ended_at.timestamp() == 1763900010
    assert (states["13"].exit_code, states["13"].signal, states["13"].ended_at) == (3, None, None)  # 768 = exit 3
    assert (states["14"].exit_code, states["14"].signal) == (0, 15)  # killed by SIGTERM
    new = parse_squeue_json(SQUEUE_2405)["20"]
    assert (new.state, new.exit_code, new.started_at.timestamp()) == ("RUNNING", 0, 1763900000)


def test_sacct_parsable_lines():
    text = "12|COMPLETED|0:0\n12.batch|COMPLETED|0:0\n13|CANCELLED by 0|0:15\n14|FAILED|3:0\n"
    states = parse_sacct(text)
    assert sorted(states) == ["12", "13", "14"]  # steps skipped
    assert (states["13"].state, states["13"].signal) == ("CANCELLED", 15)
    assert (states["14"].state, states["14"].exit_code) == ("FAILED", 3)


def test_cluster_ids():
    assert parse_cluster_id("slurm:1234") == "1234"
    assert parse_cluster_id("17") is None
    with pytest.raises(UserError, match="slurm:<SLURM job id>"):
        parse_cluster_id("slurm:x")


def test_the_queue_page_shows_cluster_jobs(state_home, monkeypatch):
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "2")
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")  # no daemon from the page
    with Session(get_engine()) as session:
        session.add(ClusterJob(cluster="slurm", cluster_job_id="4242", name="far-away", user="me", kind="train",
                               workdir="/tmp", script_path="/tmp/x.sbatch", state="COMPLETED", exit_code=0,
                               ended_at=utcnow()))
        session.commit()
    at = open_page("pages/3_Queue.py")
    assert any(s.value == "On the SLURM cluster" for s in at.subheader)
    table = next(d for d in at.dataframe if "slurm:4242" in d.value.to_string())
    assert "far-away" in table.value.to_string() and "COMPLETED" in table.value.to_string()
