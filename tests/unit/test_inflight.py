"""The in-flight swap's own rules, without a process: the newest committed version waits,
only the swap takes it, and the user's worker reads its version through the host."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from ftstate.core.worker import RolloutWorker
from ftstate.worker.inflight import PendingSwap, SafePointGate


def staged(version: int) -> SimpleNamespace:
    return SimpleNamespace(weights_version=version)


class TestPendingSwap:
    def test_a_newer_committed_version_replaces_one_still_waiting_and_an_older_never_does(self):
        p = PendingSwap()
        p.offer(staged(2))
        p.offer(staged(3))
        p.offer(staged(1))  # late: never goes back
        assert p.version == 3 and p.peek().weights_version == 3
        assert p.take().weights_version == 3
        assert p.take() is None and p.version is None

    def test_only_one_taker_gets_the_version(self):
        p = PendingSwap()
        p.offer(staged(5))
        got: list[object] = []
        threads = [threading.Thread(target=lambda: got.append(p.take())) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [g.weights_version for g in got if g is not None] == [5]


class _Host:
    def __init__(self) -> None:
        self.weights_version = 4
        self.asked: list[bool] = []

    def swap_at_safe_point(self, pause: bool) -> int:
        self.asked.append(pause)
        self.weights_version += 1
        return self.weights_version


class TestTheUsersView:
    def test_safe_point_swaps_through_the_host_and_weights_version_reads_the_hosts(self):
        class R(RolloutWorker):
            def load_weights(self, state, version):
                pass

        r, host = R(), _Host()
        assert r.safe_point() == 0 and r.weights_version == 0  # outside a run: nothing to swap
        r.__dict__["_ftstate_gate"] = SafePointGate(host)
        assert r.weights_version == 4
        assert r.safe_point(pause=True) == 5 and host.asked == [True]
        assert r.weights_version == 5

    def test_an_engine_that_keeps_its_own_version_attribute_still_can(self):
        class Engine(RolloutWorker):
            def load_weights(self, state, version):
                self.weights_version = version  # as VLLMRollout does

        e = Engine()
        e.load_weights({}, 7)
        assert e.weights_version == 7
