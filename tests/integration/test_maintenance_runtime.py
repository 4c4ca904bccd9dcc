"""Maintenance notices in a running runtime, on one node (the local Ray cluster).

On one node a drain has nowhere to go: it is recorded as failed and undone, the members
serve on, syncs keep working and nothing of the failover budget is spent. The notice comes
through the file source (an operator's notice file, read by the watcher actor on the node).
Drains that succeed need another node: tests/multinode/test_drain.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

import ftstate
from tests.integration.workers import TinyRollout, TinyTrainer

pytestmark = pytest.mark.ray


def config(tmp_path, **ft) -> ftstate.RuntimeConfig:
    return ftstate.RuntimeConfig.from_dict({
        "rollout_workers": 2,
        "bucket_size_mb": 0.0625,
        "init_timeout_s": 60,
        "sync_timeout_s": 30,
        "heartbeat_interval_s": 0.2,
        "heartbeat_timeout_s": 2.0,
        "audit_log": str(tmp_path / "audit.jsonl"),
        "fault_tolerance": {"enable": True, "mode": "cold", "maintenance_check_interval": 0.2, **ft},
    }, environ={})


def events(rt, name: str) -> list[dict]:
    return [r for r in rt.audit.records if r["event"] == name]


async def wait_for(rt, name: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while not events(rt, name):
        assert time.monotonic() < deadline, f"no {name} record within {timeout}s"
        await asyncio.sleep(0.05)
    return events(rt, name)[0]


async def test_a_notice_with_no_other_node_is_recorded_and_the_run_goes_on(ray_cluster, tmp_path) -> None:
    notice_file = tmp_path / "notice.json"
    cfg = config(tmp_path, detect_node_maintenance=True, maintenance_sources=["file"],
                 maintenance_file=str(notice_file))
    async with ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=TinyRollout) as rt:
        first = await rt.sync()
        sources = events(rt, "maintenance_sources")
        assert {r["place"] for r in sources} == {"controller", "node"}
        await asyncio.sleep(0.6)  # a few polls of an absent file: no notice, no drain
        assert not events(rt, "maintenance_notice") and not events(rt, "drain_started")
        node = next(m.node_id for m in rt.members() if m.member == "rollout-0")
        notice_file.write_text(json.dumps({"kind": "terminate", "node": node, "deadline": time.time() + 60}))
        notice = await wait_for(rt, "maintenance_notice")
        assert (notice["source"], notice["kind"], notice["node_id"]) == ("file", "terminate", node)
        failed = await wait_for(rt, "drain_failed")
        assert "no other node can hold it" in failed["reason"]
        assert [d.outcome for d in rt.drains] == ["failed"]
        # Undone: everyone serves where it was, and the run goes on, with its budget whole.
        assert sorted(rt.serving_rollouts()) == ["rollout-0", "rollout-1"]
        assert all(m.state == "READY" for m in rt.members() if m.rank >= 0)
        report = await rt.sync()
        assert report.weights_version == first.weights_version + 1
        assert await rt.rollout("checksum") == [report.checksum] * 2
        assert not events(rt, "budget_spent") and rt.failovers == []
        assert not events(rt, "maintenance_problem")


async def test_a_passed_deadline_is_recorded_not_attempted(ray_cluster, tmp_path) -> None:
    async with ftstate.Runtime(config(tmp_path), trainer=TinyTrainer, rollout=TinyRollout) as rt:
        await rt.sync()
        node = rt.members()[1].node_id
        record = await rt.drain(node, reason="too late", deadline=time.time() - 1)
        assert record.outcome == "failed" and "deadline already passed" in record.reason
        assert not events(rt, "maintenance_sources"), "detect_node_maintenance off: no watcher runs"
        with pytest.raises(TypeError, match="node_id must be a Ray node id"):
            await rt.drain("")
        assert all(m.state == "READY" for m in rt.members() if m.rank >= 0)


@pytest.mark.parametrize("server", ["500", "garbage", "silent"])
async def test_a_broken_metadata_server_is_a_warning_and_the_run_goes_on(ray_cluster, tmp_path, server) -> None:
    from tests.integration.metadata_servers import FixedServer, SilentServer

    make = {"500": lambda: FixedServer(500, b"Internal Server Error"),
            "garbage": lambda: FixedServer(200, b"\x00\xff not a maintenance value", {"Metadata-Flavor": "Google"}),
            "silent": SilentServer}[server]
    with make() as bad:
        cfg = config(tmp_path, detect_node_maintenance=True, maintenance_sources=["gce"],
                     maintenance_endpoints={"gce": bad.url}, maintenance_request_timeout_s=0.5)
        async with ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=TinyRollout) as rt:
            problem = await wait_for(rt, "maintenance_problem")
            assert problem["source"] == "gce"
            await asyncio.sleep(1.0)
            reported = len(events(rt, "maintenance_problem"))
            assert 1 <= reported <= 3  # at most once per path read (maintenance-event, preempted, upcoming)
            for _ in range(2):
                report = await rt.sync()
                assert await rt.rollout("checksum") == [report.checksum] * 2
            await asyncio.sleep(1.0)  # several more intervals: reported once, not at every poll
            assert len(events(rt, "maintenance_problem")) == reported
            assert not events(rt, "maintenance_notice") and not events(rt, "drain_started")
