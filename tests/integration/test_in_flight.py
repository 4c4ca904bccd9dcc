"""In-flight updates (``rollout_updates: in_flight``) on a real local Ray cluster: ``sync()``
does not wait for generations in progress, a busy rollout swaps at its next safe point, an idle
one at once, and every guarantee of a barrier sync holds: a generation never computes with a mix
of two versions, what a rollout serves after a swap is proven by checksum, a refused version is
never loaded mid-generation, and a rollout that reaches no safe point is taken out of serving."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

import ftstate
from ftstate.core.audit_check import check_trail
from ftstate.core.protocol import Beat, ChaosCorrupt, UserCall
from tests.integration.workers import InFlightRollout, TinyTrainer

pytestmark = pytest.mark.ray


def config(tmp_path, **overrides) -> ftstate.RuntimeConfig:
    data = {
        "rollout_workers": 2,
        "rollout_updates": "in_flight",
        "bucket_size_mb": 0.0625,
        "init_timeout_s": 60,
        "sync_timeout_s": 30,
        "heartbeat_interval_s": 0.2,
        "heartbeat_timeout_s": 2.0,
        "audit_log": str(tmp_path / "audit.jsonl"),
        "fault_tolerance": {"enable": False},
    }
    data.update(overrides)
    return ftstate.RuntimeConfig.from_dict(data, environ={})


def runtime(cfg) -> ftstate.Runtime:
    return ftstate.Runtime(cfg, trainer=TinyTrainer, rollout=InFlightRollout)


async def started(rt, name: str, steps: int, **kw) -> asyncio.Future:
    """``name`` generating ``steps`` tokens, once its heartbeat says it is (busy: in a call)."""
    gen = asyncio.ensure_future(rt._calls.call(name, rt.handle(name), UserCall(
        "generate_steps", (["p"],), {"steps": steps, **kw}, versions=True)))
    await busy(rt, name)
    return gen


async def busy(rt, *names: str) -> None:
    """Until each of ``names`` says it is busy in a call (its heartbeat)."""
    for name in names:
        for _ in range(1200):
            if (await rt.handle(name).heartbeat.remote(Beat())).busy:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError(f"{name} never started generating")


async def held(rt, name: str) -> str:
    return await rt._calls.call(name, rt.handle(name), UserCall("checksum"))


def versions_of(tokens) -> list[int]:
    return [v for v, _ in tokens]


async def wait_until(check, what: str, bound_s: float) -> None:
    for _ in range(int(bound_s / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {bound_s}s: {what}")


class TestTwoModes:
    async def test_a_sync_returns_while_generations_run_and_they_swap_at_a_safe_point(self, ray_cluster, tmp_path):
        async with runtime(config(tmp_path)) as rt:
            first = await rt.sync()
            await rt.trainer("train_step")
            gens = [await started(rt, n, steps=60) for n in ("rollout-0", "rollout-1")]
            report = await rt.sync()
            # it returned with both generations still running: it did not wait for them
            assert not any(g.done() for g in gens)
            assert sorted(report.pending) == ["rollout-0", "rollout-1"] and report.weights_version == 2
            outs = await asyncio.gather(*gens)
            for out in outs:
                tokens = out.value[0]["tokens"]
                vs = versions_of(tokens)
                # one swap, between two tokens: never a mix, never back
                assert vs[0] == 1 and vs[-1] == 2 and vs == sorted(vs), vs
                # every token read exactly the weights of its version
                assert {c for v, c in tokens if v == 1} == {first.checksum}
                assert {c for v, c in tokens if v == 2} == {report.checksum}
                assert out.versions == (1, 2)
            await wait_until(lambda: all(rt._membership.get(n).machine.weights_version == 2
                                         for n in ("rollout-0", "rollout-1")), "both seen on version 2", 10)
            assert [await held(rt, n) for n in ("rollout-0", "rollout-1")] == [report.checksum] * 2
            assert {r["member"] for r in rt.audit.records if r["event"] == "swapped"} == {"rollout-0", "rollout-1"}
        assert check_trail(tmp_path / "audit.jsonl") == []

    async def test_an_idle_rollout_loads_at_once_and_a_busy_one_later(self, ray_cluster, tmp_path):
        async with runtime(config(tmp_path)) as rt:
            await rt.sync()
            await rt.trainer("train_step")
            gen = await started(rt, "rollout-0", steps=40)
            report = await rt.sync()
            assert report.pending == ("rollout-0",)
            assert await held(rt, "rollout-1") == report.checksum  # idle: loaded before sync() returned
            # the rollout one version behind still serves, within max_staleness (1)
            assert rt.serving_rollouts() == ["rollout-1"]
            out = await gen
            assert versions_of(out.value[0]["tokens"])[-1] == 2

    async def test_barrier_waits_for_the_generation(self, ray_cluster, tmp_path):
        async with runtime(config(tmp_path, rollout_updates="barrier")) as rt:
            await rt.sync()
            await rt.trainer("train_step")
            gen = await started(rt, "rollout-0", steps=40)
            report = await rt.sync()
            assert gen.done() and report.pending == ()
            assert set(versions_of(gen.result().value[0]["tokens"])) == {1}  # wholly on the old version

    async def test_max_staleness_zero_gives_a_rollout_behind_no_new_calls(self, ray_cluster, tmp_path):
        async with runtime(config(tmp_path, max_staleness=0)) as rt:
            await rt.sync()
            await rt.trainer("train_step")
            marker = tmp_path / "release"
            hold = asyncio.ensure_future(rt._calls.call("rollout-0", rt.handle("rollout-0"), UserCall(
                "wait_for", (str(marker),))))
            await asyncio.sleep(0.3)
            report = await rt.sync()
            assert report.pending == ("rollout-0",)
            outs = await rt.rollout_map("tag", ["a", "b", "c"], versions=True)
            assert all(o.versions == (2,) and o.value[1] == 2 for o in outs)  # all dealt to rollout-1
            marker.write_text("go")
            assert await hold == 1
            # the call ended without a safe point: the version is loaded before anything else
            await wait_until(lambda: rt._membership.get("rollout-0").machine.weights_version == 2,
                             "rollout-0 swapped after its call", 10)
            assert await held(rt, "rollout-0") == report.checksum


class TestGuarantees:
    async def test_a_refused_version_is_never_loaded_mid_generation(self, ray_cluster, tmp_path):
        async with runtime(config(tmp_path)) as rt:
            first = await rt.sync()
            await rt.trainer("train_step")
            gen = await started(rt, "rollout-0", steps=40)
            await rt.handle("rollout-1").chaos_corrupt_next_bucket.remote(ChaosCorrupt())
            with pytest.raises(ftstate.FTError):
                await rt.sync()
            out = await gen
            assert set(versions_of(out.value[0]["tokens"])) == {1}  # nothing was offered to swap
            assert out.versions == (1,)
            assert await held(rt, "rollout-0") == first.checksum
        assert check_trail(tmp_path / "audit.jsonl") == []

    async def test_a_rollout_that_reaches_no_safe_point_is_taken_out_of_serving_until_it_swaps(
            self, ray_cluster, tmp_path):
        async with runtime(config(tmp_path, safe_point_timeout_s=0.5)) as rt:
            await rt.sync()
            await rt.trainer("train_step")
            gen = await started(rt, "rollout-0", steps=60, safe_points=False)
            report = await rt.sync()
            m = rt._membership.get("rollout-0")
            await wait_until(lambda: m.machine.state in ("SUSPECT", "STALE"), "suspected past the bound", 10)
            assert "rollout-0" not in rt.serving_rollouts()
            out = await gen
            assert set(versions_of(out.value[0]["tokens"])) == {1}
            # its call ended: the version loads, is proven, and the rollout serves again
            await wait_until(lambda: m.machine.state == "READY" and m.machine.weights_version == 2,
                             "back to serving on version 2", 15)
            assert await held(rt, "rollout-0") == report.checksum
            reasons = [r.get("reason", "") for r in rt.audit.records
                       if r.get("member") == "rollout-0" and r.get("trigger") == "heartbeat_missed"]
            assert any("safe_point_timeout_s" in why for why in reasons)
        assert check_trail(tmp_path / "audit.jsonl") == []


class TestFaultsInFlight:
    def ft(self, tmp_path, **kw):
        return config(tmp_path, fault_tolerance={"enable": True, "mode": "standby", "max_failovers": 4,
                                                 "reverse_weight_sync": True}, failover_timeout_s=60, **kw)

    @staticmethod
    def replaced_within(rt) -> float:
        """The bound on a loss's replacement serving: its detection, then failover_timeout_s."""
        return rt.config.heartbeat_timeout_s + rt.config.failover_timeout_s

    async def test_a_rollout_killed_mid_generation_with_a_version_waiting_is_replaced_on_the_newest(
            self, ray_cluster, tmp_path):
        async with runtime(self.ft(tmp_path)) as rt:
            await rt.sync()
            await rt.trainer("train_step")
            items = [f"p{i}" for i in range(4)]
            mapped = asyncio.ensure_future(rt.rollout_map("generate_shard", items, 60, 0.05))
            await busy(rt, "rollout-0", "rollout-1")
            report = await rt.sync()
            assert report.pending  # the generations run on
            victim = rt._membership.get("rollout-1")
            os.kill(victim.pid, signal.SIGKILL)
            outs = await mapped  # its shard dealt again: every item answered
            assert [o["prompt"] for o in outs] == items
            await wait_until(lambda: len(rt.serving_rollouts()) == 2, "a replacement serving",
                             self.replaced_within(rt))
            names = rt.serving_rollouts()
            await wait_until(lambda: all(rt._membership.get(n).machine.weights_version == 2 for n in names),
                             "every serving rollout on version 2", 15)
            assert [await held(rt, n) for n in names] == [report.checksum] * 2
        assert check_trail(tmp_path / "audit.jsonl") == []

    async def test_the_trainer_lost_while_generations_run_is_rebuilt_on_the_newest_committed_version(
            self, ray_cluster, tmp_path):
        async with runtime(self.ft(tmp_path)) as rt:
            await rt.sync()
            await rt.trainer("train_step")
            gens = [await started(rt, n, steps=60) for n in ("rollout-0", "rollout-1")]
            report = await rt.sync()
            assert report.pending
            await rt.chaos.kill("trainer", 0)
            await rt.trainer("train_step")  # on the rebuilt trainer, from a rollout holding version 2
            outs = await asyncio.gather(*gens)  # the generations went on
            assert all(versions_of(o.value[0]["tokens"])[-1] == 2 for o in outs)
            after = await rt.sync()
            assert after.weights_version == 3
            assert [await held(rt, n) for n in rt.serving_rollouts()] == [after.checksum] * 2
        assert check_trail(tmp_path / "audit.jsonl") == []

    async def test_a_stopped_rollout_holding_a_swap_is_lost_and_replaced(self, ray_cluster, tmp_path):
        async with runtime(self.ft(tmp_path)) as rt:
            await rt.sync()
            await rt.trainer("train_step")
            gen = await started(rt, "rollout-0", steps=200)
            report = await rt.sync()
            assert report.pending == ("rollout-0",)
            await rt.chaos.hang("rollout", 0)
            try:
                # From the trail, not the live state: a replacement retires the lost member
                # within milliseconds, faster than a poll can see LOST.
                await wait_until(lambda: any(
                    r["event"] == "transition" and r.get("member") == "rollout-0" and r.get("to") == "LOST"
                    for r in rt.audit.records), "LOST", 20)
                await wait_until(lambda: len(rt.serving_rollouts()) == 2, "a replacement serving",
                             self.replaced_within(rt))
                names = rt.serving_rollouts()
                assert "rollout-0" not in names
                assert [await held(rt, n) for n in names] == [report.checksum] * 2
            finally:
                rt.chaos.release()
                gen.cancel()
        assert check_trail(tmp_path / "audit.jsonl") == []

    async def test_a_later_sync_that_fails_swaps_nothing_of_its_version(self, ray_cluster, tmp_path):
        async with runtime(self.ft(tmp_path, sync_retries=0)) as rt:
            await rt.sync()
            await rt.trainer("train_step")
            gen = await started(rt, "rollout-0", steps=80)
            second = await rt.sync()  # rollout-0 is told version 2 waits
            assert second.pending == ("rollout-0",)
            await rt.trainer("train_step")
            await rt.handle("rollout-1").chaos_corrupt_next_bucket.remote(ChaosCorrupt())
            with pytest.raises(ftstate.FTError):
                await rt.sync()  # version 3 refused by the vote
            out = await gen
            assert set(versions_of(out.value[0]["tokens"])) <= {1, 2}  # 3 was never offered
            assert await held(rt, "rollout-0") == second.checksum
        assert check_trail(tmp_path / "audit.jsonl") == []
