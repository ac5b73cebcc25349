"""The order test files are handed to the workers: the heaviest first, so the last ones handed out
are light and the two workers finish close together (longest-first scheduling).

scripts/test.sh runs `-n 2 --dist loadfile`: xdist hands a worker a whole file whenever it has at
most two tests left, in the collection's order, and by default first re-sorts the files by their
number of tests. That put the heavy files with few tests (SLURM, a daemon killed 100 times, the
benchmarks) last, and whichever worker drew the last of them ran on alone while the other had
nothing left. Here the files are sorted by what they cost (HEAVY, seconds measured on a quiet run
of the suite), the rest after them by their number of tests as before, and xdist is told to keep
the order. Each file's own tests keep their order (test_e2e's steps depend on it).
"""

from __future__ import annotations

import pytest

# Sum of each file's test times (`--durations=0` of ./scripts/test.sh at b7aa070, 2 workers, on the
# 2-core machine of 2026-11-29, whose suite took 23 min 40 s beside a one-core training).
# Only an order: a file that grew or shrank since costs some balance, never a result. Files not
# listed take under 10 s each.
HEAVY = {
    "test_train.py": 267, "test_balance_train.py": 239, "test_harvest.py": 199, "test_e2e.py": 168,
    "test_bench.py": 134, "test_gpu_check.py": 130, "test_scheduler.py": 103, "test_transcoder.py": 102,
    "test_nvml_scheduler.py": 90, "test_slurm.py": 82, "test_device_faults.py": 66, "test_daemon_death.py": 58,
    "test_scheduler_proctrack.py": 54, "test_sweep_train.py": 53, "test_scheduler_preemption.py": 52,
    "test_nvml_emulated.py": 43, "test_sweep_model.py": 40, "test_memory.py": 36, "test_decoder_refit.py": 36,
    "test_sae.py": 35, "test_evaluate.py": 34, "test_rare_bias.py": 33, "test_postgres.py": 30,
    "test_scheduler_storage_faults.py": 29, "test_scheduler_arrays.py": 29, "test_end_of_run_eval.py": 29,
    "test_bench_script_inputs.py": 28, "test_app_monitor_queue.py": 28, "test_time_limit.py": 27,
    "test_scheduler_sweep.py": 26, "test_scheduler_cli.py": 26, "test_scheduler_metrics.py": 25,
    "test_app_train.py": 25, "test_db.py": 23, "test_app_compare.py": 23, "test_scheduler_batch_script.py": 22,
    "test_chaos.py": 22, "test_model_check.py": 19, "test_app_cards.py": 17, "test_app.py": 17,
    "test_report_offline.py": 16, "test_app_links_progress.py": 16, "test_scheduler_snapshot.py": 15,
    "test_bench_reliability.py": 15, "test_analytics.py": 15, "test_balance_views.py": 13,
    "test_scheduler_fast_cli.py": 11, "test_app_evaluation.py": 10,
}


def file_order(files: list[str], counts: dict[str, int]) -> list[str]:
    """Test files (base names) in the order to hand them out: the listed ones by cost, most
    first; then the others by number of tests, most first; ties in collection order."""
    return sorted(files, key=lambda f: (f not in HEAVY, -HEAVY.get(f, 0), -counts.get(f, 0)))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items) -> None:
    names = [item.path.name for item in items]
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    rank = {name: i for i, name in enumerate(file_order(list(counts), counts))}
    keyed = sorted(zip(names, range(len(items)), items), key=lambda t: (rank[t[0]], t[1]))
    items[:] = [item for _, _, item in keyed]


def pytest_configure(config) -> None:
    # xdist's own re-sort by number of tests would undo the order above (its --no-loadscope-reorder).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
