"""A quarantined node gets no spare, even where a spare must share a node with the members it
covers (two nodes, one of them bad): against simulated members in virtual time.

Before, a spare with no node off its members' was placed wherever there was room, the
quarantined node included, where it died at once; its death was not counted against the role
(it died of the node), so another was started there, forever, every few seconds.
"""

from __future__ import annotations

import asyncio

from ftstate.simulation import clock
from ftstate.simulation.scenario import Shape, simulated_runtime


def test_a_spare_that_must_share_a_node_goes_to_a_healthy_one_never_to_the_quarantined_one():
    async def main():
        rt, cluster = simulated_runtime(Shape(rollouts=2, nodes=2, headroom=4), keep_records=True,
                                        overrides={"fault_tolerance": {"max_node_failures": 2}})
        await rt.start()
        await rt.sync()
        trainer_node = next(m.node_id for m in rt.members() if m.member == "trainer-0")
        bad = next(n["node_id"] for n in cluster.nodes() if n["node_id"] != trainer_node)
        cluster.poison_node(bad)
        for _ in range(6):
            await rt.trainer("train_step")
            await rt.sync()
            if bad in rt.failover_budget["quarantined"]:
                break
        assert bad in rt.failover_budget["quarantined"], rt.failover_budget
        at = len(rt.audit.records)
        await asyncio.sleep(60)  # a minute of the run after the quarantine
        started_there = [r["member"] for r in rt.audit.records[at:]
                         if r["event"] == "transition" and r.get("to") == "LOST" and r.get("member", "").startswith("spare-")]
        assert started_there == [], started_there  # no spare died (on the bad node) after it
        spares = [m for m in rt.members() if m.role == "rollout" and m.rank < 0 and m.state == "STANDBY"]
        assert spares and all(m.node_id != bad for m in spares), spares
        assert all(m.node_id != bad for m in rt.members() if m.state not in ("LOST", "RETIRED", "STOPPED"))
        report = await rt.sync()
        assert report.weights_version == rt.weights_version
        await rt.close()

    clock.run(main())
