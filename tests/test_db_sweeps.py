"""The sweeps table and its SAEs' runs, on a real migrated SQLite database."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sae_dist.db import create_run, get_engine, utcnow
from sae_dist.db.sweeps import create_sweep, find_sweep_by_dir, get_sweep, list_sweeps, sweep_runs, update_sweep


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SAE_DIST_HOME", str(tmp_path))
    monkeypatch.delenv("SAE_DIST_DB_URL", raising=False)
    engine = get_engine()
    yield engine
    engine.dispose()


def _sweep(engine, run_dir: str = "/runs/s1", **fields) -> int:
    return create_sweep(engine, name="s1", run_dir=run_dir, keys_json=json.dumps(["k"]),
                        config_json=json.dumps({"steps": 10}), world_size=2, **fields)


def _run(engine, sweep_id: int | None, point: str | None) -> int:
    return create_run(engine, name=point or "alone", architecture="topk", config_json="{}", world_size=1,
                      backend="gloo", device_ids="[]", host="h", run_dir=f"/runs/s1/saes/{point}", total_steps=10,
                      sweep_id=sweep_id, sweep_point=point)


def test_a_sweep_and_its_saes(engine):
    sweep_id = _sweep(engine)
    ids = [_run(engine, sweep_id, p) for p in ("k16", "k32")]
    _run(engine, None, None)  # a run of its own is no sweep's
    assert [r.id for r in sweep_runs(engine, sweep_id)] == ids
    assert [r.sweep_point for r in sweep_runs(engine, sweep_id)] == ["k16", "k32"]
    sweep = get_sweep(engine, sweep_id)
    assert sweep.status == "RUNNING" and sweep.created_at.tzinfo is not None
    update_sweep(engine, sweep_id, status="COMPLETED", finished_at=utcnow(), placement_json='{"mode": "shared"}')
    again = find_sweep_by_dir(engine, "/runs/s1")
    assert again.id == sweep_id and again.status == "COMPLETED" and json.loads(again.placement_json)["mode"] == "shared"
    assert [s.id for s in list_sweeps(engine)] == [sweep_id]


def test_the_latest_sweep_of_a_directory_and_the_newest_first(engine):
    first, second = _sweep(engine), _sweep(engine)
    other = _sweep(engine, run_dir="/runs/other")
    assert find_sweep_by_dir(engine, "/runs/s1").id == second
    assert find_sweep_by_dir(engine, "/runs/none") is None
    assert [s.id for s in list_sweeps(engine)] == [other, second, first]


@pytest.mark.parametrize("fields, message", [
    ({"stauts": "RUNNING"}, "not columns of sweeps: stauts"),
    ({"status": "DONE"}, "sweep status 'DONE'"),
])
def test_bad_fields_are_refused_before_any_sql(engine, fields, message):
    sweep_id = _sweep(engine)
    with pytest.raises(ValueError, match=message):
        update_sweep(engine, sweep_id, **fields)
    with pytest.raises(ValueError, match=message):
        _sweep(engine, **fields)
    assert get_sweep(engine, sweep_id).status == "RUNNING"  # nothing stored was changed


def test_updating_a_missing_sweep_names_it(engine):
    with pytest.raises(LookupError, match="no sweep with id 99"):
        update_sweep(engine, 99, status="FAILED")
