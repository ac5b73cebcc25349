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

# Sum of each file's test times (a junit report of ./scripts/test.sh at 81223ab, 2 workers, on the
# 2-core machine of 2026-11-29, whose suite took 18 min 40 s).
# Only an order: a file that grew or shrank since costs some balance, never a result. Files not
# listed take under 5 s each.
HEAVY = {
    "test_train.py": 227, "test_balance_train.py": 217, "test_e2e.py": 154, "test_harvest.py": 127,
    "test_scheduler.py": 114, "test_gpu_check.py": 112, "test_bench.py": 103, "test_nvml_scheduler.py": 98,
    "test_slurm.py": 73, "test_transcoder.py": 71, "test_rare_bias.py": 65, "test_device_faults.py": 60,
    "test_kernels.py": 20,  # 60 until its lock test stopped rebuilding the kernel in a copied directory
    "test_scheduler_proctrack.py": 56, "test_daemon_death.py": 47, "test_sweep_train.py": 47,
    "test_scheduler_preemption.py": 47, "test_sae.py": 40, "test_memory.py": 34, "test_decoder_refit.py": 33,
    "test_evaluate.py": 31, "test_postgres.py": 25, "test_app_monitor_queue.py": 25,
    "test_scheduler_cli.py": 23, "test_scheduler_metrics.py": 23, "test_app_train.py": 21,
    "test_bench_script_inputs.py": 21, "test_sweep_model.py": 20, "test_nvml_emulated.py": 19,
    "test_scheduler_storage_faults.py": 16, "test_scheduler_sweep.py": 15, "test_scheduler_arrays.py": 13,
    "test_chaos.py": 11, "test_time_limit.py": 10, "test_end_of_run_eval.py": 10,
    "test_scheduler_batch_script.py": 10, "test_db.py": 10, "test_scheduler_snapshot.py": 8,
    "test_scheduler_exclusive.py": 8, "test_app_links_progress.py": 8, "test_report_offline.py": 8,
    "test_app_compare.py": 7, "test_analytics.py": 7, "test_model_check.py": 6, "test_app.py": 6,
    "test_bench_reliability.py": 6, "test_app_cards.py": 6, "test_app_sweeps.py": 5,
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
