"""A run as one file to keep or share (sae_dist/analytics/run_export.py): its config, metrics,
events and evaluation as JSON, its SAE folder as a zip; and the Training runs page's downloads."""

from __future__ import annotations

import io
import json
import zipfile

import pytest
from streamlit.testing.v1 import AppTest

from conftest import REPO
from sae_dist.analytics import run_export
from sae_dist.db import get_engine, update_run
from sae_dist.db.evaluations import record_evaluation
from test_app import add_run


@pytest.fixture
def run(state_home, tmp_path):
    engine = get_engine()
    run_id = add_run(engine, "shared-run", "COMPLETED", list(range(10, 101, 10)), 100)
    sae = tmp_path / "run" / "sae"
    sae.mkdir(parents=True)
    (sae / "cfg.json").write_text('{"d_in": 16}')
    (sae / "sae_weights.safetensors").write_bytes(b"\0" * 64)
    update_run(engine, run_id, export_dir=str(sae))
    density = {"edges": [-2.0, -1.0, 0.0], "counts": [3, 5], "never": 0}
    record_evaluation(engine, {"rows": 4096, "fvu": float("nan"), "l0": 3.5, "density": density}, str(sae), "/d",
                      run_id=run_id, where="heldout")
    return {"engine": engine, "id": run_id, "sae": sae}


def test_a_run_is_one_json_file_with_its_config_metrics_and_evaluation(run):
    record = json.loads(run_export.record_json(run_export.run_record(run["engine"], run["id"])))
    assert record["format"] == run_export.FORMAT
    assert record["run"]["name"] == "shared-run" and record["run"]["config"]["k"] == 4
    assert record["metrics"]["step"] == list(range(10, 101, 10)) and len(record["metrics"]["fvu"]) == 10
    assert record["evaluation"]["l0"] == 3.5 and record["evaluation"]["fvu"] is None  # NaN: not a number to JSON
    assert isinstance(record["run"]["started_at"], str)  # times as ISO 8601
    assert run_export.run_record(run["engine"], 999) is None


def test_a_run_s_sae_is_a_zip_of_its_folder(run, tmp_path):
    archive = zipfile.ZipFile(io.BytesIO(run_export.sae_archive(str(run["sae"]))))
    assert sorted(archive.namelist()) == ["sae/cfg.json", "sae/sae_weights.safetensors"]
    assert archive.read("sae/cfg.json") == b'{"d_in": 16}'
    assert run_export.sae_archive(str(tmp_path / "gone")) is None and run_export.sae_archive(None) is None
    assert run_export.file_stem("a b/c", 7) == "run-7-a_b_c"


def test_the_training_runs_page_offers_both_downloads(run, monkeypatch):
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=30).run()
    at.query_params["run"] = str(run["id"])
    at.switch_page("pages/4_Training_runs.py").run()
    assert not at.exception
    labels = [b.proto.label for b in at.get("download_button")]
    assert labels == ["Run as JSON", "SAE as zip"]
