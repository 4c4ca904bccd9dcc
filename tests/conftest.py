"""Session-wide checks shared by every test directory."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def dev_shm_left_as_found():
    """The whole run leaves no ftstate shared-memory segment behind (issue 15): every path
    out of the same-host route unlinks, and what a SIGKILL leaves is swept."""
    from ftstate.transport import shm  # pure stdlib + torch at use; importing it loads torch

    before = set(shm.list_segments())
    yield
    left = sorted(set(shm.list_segments()) - before)
    if left:
        shm.unlink_names(left)  # leave the machine clean for whoever runs next, then fail
        pytest.fail(f"the test run left shared-memory segments in {shm.SHM_DIR}: {left}")


#: How many of a failed test's last audit records its report shows (the heartbeats left out).
AUDIT_TAIL_RECORDS = 60


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's audit trails (``*.jsonl`` under its ``tmp_path``), the last records of
    each without the heartbeats, as a section of its report: what CI printed is then enough to
    tell which member went where and why, after the machine and its files are gone."""
    outcome = yield
    report = outcome.get_result()
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if not report.failed or tmp_path is None:
        return
    for trail in sorted(tmp_path.rglob("*.jsonl"))[:3]:
        report.sections.append((f"audit trail {trail.name} (last {AUDIT_TAIL_RECORDS} records, no heartbeats)",
                                _audit_tail(trail)))


def _audit_tail(path) -> str:
    """The last records of a trail as ``ftstate audit`` prints them off a terminal (with each record's
    details), heartbeats left out; an unreadable line is named, as the CLI names it."""
    from ftstate.cli.audit_view import plain_lines
    from ftstate.core.audit import parse_lines

    records, problems = [], []
    try:
        with open(path, "rb") as f:
            for lineno, record, problem in parse_lines(f):
                if problem is not None:
                    problems.append(f"line {lineno}: {problem}")
                elif record.get("event") != "heartbeat":
                    records.append(record)
    except OSError as exc:
        return f"unreadable: {exc}"
    return "\n".join([*problems[-5:], *plain_lines(records[-AUDIT_TAIL_RECORDS:], context=records)])
