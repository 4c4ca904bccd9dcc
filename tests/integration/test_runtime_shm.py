"""The route plan in the runtime: same-node rollouts read shared memory, and the plan is on record.

On one local Ray node every member shares the trainer's node, so with the default
``shared_memory: auto`` every rollout reads each bucket from /dev/shm; ``off`` puts them
all on the collective. Either way every rollout holds the trainer's weights (checksum),
the sync's audit record carries the plan, and ``SyncReport.routes`` says who got what how.
A failover's point-to-point resync from a rollout on the newcomer's node takes the same
route from ``resync_shared_memory_min_mb`` up, and the collective below it, with the reason on
its record. (Mixed nodes: tests/multinode/test_plan.py.)
"""

from __future__ import annotations

import pytest

from ftstate.core.audit_check import check_trail
from tests.integration.test_failover import assert_consistent, finish, rollout_replaced
from tests.integration.test_failover import config as ft_config
from tests.integration.test_failover import runtime as ft_runtime
from tests.integration.test_runtime import checksums, config, runtime

pytestmark = pytest.mark.ray


def resyncs(rt, member: str) -> list[dict]:
    """``member``'s ``resync`` records."""
    return [r for r in rt.audit.records if r["event"] == "transition" and r.get("trigger") == "resync"
            and r.get("member") == member]


def sync_starts(rt) -> list[dict]:
    return [r for r in rt.audit.records if r["event"] == "transition" and r.get("trigger") == "sync_start"]


class TestPlan:
    async def test_same_node_rollouts_read_shared_memory_and_the_plan_is_recorded(self, ray_cluster, tmp_path):
        async with runtime(config(tmp_path)) as rt:
            for _ in range(2):
                await rt.trainer("train_step")
                report = await rt.sync()
                trainer_sum, rollout_sums = await checksums(rt)
                assert rollout_sums == [trainer_sum, trainer_sum] == [report.checksum] * 2
            assert report.routes == {"rollout-0": "shm", "rollout-1": "shm"} and report.shm_fallback is None
            plan = sync_starts(rt)[-1]["plan"]
            assert plan["sender"] == "trainer-0" and plan["mode"] == "auto"
            assert plan["routes"] == {"rollout-0": "shm", "rollout-1": "shm"} and plan["remote_nodes"] == {}
        assert check_trail(tmp_path / "audit.jsonl") == []

    async def test_with_shared_memory_off_every_rollout_takes_the_collective(self, ray_cluster, tmp_path):
        async with runtime(config(tmp_path, shared_memory="off")) as rt:
            await rt.trainer("train_step")
            report = await rt.sync()
            trainer_sum, rollout_sums = await checksums(rt)
            assert rollout_sums == [trainer_sum, trainer_sum]
            assert report.routes == {"rollout-0": "collective", "rollout-1": "collective"}
            assert sync_starts(rt)[-1]["plan"]["routes"] == report.routes


class TestFailoverResync:
    async def test_a_newcomer_on_the_sources_node_is_resynced_through_shared_memory(self, ray_cluster, tmp_path):
        rt = ft_runtime(ft_config(tmp_path).replace(resync_shared_memory_min_mb=0))
        await rt.start()
        try:
            record = await rollout_replaced(rt)
            resync = resyncs(rt, record.replacement)
            assert resync and resync[-1]["plan"]["routes"] == {record.replacement: "shm"}, resync
            assert resync[-1]["plan"]["sender"] == resync[-1]["source"]
            assert "collective" not in resync[-1]["plan"]
            await assert_consistent(rt)
        finally:
            await finish(rt, tmp_path)

    async def test_weights_below_the_resync_threshold_go_over_the_collective_and_the_record_says_why(
            self, ray_cluster, tmp_path):
        rt = ft_runtime(ft_config(tmp_path))  # the default threshold, 1 GiB, and tiny weights
        await rt.start()
        try:
            record = await rollout_replaced(rt)
            plan = resyncs(rt, record.replacement)[-1]["plan"]
            assert plan["routes"] == {record.replacement: "collective"}, plan
            assert "below resync_shared_memory_min_mb (1024 MiB)" in plan["collective"], plan
            await assert_consistent(rt)
        finally:
            await finish(rt, tmp_path)
