"""``staging: node`` in the runtime: one node copy per node, atomic, the source of newcomers, cleaned up.

On one local Ray node every member shares the trainer's node, so with ``staging: node`` every
rollout verifies the incoming version in place in one node copy owned by the node's agent
(ftstate.controller.nodecopies) and loads from it only after the vote. What is checked: the
node holds exactly one copy at rest, named in the audit trail, gone when the runtime stops;
a sync that fails mid-transfer (a damaged bucket, a rollout SIGKILLed mid-read) leaves every
rollout holding its previous checksum and only the committed copy named; a newcomer on the
node resyncs from the copy with no transfer (route ``node_copy``), and the copy survives the
SIGKILL of the rollout it replaces; a runtime abandoned without ``close`` (a failed test)
leaves nothing once its run is swept; and the resident memory a rollout adds over the syncs
stays within 0.1x the weights plus two buckets, where private staging adds about 2x.
"""

from __future__ import annotations

import time

import pytest

import ftstate
from benchmarks.nodecopy import private, smaps
from ftstate.core.audit_check import check_trail
from ftstate.core.errors import ChecksumMismatch, FTError
from ftstate.core.protocol import ChaosCorrupt, UserCall
from ftstate.transport import nodecopy, shm
from tests.integration.test_failover import assert_consistent, finish, rollout_replaced
from tests.integration.test_failover import config as ft_config
from tests.integration.test_failover import runtime as ft_runtime
from tests.integration.test_runtime import config, runtime
from tests.integration.test_runtime_shm import resyncs
from tests.integration.workers import LayeredTrainer, PartsRollout, ResidentRollout, TinyTrainer, tiny_state

pytestmark = pytest.mark.ray

MiB = 1 << 20


def node_copies() -> list[str]:
    return [n for n in shm.list_segments() if nodecopy.is_copy(n)]


def holding_records(rt, member: str) -> list[dict]:
    """``member``'s records that say which version it holds (they carry its checksum): a
    sync's ``committed``, the ``verified`` and ``admit`` of a STALE rollout brought up to date."""
    return [r for r in rt.audit.records if r.get("member") == member and "checksum" in r
            and r["event"] in ("transition", "weights_loaded")]


def committed_copies(rt) -> list[str]:
    return [r["segment"] for r in rt.audit.records if r["event"] == "node_copy_committed"]


async def held(rt, member: str) -> str | None:
    """The checksum ``member`` holds (asked of its actor directly: the run may have failed)."""
    return await rt.handle(member).call.remote(UserCall("checksum"))


def sweep_run(run_id: str) -> None:
    """What a test that failed without closing its runtime leaves: its node agents own the
    node copies, so killing them makes the copies orphans, which the sweep removes."""
    import ray

    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(f"ftstate-{run_id}-node-"):
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    deadline = time.monotonic() + 10
    while any(shm.pid_alive(int(shm.parse_name(n)["pid"])) for n in node_copies()) and time.monotonic() < deadline:
        time.sleep(0.05)  # the agents' processes are going
    shm.sweep_orphans()


@pytest.fixture
def swept():
    """``swept(rt)``: the run of ``rt`` is swept after the test, whether it passed or not."""
    runs: list[str] = []

    def track(rt):
        runs.append(rt.run_id)
        return rt

    yield track
    for run_id in runs:
        sweep_run(run_id)


async def synced_once(rt) -> tuple[str, list[str]]:
    """One committed version (its checksum, and the node copies then), the trainer a step further."""
    await rt.sync()
    v1 = await rt.trainer("checksum")
    kept = node_copies()
    await rt.trainer("train_step")
    return v1, kept


class TestOneCopyPerNode:
    @pytest.mark.parametrize("spare", [False, True], ids=["fresh", "spare"])
    async def test_every_sync_lands_in_one_node_copy_which_is_gone_when_the_runtime_stops(
            self, ray_cluster, tmp_path, swept, spare):
        async with swept(runtime(config(tmp_path, staging="node", node_copy_spare=spare))) as rt:
            for step in range(3):
                await rt.trainer("train_step")
                report = await rt.sync()
                assert await rt.rollout("checksum") == [await rt.trainer("checksum")] * 2 == [report.checksum] * 2
                # the committed copy, and with a spare the one before it, kept to be rewritten
                at_rest = committed_copies(rt)[-2 if spare else -1:]
                assert sorted(node_copies()) == sorted(at_rest), (node_copies(), step)
                # the report says which copy the node holds, its size, and whether it was made
                # fresh or is the spare rewritten (with a spare, the third sync's is the first's)
                [(node, copy)] = report.node_copies.items()
                assert node == {m.member: m for m in rt.members()}["trainer-0"].node_id
                assert copy["segment"] == at_rest[-1]
                assert copy["nbytes"] == (shm.SHM_DIR / at_rest[-1]).stat().st_size >= report.nbytes
                assert copy["recycled"] is (spare and step == 2), (step, copy)
                # the node's peak staging: its copies, once for the node (no rollout stages
                # privately): the incoming one, and from the second sync the committed one kept
                assert report.node_staging_bytes == {node: copy["nbytes"] * (2 if step else 1)}, step
                assert set(report.staging_bytes.values()) == {0}
            assert report.routes == {"rollout-0": "shm", "rollout-1": "shm"} and report.shm_fallback is None
            assert len(set(committed_copies(rt))) == 3  # each version under a name of its own
        assert node_copies() == []
        assert check_trail(tmp_path / "audit.jsonl") == []

    async def test_a_lone_rollout_whose_engine_holds_its_weights_stages_privately_and_two_share_one_copy(
            self, ray_cluster, tmp_path, swept):
        """One rollout on the node that gives its weights back (held_weights()) gains nothing
        from a node copy (1x at rest, 2x during the sync, against nothing and 1x staging it
        privately, just as atomic): none is made. Two on the node share one."""
        from tests.integration.workers import HeldResidentRollout

        floats = (1 << 20) // 4
        for rollouts in (1, 2):
            cfg = config(tmp_path / str(rollouts), staging="node", rollout_workers=rollouts)
            rt = ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=HeldResidentRollout,
                                 trainer_kwargs={"big_floats": floats}, rollout_kwargs={"big_floats": floats})
            async with swept(rt):
                for _ in range(2):
                    await rt.trainer("train_step")
                    report = await rt.sync()
                    assert await rt.rollout("checksum") == [await rt.trainer("checksum")] * rollouts
                    assert report.routes == {f"rollout-{i}": "shm" for i in range(rollouts)}
                    if rollouts == 1:  # its private staging, once; it keeps nothing after the load
                        assert report.node_copies == {} and node_copies() == [], node_copies()
                        assert list(report.node_staging_bytes.values()) == [report.staging_bytes["rollout-0"]]
                        assert report.staging_bytes["rollout-0"] >= report.nbytes
                        assert report.held_bytes == {"rollout-0": 0}
                    else:
                        assert len(report.node_copies) == 1 and node_copies() == committed_copies(rt)[-1:]
                        assert set(report.staging_bytes.values()) == {0}
            assert node_copies() == []

    async def test_a_damaged_bucket_fails_the_sync_and_no_rollout_loads_anything(self, ray_cluster, tmp_path, swept):
        async with swept(runtime(config(tmp_path, staging="node"))) as rt:
            v1, kept = await synced_once(rt)
            await rt.handle("rollout-1").chaos_corrupt_next_bucket.remote(ChaosCorrupt())
            with pytest.raises(ChecksumMismatch, match="rollout-1"):
                await rt.sync()
            assert rt.weights_version == 1 and await rt.rollout("checksum") == [v1, v1]
            assert node_copies() == kept  # the rejected version's copy is unlinked
            report = await rt.sync()
            assert await rt.rollout("checksum") == [report.checksum] * 2 and node_copies() == committed_copies(rt)[-1:]
        assert check_trail(tmp_path / "audit.jsonl") == []

    async def test_a_rollout_killed_mid_read_leaves_the_other_on_its_version_and_the_copy_in_place(
            self, ray_cluster, tmp_path, swept):
        rt = ftstate.Runtime(config(tmp_path, staging="node"), trainer=TinyTrainer, rollout=ResidentRollout,
                             trainer_kwargs={"big_floats": 1_000_000})
        async with swept(rt):
            v1, kept = await synced_once(rt)
            await rt.chaos.kill("rollout", 0, after_progress=3)  # in the middle of its read
            with pytest.raises(FTError):
                await rt.sync()
            assert await held(rt, "rollout-1") == v1
            assert node_copies() == kept
        assert node_copies() == []

    async def test_a_runtime_abandoned_by_a_failed_test_leaves_nothing_once_its_run_is_swept(
            self, ray_cluster, tmp_path, swept):
        rt = swept(runtime(config(tmp_path, staging="node")))
        await rt.start()
        try:
            await rt.sync()
            assert len(node_copies()) == 1
            sweep_run(rt.run_id)  # what the fixture does after a test that never reached close()
            assert node_copies() == []
        finally:
            await rt.close()


class TestNewcomer:
    async def test_a_newcomer_resyncs_from_the_node_copy_which_survives_the_rollout_it_replaces(
            self, ray_cluster, tmp_path, swept):
        rt = swept(ft_runtime(ft_config(tmp_path).replace(staging="node")))
        await rt.start()
        try:
            record = await rollout_replaced(rt)
            resync = resyncs(rt, record.replacement)
            kept = committed_copies(rt)[-1:]
            assert resync[-1]["plan"]["routes"] == {record.replacement: "node_copy"}, resync
            assert resync[-1]["source"] == "node copy" and resync[-1]["plan"]["segment"] == kept[0]
            assert node_copies() == kept
            await assert_consistent(rt)
            report = await rt.sync()  # and the next sync goes through every rollout's copy again
            assert report.routes == {"rollout-0": "shm", record.replacement: "shm"}
            await assert_consistent(rt)
        finally:
            await finish(rt, tmp_path)
        assert node_copies() == []


    async def test_a_node_copy_gone_before_the_newcomer_is_a_recorded_fallback_to_point_to_point(
            self, ray_cluster, tmp_path, swept):
        rt = swept(ft_runtime(ft_config(tmp_path).replace(staging="node", resync_shared_memory_min_mb=0)))
        await rt.start()
        try:
            # as if someone removed it: the newcomer cannot map it
            record = await rollout_replaced(rt, before_kill=lambda: shm.unlink_names(node_copies()))
            fallback = [r for r in rt.audit.records if r["event"] == "node_copy_fallback"]
            assert fallback and fallback[0]["member"] == record.replacement, fallback
            assert "cannot be opened" in fallback[0]["reason"], fallback
            assert resyncs(rt, record.replacement)[-1]["plan"]["routes"] == {record.replacement: "shm"}
            await assert_consistent(rt)
        finally:
            await finish(rt, tmp_path)
        assert node_copies() == []

async def memory_after_syncs(tmp_path, staging: str, floats: int, syncs: int = 3) -> tuple[list[int], list[int]]:
    """Each rollout's growth in its own (anonymous) and proportional memory from its start (its engine's
    parameters already resident) to after ``syncs`` syncs."""
    cfg = config(tmp_path / staging, staging=staging, bucket_size_mb=4, heartbeat_interval_s=1.0, heartbeat_timeout_s=10.0)
    rt = ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=ResidentRollout, trainer_kwargs={"big_floats": floats},
                         rollout_kwargs={"big_floats": floats})
    async with rt:
        pids = [m.pid for m in rt.members() if m.member.startswith("rollout-")]
        before = [smaps(p) for p in pids]
        for _ in range(syncs):
            await rt.trainer("train_step")
            await rt.sync()
        after = [smaps(p) for p in pids]
    return ([private(a) - private(b) for a, b in zip(after, before, strict=True)],
            [a["Pss"] - b["Pss"] for a, b in zip(after, before, strict=True)])


class TestMemory:
    async def test_a_rollout_adds_no_private_copy_of_the_weights_and_the_node_one(self, ray_cluster, tmp_path):
        floats = 16 * MiB // 4  # 16 MiB of weights: big enough to tell a copy from noise
        weights, bucket = 16 * MiB, 4 * MiB
        slack = 24 * MiB  # the first sync's one-off allocations (threads, sockets, hashing, msgpack)
        node_private, node_pss = await memory_after_syncs(tmp_path, "node", floats)
        private_private, _ = await memory_after_syncs(tmp_path, "private", floats)
        print(f"rollout private growth: node {[p // MiB for p in node_private]} MiB, "
              f"private {[p // MiB for p in private_private]} MiB; Pss growth node {[p // MiB for p in node_pss]} MiB")
        for grew in node_private:
            assert grew <= 0.1 * weights + 2 * bucket + slack, node_private
        # the node's copy, shared by both rollouts: about 1x the weights in all, not 1x each
        assert sum(node_pss) <= weights + 2 * slack, node_pss
        # today's private staging: the committed copy and a spare in every rollout
        for grew in private_private:
            assert grew >= 1.5 * weights, private_private


class TestDeviceParts:
    async def test_an_engine_on_a_device_loads_each_version_from_the_node_copy_in_parts_of_one_bucket(
            self, ray_cluster, tmp_path, swept):
        """The GPU is mocked (the rollout's device is its CPU; tests/gpu/test_device_buckets.py
        measures a real one): what it is handed comes from the node copy in parts no larger than a
        bucket (bar a tensor larger than one), and it ends holding the trainer's weights."""
        cfg = config(tmp_path, staging="node")
        bucket = int(cfg.bucket_size_mb * MiB)
        rt = swept(ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=PartsRollout,
                                   trainer_kwargs={"big_floats": 3 * bucket // 4}))  # 3 buckets of float32
        async with rt:
            for _ in range(2):
                await rt.trainer("train_step")
                report = await rt.sync()
                assert await rt.rollout("checksum") == [await rt.trainer("checksum")] * 2 == [report.checksum] * 2
                assert report.held_bytes == {"rollout-0": 0, "rollout-1": 0}  # the engine's copy is the only one
                # each rollout's two device buffers, reported by the host: at most two of the larger
                # of a bucket and the largest tensor (here ``big``, three buckets)
                largest = max(t.numel() * t.element_size() for t in tiny_state(0, 3 * bucket // 4).values())
                assert set(report.device_bytes) == {"rollout-0", "rollout-1"}, report.device_bytes
                assert all(0 < b <= 2 * max(bucket, largest) for b in report.device_bytes.values()), \
                    report.device_bytes
                done = [r for r in rt.audit.records if r.get("machine") == "group" and r.get("trigger") == "sync_done"]
                assert done[-1]["device_bytes"] == dict(report.device_bytes)
                assert done[-1]["peak_device_bytes"] == max(report.device_bytes.values())
                # and each rollout's own record of holding the version says what its load took
                # (first sync: STALE brought up to date; then the committed edge)
                for name, nbytes in report.device_bytes.items():
                    assert holding_records(rt, name)[-1]["device_bytes"] == nbytes, holding_records(rt, name)[-1]
                for parts in await rt.rollout("parts"):
                    assert len(parts) >= 2 and parts[0][2] and parts[-1][3], parts
                    # a part is one bucket at most, or a single tensor larger than one
                    assert all(nbytes <= bucket or count == 1 for nbytes, count, _, _ in parts), parts
                    assert sum(count for _, count, _, _ in parts) == len(tiny_state(0, 3 * bucket // 4))

    @pytest.mark.parametrize("staging", ["node", "private"])
    async def test_a_newcomer_loaded_by_parts_records_its_device_memory_whichever_way_it_was_resynced(
            self, ray_cluster, tmp_path, swept, staging):
        """The GPU is mocked as above. rollout-1 is SIGKILLed and its spare promoted: with
        ``staging: node`` the newcomer adopts the node copy, with private staging it is sent the
        weights point to point by a holder; either way its engine loads by parts, and the record
        that says it holds the weights (its RESYNCED edge), the failover's record and its
        FailoverRecord carry the device memory of that load: at most two of the larger of a
        bucket and the largest tensor, which here is half the weights, so a load whole fails."""
        cfg = ft_config(tmp_path).replace(staging=staging)
        bucket = int(cfg.bucket_size_mb * MiB)
        shape = {"layers": 16, "layer_floats": bucket // 16}  # 16 tensors of a quarter bucket: 4 buckets
        state = LayeredTrainer(**shape).state
        weights = sum(t.numel() * t.element_size() for t in state.values())
        bound = 2 * max(bucket, max(t.numel() * t.element_size() for t in state.values()))
        assert bound <= weights / 2, (bound, weights)
        rt = swept(ftstate.Runtime(cfg, trainer=LayeredTrainer, rollout=PartsRollout, trainer_kwargs=shape))
        await rt.start()
        try:
            record = await rollout_replaced(rt)
            new = record.replacement
            routes = resyncs(rt, new)[-1]["plan"]["routes"]
            assert (routes == {new: "node_copy"}) is (staging == "node"), routes
            [proven] = [r for r in rt.audit.records if r["event"] == "transition" and r.get("member") == new
                        and r.get("to") == "RESYNCED"]
            assert 0 < proven["device_bytes"] <= bound, (proven, bound, weights)
            assert record.device_bytes == proven["device_bytes"], record
            [failover] = [r for r in rt.audit.records if r["event"] == "failover"]
            assert failover["device_bytes"] == proven["device_bytes"], failover
            # what the newcomer's engine was handed, seen from outside: parts of a bucket at most
            parts = await rt.handle(new).call.remote(UserCall("parts"))
            assert len(parts) >= 4 and parts[0][2] and parts[-1][3], parts
            assert all(nbytes <= bucket for nbytes, _, _, _ in parts), parts
            await assert_consistent(rt)
        finally:
            await finish(rt, tmp_path)
        assert node_copies() == []
