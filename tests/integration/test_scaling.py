"""A fleet that grows and shrinks while it runs (issue 44), on a real local Ray cluster.

Rollouts are added (``rt.add_rollouts``) and removed (``rt.remove_rollouts``) between and
during syncs, with real SIGKILLs landing while it happens: a newcomer killed while it is fed,
its source killed while it feeds, a removal that meets a dead member, a sync called while an
addition runs. After each: every serving rollout is bit-equal to the trainer (checksum), no
budget was spent on the change, the trail passes ``ftstate audit --check``, and nothing is left
behind (no process of the run, no shared-memory segment of its members).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

import ftstate
from ftstate.core.audit_check import check_trail
from ftstate.core.errors import ScaleRefused
from tests.integration.test_failover import assert_consistent, budget_spends, spares_warm
from tests.integration.test_runtime import assert_gone, wait_until
from tests.integration.test_runtime_nodecopy import committed_copies, node_copies, sweep_run
from tests.integration.workers import DyingRollout, TinyTrainer

pytestmark = pytest.mark.ray


def config(tmp_path, **top) -> ftstate.RuntimeConfig:
    ft = top.pop("fault_tolerance", {})
    return ftstate.RuntimeConfig.from_dict(
        {
            "rollout_workers": 2,
            "bucket_size_mb": 0.0625,
            "init_timeout_s": 60,
            "sync_timeout_s": 60,
            "failover_timeout_s": 30,
            # deaths here are found by the calls they cut; a loaded machine must not look like a lost node
            "heartbeat_interval_s": 0.5,
            "heartbeat_timeout_s": 5.0,
            "remove_calls_timeout_s": 30,
            "audit_log": str(tmp_path / "audit.jsonl"),
            **top,
            "fault_tolerance": {"enable": True, "reverse_weight_sync": True, **ft},
        },
        environ={},
    )


def runtime(cfg, **kw) -> ftstate.Runtime:
    return ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=DyingRollout, **kw)


def records(rt, event: str) -> list[dict]:
    return [r for r in rt.audit.records if r["event"] == event]


def resync_sources(rt, names) -> dict[str, str]:
    """Who fed each of ``names``: the source on its last ``resync`` edge."""
    return {r["member"]: r.get("source") for r in rt.audit.records
            if r["event"] == "transition" and r.get("trigger") == "resync" and r.get("member") in names}


def segments_of(pids) -> list[str]:
    from ftstate.transport import shm

    marks = [f"-p{p}-" for p in pids if p]
    return [n for n in shm.list_segments() if any(m in n for m in marks)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


async def finish(rt, tmp_path, *, failovers: int = 0) -> None:
    """Nothing spent but what the failovers spent; then closed, the trail valid, nothing left."""
    assert len(rt.failovers) == failovers and budget_spends(rt) == failovers
    pids = [m.pid for m in rt.members()]
    run_id = rt.run_id
    await rt.close()
    assert check_trail(tmp_path / "audit.jsonl") == []
    import ray

    assert_gone(ray, run_id, pids)
    assert segments_of(pids) == []


class TestGrowAndShrink:
    async def test_added_rollouts_are_fed_by_the_rollouts_serve_bit_equal_and_leave_cleanly(
        self, ray_cluster, tmp_path
    ):
        rt = runtime(config(tmp_path), trainer_kwargs={"big_floats": 100_000})
        await rt.start()
        try:
            await spares_warm(rt, 2)
            await rt.trainer("train_step")
            await rt.sync()
            t0 = time.monotonic()
            [one] = await rt.add_rollouts(1)
            add_spare_s = time.monotonic() - t0
            # the warm rollout spare went first: no process started for it
            assert rt.scalings[0].promoted == (one,) and one.startswith("spare-rollout-")
            t0 = time.monotonic()
            names = [one, *await rt.add_rollouts(1)]
            add_one_s = time.monotonic() - t0
            assert len(set(names)) == 2 and set(names) <= set(rt.serving_rollouts())
            await assert_consistent(rt)
            assert await rt.trainer("checksum") == rt.checksum
            # fed by the rollouts holding the version: the trainer sent nothing for them
            sources = resync_sources(rt, names)
            assert set(sources) == set(names) and not {"trainer-0"} & set(sources.values())
            assert all(s.startswith(("rollout-", "spare-rollout-")) for s in sources.values()), sources
            assert [r.trainer_sources for r in rt.scalings] == [0, 0]
            assert sum(len(r["members"]) for r in records(rt, "rollouts_added")) == 2
            # spares follow the fleet: 1 per 2 rollouts, 4 rollouts -> 2
            await wait_until(lambda: sum(m.state == "STANDBY" and m.role == "rollout" for m in rt.members()) == 2,
                             60, "2 warm rollout spares")
            await rt.trainer("train_step")
            report = await rt.sync()
            assert set(names) <= set(report.rollouts) and len(report.rollouts) == 4
            await assert_consistent(rt)

            gone = {m.member: m.pid for m in rt.members() if m.member in (names[1], "rollout-0")}
            group_version = rt.group_version
            await rt.remove_rollouts([names[1], "rollout-0"])
            assert not set(gone) & set(rt.serving_rollouts()) and len(rt.serving_rollouts()) == 2
            assert rt.group_version == group_version + 1  # one version formed without them
            states = {m.member: m.state for m in rt.members()}
            assert {states[n] for n in gone} == {"RETIRED"}
            await wait_until(lambda: not any(alive(p) for p in gone.values()), 10, "the removed processes gone")
            assert sum(m.state == "STANDBY" and m.role == "rollout" for m in rt.members()) == 1  # 2 rollouts -> 1
            await rt.trainer("train_step")
            report = await rt.sync()
            assert sorted(report.rollouts) == sorted(rt.serving_rollouts()) and len(report.rollouts) == 2
            await assert_consistent(rt)
            assert budget_spends(rt) == 0 and rt.failovers == []

            # the figure: an addition (a new process, then a transfer from a holder) against a
            # failover's resync of the same bytes to a warm spare
            await rt.chaos.kill("rollout", 1)
            await wait_until(lambda: len(rt.failovers) == 1 and rt.state == "READY", 30, "the failover")
            f = rt.failovers[0]
            print(f"add one rollout: a warm spare {add_spare_s:.3f}s, a new process {add_one_s:.3f}s "
                  f"(promoted {rt.scalings[1].promoted}; transfer {rt.scalings[1].stages}); "
                  f"failover total {f.total_s:.3f}s, transfer {f.transfer_s:.3f}s")
            await assert_consistent(rt)
        finally:
            await finish(rt, tmp_path, failovers=1)

    async def test_a_sync_called_during_an_addition_reaches_the_newcomers_and_removal_stops_at_the_minimum(
        self, ray_cluster, tmp_path
    ):
        rt = runtime(config(tmp_path, fault_tolerance={"mode": "cold", "min_rollout_workers": 2}))
        await rt.start()
        try:
            await rt.sync()
            await rt.trainer("train_step")
            adding = asyncio.ensure_future(rt.add_rollouts(2))
            await wait_until(lambda: records(rt, "scale_add_started"), 30, "the addition to start")
            report = await rt.sync()  # waits for the addition, then reaches everyone
            names = await adding
            assert report.weights_version == 2 and set(names) <= set(report.rollouts) and len(report.rollouts) == 4
            await assert_consistent(rt)
            assert await rt.trainer("checksum") == rt.checksum

            with pytest.raises(ScaleRefused, match=r"names: expected distinct rollouts of the fleet .* got trainer-0"):
                await rt.remove_rollouts(["trainer-0"])
            await rt.scale_rollouts(2)
            assert len(rt.serving_rollouts()) == 2 and rt.scalings[-1].kind == "remove"
            version = rt.group_version
            with pytest.raises(ScaleRefused, match=r"fault_tolerance.min_rollout_workers: expected at least 2 "
                                                   r"rollouts left, got 1 left"):
                await rt.remove_rollouts([rt.serving_rollouts()[0]])
            assert rt.group_version == version and len(rt.serving_rollouts()) == 2  # nothing changed
            await rt.trainer("train_step")
            await rt.sync()
            await assert_consistent(rt)
        finally:
            await finish(rt, tmp_path)


class TestNodeCopy:
    async def test_with_node_staging_a_newcomer_adopts_its_nodes_copy_with_no_transfer(
        self, ray_cluster, tmp_path
    ):
        rt = runtime(config(tmp_path, staging="node", fault_tolerance={"mode": "cold"}))
        await rt.start()
        try:
            await rt.sync()
            kept = committed_copies(rt)[-1:]
            [name] = await rt.add_rollouts(1)
            [resync] = [r for r in rt.audit.records if r["event"] == "transition" and r.get("member") == name
                        and r.get("trigger") == "resync"]
            assert resync["source"] == "node copy" and resync["plan"]["routes"] == {name: "node_copy"}, resync
            assert resync["plan"]["segment"] == kept[0] and node_copies() == kept
            assert rt.scalings[0].sources == {name: "node copy"} and rt.scalings[0].trainer_sources == 0
            await assert_consistent(rt)
            await rt.trainer("train_step")
            report = await rt.sync()
            assert name in report.rollouts
            await assert_consistent(rt)
            await rt.remove_rollouts([name])
            await rt.trainer("train_step")
            await rt.sync()
            await assert_consistent(rt)
        finally:
            try:
                await finish(rt, tmp_path)
            finally:
                sweep_run(rt.run_id)  # a failed test leaves no node copy behind either
        assert node_copies() == []


class TestFaultsWhileScaling:
    async def test_a_newcomer_killed_while_it_is_fed_is_started_again_at_no_cost(self, ray_cluster, tmp_path):
        marker = tmp_path / "die-on-load"
        rt = runtime(config(tmp_path, fault_tolerance={"mode": "cold"}), rollout_kwargs={"die_marker": str(marker)})
        await rt.start()
        try:
            await rt.sync()
            marker.touch()  # the next load is a newcomer's: it dies in it
            [name] = await rt.add_rollouts(1)
            assert not marker.exists()
            [record] = rt.scalings
            assert len(record.restarted) == 1 and record.restarted[0] != name
            killed = next(m for m in rt.members() if m.member == record.restarted[0])
            assert killed.state == "RETIRED" and not alive(killed.pid)
            assert name in rt.serving_rollouts() and len(rt.serving_rollouts()) == 3
            assert resync_sources(rt, [name])[name].startswith("rollout-")
            await assert_consistent(rt)
            await rt.trainer("train_step")
            await rt.sync()
            await assert_consistent(rt)
        finally:
            await finish(rt, tmp_path)

    async def test_a_source_killed_while_it_feeds_is_failed_over_and_the_newcomer_fed_by_another(
        self, ray_cluster, tmp_path
    ):
        rt = runtime(config(tmp_path, fault_tolerance={"mode": "cold"}), trainer_kwargs={"big_floats": 200_000})
        await rt.start()
        try:
            await rt.sync()
            # the first holder feeds; it dies after its join and two buckets of the send
            source = await rt.chaos.kill("rollout", 0, after_progress=3)
            [name] = await rt.add_rollouts(1)
            assert name in rt.serving_rollouts()
            [failover] = rt.failovers
            assert failover.lost == source  # the source's loss is a failover; the addition spent nothing
            sources = [r.get("source") for r in rt.audit.records if r["event"] == "transition"
                       and r.get("member") == name and r.get("trigger") == "resync"]
            assert sources[0] == source and sources[-1] != source and not {"trainer-0"} & set(sources)
            assert records(rt, "scale_retry")
            await assert_consistent(rt)
            await rt.trainer("train_step")
            await rt.sync()
            await assert_consistent(rt)
            assert len(rt.serving_rollouts()) == 3
        finally:
            await finish(rt, tmp_path, failovers=1)

    async def test_a_removal_that_meets_a_dead_member_removes_it_without_a_failover(self, ray_cluster, tmp_path):
        cfg = config(tmp_path, rollout_workers=3, fault_tolerance={"mode": "cold"})
        rt = runtime(cfg)
        await rt.start()
        try:
            await rt.sync()
            victim = next(m for m in rt.members() if m.member == "rollout-2")
            # a long call runs on every rollout; the removal waits for rollout-2's to end
            calling = asyncio.ensure_future(rt.rollout("generate", "p", 60, 0.05))
            await asyncio.sleep(0.5)
            removing = asyncio.ensure_future(rt.remove_rollouts(["rollout-2"]))
            await wait_until(lambda: records(rt, "scale_remove_started"), 30, "the removal to start")
            assert not removing.done() and "rollout-2" not in rt.serving_rollouts()
            t0 = time.monotonic()
            os.kill(victim.pid, signal.SIGKILL)  # it dies while being removed
            await removing
            # its call ended with its death: a wait for the call would last remove_calls_timeout_s out
            assert time.monotonic() - t0 < cfg.remove_calls_timeout_s / 2
            # the call it cut short is made again over the rollouts serving
            assert await calling == [("p", 1), ("p", 1)]
            states = {m.member: m.state for m in rt.members()}
            assert states["rollout-2"] == "RETIRED" and sorted(rt.serving_rollouts()) == ["rollout-0", "rollout-1"]
            await rt.trainer("train_step")
            await rt.sync()
            await assert_consistent(rt)
        finally:
            await finish(rt, tmp_path)
