"""The runtime on a real local Ray cluster: real actors, real gloo groups, real SIGKILLs.

Fault tolerance is off in this module: a lost member must fail the run fast, with a typed
error naming it, and lose nothing (the other rollouts keep the last committed version,
proven by checksum). Failover is tested in test_failover.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest

import ftstate
from ftstate.core.audit_check import check_trail
from ftstate.core.errors import ChecksumMismatch, ConfigError, MemberLost, NoServingWorkers, RendezvousTimeout
from ftstate.core.protocol import ChaosCorrupt, ChaosKill, UserCall
from tests.integration.workers import TinyRollout, TinyTrainer
from tests.timing import SLACK_S

pytestmark = pytest.mark.ray


def config(tmp_path, **overrides) -> ftstate.RuntimeConfig:
    data = {
        "rollout_workers": 2,
        "bucket_size_mb": 0.0625,  # 64 KiB buckets: even tiny models span several
        "init_timeout_s": 60,
        "sync_timeout_s": 30,
        "heartbeat_interval_s": 0.2,
        "heartbeat_timeout_s": 1.0,
        "audit_log": str(tmp_path / "audit.jsonl"),
    }
    data.update(overrides)
    return ftstate.RuntimeConfig.from_dict(data, environ={})


def runtime(cfg, **kw) -> ftstate.Runtime:
    return ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=TinyRollout, **kw)


async def checksums(rt) -> tuple[str, list[str]]:
    return await rt.trainer("checksum"), await rt.rollout("checksum")


def events(rt, member, event="transition"):
    return [r for r in rt.audit.records if r.get("member") == member and r["event"] == event]


def assert_gone(ray, run_id: str, pids) -> None:
    """No actor of the run is registered and none of its processes is alive."""
    deadline = time.monotonic() + 10
    while True:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        alive = [p for p in pids if p and _alive(p)]
        leftover = [n for n in names if run_id in n]
        if not leftover and not alive:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"leaked actors {leftover}, live pids {alive}")
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone between the kill(0) and the read
        return False


async def wait_until(predicate, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


class TestHappyPath:
    async def test_three_rounds_every_rollout_holds_the_trainers_weights_bit_for_bit(self, ray_cluster, tmp_path):
        async with runtime(config(tmp_path)) as rt:
            assert rt.state == "READY"
            with pytest.raises(NoServingWorkers, match="no rollout serves the current weights version 0"):
                await rt.rollout("generate", "hi")
            for step in range(1, 4):
                await rt.trainer("train_step")
                report = await rt.sync()
                assert report.weights_version == step
                trainer_sum, rollout_sums = await checksums(rt)
                assert report.checksum == trainer_sum
                assert rollout_sums == [trainer_sum, trainer_sum]
                assert await rt.rollout("generate", "p") == [("p", step), ("p", step)]
            members = {m.member: m for m in rt.members()}
            assert {n: (m.state, m.weights_version) for n, m in members.items()} == {
                "trainer-0": ("READY", 3), "rollout-0": ("READY", 3), "rollout-1": ("READY", 3)}
            assert all(m.pid and m.node == "127.0.0.1" for m in members.values())
            assert report.nbytes > 0 and report.group_version == 1
        assert check_trail(tmp_path / "audit.jsonl") == []

    async def test_every_transition_in_the_trail_carries_pid_and_node(self, ray_cluster, tmp_path):
        async with runtime(config(tmp_path)) as rt:
            await rt.sync()
            pids = {m.member: m.pid for m in rt.members()}
        for rec in rt.audit.records:
            if rec.get("machine") == "worker" and rec["event"] == "transition" and rec["from"] != "INIT":
                assert rec["pid"] == pids[rec["member"]] and rec["node"] == "127.0.0.1"


class TestFailFastRendezvous:
    async def test_a_rollout_whose_init_never_returns_times_out_naming_it_and_nothing_is_left(
        self, ray_cluster, tmp_path
    ):
        cfg = config(tmp_path, init_timeout_s=12)
        rt = runtime(cfg, rollout_kwargs={"hang_marker": str(tmp_path / "hang-once")})
        t0 = time.monotonic()
        with pytest.raises(RendezvousTimeout) as info:
            await rt.start()
        elapsed = time.monotonic() - t0
        # the deadline plus scheduling: without it the hung init is waited for for ever
        assert cfg.init_timeout_s <= elapsed < cfg.init_timeout_s + SLACK_S, elapsed
        err = info.value
        assert len(err.missing) == 1 and err.missing[0].startswith("rollout-")
        assert set(err.arrived) == {"trainer-0", "rollout-0", "rollout-1"} - set(err.missing)
        assert err.group_version == 1 and err.seconds == 12
        assert f"missing: {err.missing[0]}" in str(err)
        assert rt.state == "FAILED"
        assert_gone(ray_cluster, rt.run_id, [m.pid for m in rt.members()])

    async def test_a_rollout_killed_during_init_fails_start_at_once_naming_it(self, ray_cluster, tmp_path):
        """Fault tolerance off: a death before the first group forms is MemberLost at once,
        not a wait for init_timeout_s; nothing of the run is left."""
        marker = tmp_path / "hang-once"
        cfg = config(tmp_path, init_timeout_s=60)
        rt = runtime(cfg, rollout_kwargs={"hang_marker": str(marker)})
        starting = asyncio.ensure_future(rt.start())
        await wait_until(lambda: marker.exists() and marker.read_text().strip(), 60, "a rollout to hang in init")
        os.kill(int(marker.read_text()), signal.SIGKILL)
        with pytest.raises(MemberLost, match=r"rollout-\d lost") as info:
            # the death ends the start; waiting for the rollout would last init_timeout_s out
            await asyncio.wait_for(starting, cfg.init_timeout_s / 2)
        assert "process died" in str(info.value)
        assert rt.state == "FAILED" and not rt.failovers
        assert_gone(ray_cluster, rt.run_id, [m.pid for m in rt.members()])

    def test_init_timeout_comes_from_the_environment(self):
        cfg = ftstate.RuntimeConfig.from_dict({}, environ={"FTSTATE_INIT_TIMEOUT_S": "42"})
        assert cfg.init_timeout_s == 42


class TestDetection:
    async def test_a_rollout_sigkilled_between_syncs_fails_the_run_naming_it(self, ray_cluster, tmp_path):
        async with runtime(config(tmp_path)) as rt:
            await rt.sync()
            trainer_sum, _ = await checksums(rt)
            victim = next(m for m in rt.members() if m.member == "rollout-1")
            t_kill = time.monotonic()
            os.kill(victim.pid, signal.SIGKILL)
            await wait_until(lambda: rt.state == "FAILED", 5, "the group to fail")
            lost = [r for r in events(rt, "rollout-1") if r["to"] == "LOST"]
            assert lost and lost[0]["trigger"] == "died"  # seen as its death, not by a heartbeat timeout
            with pytest.raises(MemberLost, match="rollout-1 lost"):
                await rt.sync()
            survivor = await rt._calls.call("rollout-0", rt.handle("rollout-0"), UserCall("checksum"))
            assert survivor == trainer_sum
            print(f"detection latency (idle SIGKILL -> FAILED): {time.monotonic() - t_kill:.3f}s")

    async def test_a_rollout_sigkilled_mid_sync_loses_nothing(self, ray_cluster, tmp_path):
        cfg = config(tmp_path)
        async with runtime(cfg, trainer_kwargs={"big_floats": 2_000_000}) as rt:
            await rt.sync()
            v1 = await rt.trainer("checksum")
            await rt.trainer("train_step")
            # The victim kills itself (SIGKILL) after its third bucket of the next sync arrived.
            await rt.handle("rollout-1").chaos_kill.remote(ChaosKill(3))
            with pytest.raises(MemberLost, match="rollout-1"):
                await rt.sync()
            assert rt.state == "FAILED"
            survivor = await rt._calls.call("rollout-0", rt.handle("rollout-0"), UserCall("checksum"))
            assert survivor == v1, "the survivor must keep the last committed version intact"
            states = {m.member: m.state for m in rt.members()}
            assert states["rollout-1"] == "LOST"

    async def test_a_hung_rollout_becomes_suspect_then_lost(self, ray_cluster, tmp_path):
        cfg = config(tmp_path, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
        async with runtime(cfg) as rt:
            await rt.sync()
            victim = next(m for m in rt.members() if m.member == "rollout-0")
            os.kill(victim.pid, signal.SIGSTOP)  # alive, but makes no progress at all
            try:
                # the timeout, a poll to miss the beat and one to declare it, and scheduling
                bound = cfg.heartbeat_timeout_s + 2 * cfg.heartbeat_interval_s + SLACK_S
                t0 = time.monotonic()
                await wait_until(lambda: rt.state == "FAILED", 2 * bound, "the hung rollout to be declared lost")
                elapsed = time.monotonic() - t0
            finally:
                with_suppress_kill(victim.pid)
            states = [r["to"] for r in events(rt, "rollout-0")]
            assert states[-2:] == ["SUSPECT", "LOST"]
            lost = events(rt, "rollout-0")[-1]
            assert lost["trigger"] == "heartbeat_timeout" and lost["error"] == "HeartbeatTimeout"
            assert cfg.heartbeat_timeout_s <= elapsed < bound, elapsed
            with pytest.raises(MemberLost, match="rollout-0"):
                await rt.rollout("generate", "x")


def with_suppress_kill(pid: int) -> None:
    for sig in (signal.SIGKILL, signal.SIGCONT):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class TestAtomicSync:
    async def test_a_corrupted_bucket_aborts_the_sync_and_every_rollout_keeps_the_previous_version(
        self, ray_cluster, tmp_path
    ):
        async with runtime(config(tmp_path)) as rt:
            await rt.sync()
            v1 = await rt.trainer("checksum")
            await rt.trainer("train_step")
            await rt.handle("rollout-1").chaos_corrupt_next_bucket.remote(ChaosCorrupt())
            with pytest.raises(ChecksumMismatch, match="rollout-1"):
                await rt.sync()
            # Nobody committed: both rollouts still serve version 1, which is still current.
            assert rt.weights_version == 1 and rt.state == "READY"
            assert await rt.rollout("checksum") == [v1, v1]
            assert await rt.rollout("generate", "q") == [("q", 1), ("q", 1)]
            report = await rt.sync()  # the group is intact: the next sync goes through
            assert report.weights_version == 2
            assert await rt.rollout("checksum") == [report.checksum] * 2
        assert check_trail(tmp_path / "audit.jsonl") == []


    async def test_a_trainer_whose_state_dict_fails_fails_the_sync_fast_and_the_next_one_works(
        self, ray_cluster, tmp_path
    ):
        """A participant that fails without dying, before sending anything: the rollouts
        waiting for its manifest are released at once (not at sync_timeout_s), keep their
        version, and the group is formed again for the next sync."""
        cfg = config(tmp_path, sync_timeout_s=60)
        async with runtime(cfg) as rt:
            await rt.sync()
            v1 = await rt.trainer("checksum")
            await rt.trainer("train_step")
            await rt.trainer("fail_next_state_dict")
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match="simulated user error"):
                await rt.sync()
            assert time.monotonic() - t0 < cfg.sync_timeout_s / 2  # a wait for the manifest lasts it all out
            assert rt.weights_version == 1 and rt.state == "READY"
            assert await rt.rollout("checksum") == [v1, v1]
            report = await rt.sync()
            assert report.weights_version == 2
            assert await rt.rollout("checksum") == [report.checksum] * 2
        assert check_trail(tmp_path / "audit.jsonl") == []


    async def test_a_rollout_whose_load_weights_raises_stops_serving_and_the_others_commit(
        self, ray_cluster, tmp_path
    ):
        async with runtime(config(tmp_path)) as rt:
            await rt.sync()
            await rt.trainer("train_step")
            await rt._calls.call("rollout-1", rt.handle("rollout-1"), UserCall("fail_next_load"))
            with pytest.raises(RuntimeError, match="simulated user error"):
                await rt.sync()
            # version 2 is committed: rollout-0 serves it, rollout-1 (torn by its own code) serves nothing
            assert rt.weights_version == 2 and rt.state == "READY"
            assert rt.serving_rollouts() == ["rollout-0"]
            assert await rt.rollout("checksum") == [await rt.trainer("checksum")]
            assert {m.member: m.state for m in rt.members()}["rollout-1"] == "STALE"
            report = await rt.sync()  # the next sync brings it back
            assert set(report.rollouts) == {"rollout-0", "rollout-1"}
            assert await rt.rollout("checksum") == [report.checksum] * 2
        assert check_trail(tmp_path / "audit.jsonl") == []


class TestBadInput:
    def test_a_trainer_that_is_not_a_trainer_worker_is_rejected(self, tmp_path):
        with pytest.raises(TypeError, match="trainer must be a TrainerWorker subclass"):
            ftstate.Runtime(config(tmp_path), trainer=TinyRollout, rollout=TinyRollout)

    @pytest.mark.parametrize(("overrides", "match"), [
        ({"fault_tolerance": {"enable": True}},
         r"fault_tolerance\.reverse_weight_sync: false: with 2 trainer ranks a replaced rank gets its part"),
        ({"shared_memory": "require"}, r"shared_memory: require: several trainer ranks send over the collective"),
        ({"backend": "nccl"}, r"backend: nccl: several trainer ranks run on gloo only"),
    ])
    def test_what_several_trainer_ranks_cannot_do_is_refused_naming_the_key(self, tmp_path, overrides, match):
        with pytest.raises(ConfigError, match=match):
            runtime(config(tmp_path, trainer_workers=2, **overrides))

    def test_a_maintenance_source_that_does_not_exist_is_refused_naming_it(self, tmp_path):
        with pytest.raises(ConfigError, match=r"fault_tolerance\.maintenance_sources\[1\]: must be one of"):
            config(tmp_path, fault_tolerance={"detect_node_maintenance": True, "maintenance_sources": ["gce", "gcp"]})

    async def test_calling_before_start_says_so(self, tmp_path):
        rt = runtime(config(tmp_path))
        with pytest.raises(ftstate.UsageError, match="the runtime is not started") as info:
            await rt.sync()
        assert not isinstance(info.value, ftstate.FTError)  # a programming error, not a fault

    async def test_an_unknown_method_names_the_worker(self, ray_cluster, tmp_path):
        async with runtime(config(tmp_path, rollout_workers=1)) as rt:
            with pytest.raises(ftstate.UserCodeError, match="trainer-0: TinyTrainer has no public method 'fly'"):
                await rt.trainer("fly")
            [err] = [r for r in rt.audit.records if r["event"] == "error"]
            assert (err["member"], err["call"], err["error"], err["state"]) == (
                "trainer-0", "fly", "UserCodeError", "READY")
