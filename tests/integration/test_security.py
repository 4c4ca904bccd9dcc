"""Attacks on a live authenticated run (a local Ray cluster on loopback), from a separate process.

The rendezvous store rewrite of issue 25: a process with no part in the run connects to the
run's TCPStore and sets the group's ``current_version`` to 9. With ``security.authenticate``
(the default) the value does not verify: every member that reads it records a
``forged_message`` (channel ``store``, the key) that reaches the audit trail with its next
heartbeat, treats it as absent, and the next sync succeeds with every rollout holding the
trainer's checksum. With ``authenticate: false`` the same rewrite fences the run (the attack
is real).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from ftstate.controller.membership import GROUP
from ftstate.core.audit_check import check_trail
from ftstate.core.errors import StaleGroupVersion
from tests.integration.test_runtime import checksums, config, runtime, wait_until

pytestmark = pytest.mark.ray

REWRITE = r"""
import sys, datetime
from torch.distributed import TCPStore
s = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, timeout=datetime.timedelta(seconds=10), use_libuv=True)
s.set(sys.argv[3], b"9")
"""


def rewrite_current_version(rt) -> None:
    address = rt._formation.store.address
    subprocess.run([sys.executable, "-c", REWRITE, address.host, str(address.port), f"{GROUP}/current_version"],
                   check=True, timeout=60)


def forged(rt) -> list[dict]:
    return [r for r in rt.audit.records if r["event"] == "forged_message"]


class TestStoreRewrite:
    async def test_a_rewritten_current_version_is_recorded_and_the_next_sync_succeeds(self, ray_cluster, tmp_path):
        # default heartbeats: the attacking process's torch import on a loaded 2-core machine must
        # not make a member look hung (that would be a different test)
        async with runtime(config(tmp_path, heartbeat_interval_s=1.0, heartbeat_timeout_s=10.0)) as rt:
            await rt.trainer("train_step")
            await rt.sync()
            rewrite_current_version(rt)
            for _ in range(2):
                await rt.trainer("train_step")
                report = await rt.sync()
                trainer_sum, rollout_sums = await checksums(rt)
                assert rollout_sums == [trainer_sum, trainer_sum] == [report.checksum] * 2
            assert report.weights_version == 3 and report.group_version == 1
            await wait_until(lambda: forged(rt), 30, "a forged_message record")
            record = forged(rt)[0]
            assert record["channel"] == "store" and record["key"] == f"{GROUP}/current_version"
            assert record["claimed_sender"] == "run" and record["problem"] == "shorter than a tag"  # b"9"
        assert check_trail(tmp_path / "audit.jsonl") == []

    async def test_without_authentication_the_same_rewrite_fences_the_run(self, ray_cluster, tmp_path):
        async with runtime(config(tmp_path, heartbeat_interval_s=1.0, heartbeat_timeout_s=10.0,
                                  security={"authenticate": False})) as rt:
            await rt.sync()
            rewrite_current_version(rt)
            with pytest.raises(StaleGroupVersion):
                await rt.sync()
