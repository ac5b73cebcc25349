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
_slow: list[str] = []


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
        _slow.append(_over(item, call))
        report.sections.append(("over the time limit", _slow[-1]))
        if STRICT:
            report.outcome = "failed"
            report.longrepr = _slow[-1]


def pytest_terminal_summary(terminalreporter):
    # With xdist the workers' reports reach the controller: their sections say which were slow.
    slow = list(_slow) if not hasattr(terminalreporter.config, "workerinput") else []
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        for name, text in getattr(report, "sections", []):
            if name == "over the time limit" and text not in slow:
                slow.append(text)
    if slow:
        terminalreporter.section("tests over the time limit")
        for line in slow:
            terminalreporter.write_line(line)
