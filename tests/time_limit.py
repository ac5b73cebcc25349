"""A guard on the suite's speed: a test whose setup, call or teardown takes longer than
TEST_TIME_LIMIT_S fails, naming the limit. An expensive scenario shares its training runs through
a session fixture instead of growing. Quiet, every test here takes well under a third of the limit,
so two CPU hogs on the machine do not reach it. ($SAE_DIST_TEST_TIME_LIMIT_S overrides it: the
guard's own test.)"""

from __future__ import annotations

import os

import pytest

TEST_TIME_LIMIT_S = float(os.environ.get("SAE_DIST_TEST_TIME_LIMIT_S", "120"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.passed and call.duration > TEST_TIME_LIMIT_S:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} ({call.when}) took {call.duration:.1f} s, over the "
                           f"{TEST_TIME_LIMIT_S:g} s one test may take (tests/time_limit.py): share its "
                           f"training runs through a session fixture, or test the logic without processes")
