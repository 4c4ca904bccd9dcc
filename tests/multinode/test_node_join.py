"""A node that joins the running cluster (the autoscaler, ``ray start``) is given rollouts by
the user's loop: ``rt.nodes()`` shows it, ``rt.add_rollouts(n, nodes=[its id])`` puts the
newcomers there and no elsewhere, fed by a rollout that holds the version (not the trainer),
each proven by its own checksum; removed again, nothing of them is left."""

from __future__ import annotations

import time

import pytest

import ftstate
from tests.integration.workers import TinyRollout, TinyTrainer
from tests.multinode.harness import pid_alive, resource
from tests.multinode.test_node_loss import assert_nothing_left, by_name, config, consistent, wait_until

pytestmark = pytest.mark.ray


async def test_a_node_that_joins_is_given_rollouts_by_the_users_loop_and_they_serve_bit_equal(
        multinode_cluster, tmp_path):
    import ray

    mn = multinode_cluster
    placement = {"placement": {"trainer": {"resources": {resource("a"): 1}}}}
    rt = ftstate.Runtime(config(tmp_path, **placement), trainer=TinyTrainer, rollout=TinyRollout)
    joined = None
    try:
        async with rt:
            await rt.sync()
            known = {n["node_id"] for n in rt.nodes()}
            joined = mn.add("d").node_id
            t0 = time.monotonic()
            # what a user's loop does: look for a node it has not seen, and give it rollouts
            await wait_until(lambda: any(n["node_id"] == joined for n in rt.nodes()), 30, "node d in rt.nodes()")
            [new] = [n for n in rt.nodes() if n["node_id"] not in known]
            assert new["node_id"] == joined and new["members"] == [] and new["labels"]["ftstate-test-node"] == "d"
            names = await rt.add_rollouts(2, nodes=[new["node_id"]])
            members = by_name(rt)
            assert {members[n].node_id for n in names} == {joined}
            record = rt.scalings[-1]
            assert record.trainer_sources == 0 and all(s and s.startswith(("rollout-", "node copy"))
                                                      for s in record.sources.values()), record.sources
            assert set(names) <= set(rt.serving_rollouts())
            await consistent(rt)
            await rt.trainer("train_step")
            report = await rt.sync()  # the next sync reaches them, on the new node
            assert set(names) <= set(report.rollouts)
            await consistent(rt)
            print(f"node d joined and served 2 rollouts {time.monotonic() - t0:.1f}s after it was added")
            pids = [members[n].pid for n in names]
            await rt.remove_rollouts(names)
            assert not next(m for m in rt.nodes() if m["node_id"] == joined)["members"]
            # their processes are stopped last, by Ray, a moment after the call returns
            await wait_until(lambda: not any(pid_alive(p) for p in pids if p), 15, "the removed processes gone")
            await consistent(rt)
        assert_nothing_left(ray, rt.run_id, pids)
    finally:
        if joined is not None:  # the session's cluster goes back to a, b, c
            mn.cluster.remove_node(mn.nodes.pop("d"))
