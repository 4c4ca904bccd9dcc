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
