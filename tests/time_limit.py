"""A watch on the suite's speed: a test whose setup, call or teardown takes longer than
TEST_TIME_LIMIT_S is named at the end of the run, with the machine's load then. An expensive
scenario shares its training runs through a session fixture instead of growing. Quiet, every test
here takes well under a third of the limit.

It names, it does not fail: a wall-clock time depends on what else the machine runs (a preemption
test took 212 s beside three other suites), and a test that fails on a loaded machine is a bug.
SAE_DIST_TEST_TIME_STRICT=1 makes such a test fail, for a quiet machine where the figure means
something. ($SAE_DIST_TEST_TIME_LIMIT_S overrides the limit: the watch's own test.)"""

from __future__ import annotations

import os

import pytest

TEST_TIME_LIMIT_S = float(os.environ.get("SAE_DIST_TEST_TIME_LIMIT_S", "120"))
STRICT = os.environ.get("SAE_DIST_TEST_TIME_STRICT") == "1"
SECTION = "over the time limit"  # the report's section that names a slow test (workers' reports carry it)


def _over(item, call) -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{item.nodeid} ({call.when}) took {call.duration:.1f} s, over the {TEST_TIME_LIMIT_S:g} s one "
            f"test may take (tests/time_limit.py; load average {load} on {os.cpu_count()} cores): share its "
            f"training runs through a session fixture, or test the logic without processes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.passed and call.duration > TEST_TIME_LIMIT_S:
        report.sections.append((SECTION, _over(item, call)))
        if STRICT:
            report.outcome = "failed"
            report.longrepr = report.sections[-1][1]


def pytest_terminal_summary(terminalreporter):
    # Every report of the run, whatever its category (a passed setup or teardown has none of its
    # own) and wherever it ran (xdist's workers send theirs with their sections).
    slow = []
    for reports in terminalreporter.stats.values():
        for report in reports:
            for name, text in getattr(report, "sections", None) or []:
                if name == SECTION and text not in slow:
                    slow.append(text)
    if slow:
        terminalreporter.section("tests over the time limit")
        for line in slow:
            terminalreporter.write_line(line)
