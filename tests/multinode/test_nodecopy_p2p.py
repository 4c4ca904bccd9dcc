"""Point-to-point resync of another node from a node copy (``staging: node``, issue 24 item 2).

Trainer on node ``a``, both rollouts on ``b`` (so ``b`` holds the committed node copy, owned by
its agent), the spares on ``c`` (no rollout there, so no node copy). A rollout on ``b`` is
SIGKILLed; its replacement is the warm spare on ``c``, a node with neither the committed copy
nor a holder: ``b``'s agent serves it ``b``'s copy point to point (no rollout engine and no
trainer sends), the newcomer proves it by checksum, and its ``resync`` record names the copy as
its source. Every serving rollout then holds the trainer's weights (the workers' own hashes),
the next sync goes through, and nothing of the run is left in /dev/shm. A copy gone before
its agent serves it is a recorded fallback: the newcomer is resynced from the rollout left on
``b`` instead.
"""

from __future__ import annotations

import pytest

import ftstate
from ftstate.core.audit_check import check_trail
from ftstate.transport import nodecopy, shm
from tests.integration.workers import TinyRollout, TinyTrainer
from tests.multinode.harness import LABEL, resource
from tests.multinode.test_node_loss import config, consistent, spares_warm, wait_until

pytestmark = pytest.mark.ray


def node_copies() -> list[str]:
    return [n for n in shm.list_segments() if nodecopy.is_copy(n)]


def resyncs(rt, member: str) -> list[dict]:
    return [r for r in rt.audit.records if r["event"] == "transition" and r.get("trigger") == "resync"
            and r.get("member") == member]


def p2p_config(tmp_path) -> ftstate.RuntimeConfig:
    placement = {"placement": {"trainer": {"resources": {resource("a"): 1}},
                               "rollout": {"resources": {resource("b"): 1}},
                               "standby": {"labels": {LABEL: "c"}}}}
    return config(tmp_path, staging="node", resync_shared_memory_min_mb=0, **placement)


async def replaced_on_c(rt, multinode_cluster, before_kill=lambda: None):
    """Sync once (b's copy committed), SIGKILL rollout-1 on b, wait for its replacement (the
    spare on c) to serve; its failover record, its ``resync`` record and b's committed segment."""
    b, c = multinode_cluster.node_id("b"), multinode_cluster.node_id("c")
    await spares_warm(rt, 2)
    await rt.trainer("train_step")
    await rt.sync()
    committed = [r for r in rt.audit.records if r["event"] == "node_copy_committed"]
    assert [r["node"] for r in committed] == [b[:8]], committed  # b's only: a and c hold no rollout
    before_kill()
    victim = await rt.chaos.kill("rollout", 1)  # SIGKILL
    await wait_until(lambda: len(rt.failovers) == 1 and rt.state == "READY", 60, "the failover")
    record = rt.failovers[0]
    assert record.lost == victim and record.resynced
    newcomer = {m.member: m for m in rt.members()}[record.replacement]
    assert newcomer.node_id == c, (newcomer.node_id, b, c)
    return record, resyncs(rt, record.replacement), committed[-1]["segment"]


async def test_a_newcomer_on_a_node_without_a_copy_is_served_point_to_point_by_another_nodes_agent(
    multinode_cluster, tmp_path
):
    rt = ftstate.Runtime(p2p_config(tmp_path), trainer=TinyTrainer, rollout=TinyRollout,
                         trainer_kwargs={"big_floats": 100_000})  # several 64 KiB buckets
    b = multinode_cluster.node_id("b")
    await rt.start()
    try:
        record, resync, segment = await replaced_on_c(rt, multinode_cluster)
        # the route, from the audit: b's copy, sent by b's agent, not by rollout-0 nor the trainer
        assert resync[-1]["source"] == f"node copy on {b[:8]}", resync
        assert resync[-1]["plan"]["routes"] == {record.replacement: "node_copy_p2p"}
        assert resync[-1]["plan"]["segment"] == segment and resync[-1]["plan"]["sender"] == resync[-1]["source"]
        proven = [r for r in rt.audit.records if r["event"] == "transition" and r.get("member") == record.replacement
                  and r.get("to") == "RESYNCED"]
        assert proven and proven[-1]["source"] == resync[-1]["source"]
        assert not [r for r in rt.audit.records if r["event"] == "node_copy_fallback"]
        assert await consistent(rt) == rt.checksum  # the newcomer's own hash equals the trainer's
        await rt.trainer("train_step")
        await rt.sync()  # and the next sync reaches it too
        await consistent(rt)
    finally:
        await rt.close()
    assert node_copies() == []
    assert check_trail(tmp_path / "audit.jsonl") == []


async def test_a_copy_gone_before_it_is_served_is_a_recorded_fallback_to_a_holder(multinode_cluster, tmp_path):
    rt = ftstate.Runtime(p2p_config(tmp_path), trainer=TinyTrainer, rollout=TinyRollout)
    await rt.start()
    try:
        # as if someone removed it: b's agent has nothing to serve
        record, resync, _ = await replaced_on_c(rt, multinode_cluster,
                                                before_kill=lambda: shm.unlink_names(node_copies()))
        fallback = [r for r in rt.audit.records if r["event"] == "node_copy_fallback"]
        assert fallback and fallback[0]["member"] == record.replacement, fallback
        assert "cannot be served" in fallback[0]["reason"], fallback
        assert [r["source"] for r in resync][-2:] == [f"node copy on {multinode_cluster.node_id('b')[:8]}",
                                                      "rollout-0"], resync
        assert await consistent(rt) == rt.checksum
    finally:
        await rt.close()
    assert node_copies() == []
    assert check_trail(tmp_path / "audit.jsonl") == []
