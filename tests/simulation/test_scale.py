"""The real controller at 10,000 simulated members: a node lost and a node drained (issue 27).

One run, in virtual time on one core (~30 s here): 10,000 members (1,250 trainer ranks, 8,650
rollouts, 50 spares per role) on 1,250 nodes; a sync, a whole node lost (its 8 members replaced in one
failover round), a sync, a node drained for maintenance (its members moved, no failover
spent), a sync. What it holds is behaviour at scale: every rollout serving the current
version after each step, one group version per round, the budget spent once per lost member.
The CPU figures are ``benchmarks/controller_scale.py``'s (docs/benchmarks.md), not this test's.
"""

from __future__ import annotations

import asyncio

from ftstate.simulation import clock
from ftstate.simulation.scenario import Shape, simulated_runtime

MEMBERS = 10_000


def test_ten_thousand_members_survive_a_node_loss_and_a_drain():
    shape = Shape.of(MEMBERS)
    assert (shape.members, shape.nodes) == (MEMBERS, 1250)

    async def main():
        rt, cluster = simulated_runtime(shape, keep_records=True,
                                        overrides={"heartbeat_timeout_s": 3.0,
                                                   "fault_tolerance": {"max_failovers": 100}})
        await rt.start()
        first = await rt.sync()
        assert len(first.rollouts) == shape.rollouts
        version = rt.group_version

        lost_node = next(m.node_id for m in rt.members() if m.member == "rollout-17")
        lost = [n for n in cluster.lose_node(lost_node) if not n.startswith("spare")]
        await asyncio.sleep(8)  # its members found by their heartbeats (heartbeat_timeout_s 3), replaced
        after_loss = await rt.sync()
        assert sorted(f.lost for f in rt.failovers) == sorted(lost) and len(lost) >= 7
        assert {f.group_version for f in rt.failovers} == {version + 1}  # one round for the node
        assert len(after_loss.rollouts) == shape.rollouts and not set(lost) & set(after_loss.rollouts)

        drained_node = next(m.node_id for m in rt.members() if m.member == "rollout-42")
        record = await rt.drain(drained_node, reason="host maintenance", source="simulation", kind="maintenance")
        assert record.outcome == "drained" and len(record.moved) >= 7
        after_drain = await rt.sync()
        assert len(after_drain.rollouts) == shape.rollouts
        assert not set(record.moved) & set(after_drain.rollouts)
        on_node = [m.member for m in rt.members() if m.node_id == drained_node and m.rank >= 0
                   and m.state not in ("RETIRED", "LOST")]
        assert on_node == []
        spent = [r for r in rt.audit.records if r["event"] == "budget_spent"]
        # the node lost whole is one unit of the budget (issue 43), and the drain spent nothing
        assert len(spent) == 1 and spent[0].get("node_lost") and len(lost) == 8
        await rt.close()

    clock.run(main())


def test_the_scale_benchmark_measures_sizes_in_their_own_processes_and_counts_the_work(tmp_path):
    """``benchmarks/controller_scale.py`` as its figures are taken (docs/benchmarks.md): with
    ``--repeat`` each size is measured in fresh processes and the figures are medians, each
    failover kind is measured in ``--failovers`` rounds of members not touched before, and
    ``--calls`` counts the work (function calls), which grows with the members."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "figures.json"
    done = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "controller_scale.py"), "--sizes", "10,100", "--syncs", "1",
         "--intervals", "1", "--failovers", "2", "--repeat", "2", "--calls", "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "run by run" in done.stdout
    figures = json.loads(out.read_text())
    small, large = figures["rows"]
    assert (small["members"], large["members"]) == (10, 100)
    assert [len(figures["runs"][n]) for n in ("10", "100")] == [2, 2]  # each size twice, on its own
    assert len(large["failover_member_rounds_s"]) == 2 and len(large["failover_rank_rounds_s"]) == 2
    assert len(large["failover_node_rounds_s"]) == 2 and len(small["failover_node_rounds_s"]) == 1  # 2 nodes: one lost
    for k in ("sync_calls", "heartbeat_interval_calls", "failover_member_calls", "failover_node_calls"):
        assert large[k] > small[k] > 0, k
    for kind in ("member", "rank", "node"):  # the controller's own: the round less the members' sampled share
        # (a round of a few ms at 100 members holds a dozen samples: none of them the members' is possible)
        assert 0 < large[f"failover_{kind}_controller_s"] <= large[f"failover_{kind}_s"], kind
        assert 0 <= large[f"failover_{kind}_members_share"] < 1, kind
