"""A rollout that declares itself lost (``RolloutWorker.declare_lost``, e.g. a process of its
engine died) ends its vigil with that error, from any thread, before or while the vigil waits;
outside a run the call does nothing. The host runs in the test's process (no Ray)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ftstate.core.errors import EngineProcessDied
from ftstate.core.protocol import Vigil
from ftstate.core.worker import RolloutWorker
from ftstate.worker.host import WorkerHost


class Engine(RolloutWorker):
    def load_weights(self, state, version):
        pass


def died() -> EngineProcessDied:
    return EngineProcessDied(process="VLLM::Worker_TP1", pid=4242, how="was killed by SIGKILL")


def host() -> WorkerHost:
    return WorkerHost("rollout-0", "rollout", Engine, (), {}, "gloo", 1 << 20)


def test_a_vigil_waiting_ends_with_the_error_declared_from_another_thread():
    h = host()

    async def main():
        vigil = asyncio.ensure_future(h.vigil(Vigil()))
        await asyncio.sleep(0)  # the vigil is waiting
        assert not vigil.done()
        threading.Thread(target=h.user.declare_lost, args=(died(),)).start()
        with pytest.raises(EngineProcessDied, match=r"^rollout-0: engine process VLLM::Worker_TP1 \(pid 4242\) "
                                                     r"was killed by SIGKILL") as caught:
            await asyncio.wait_for(vigil, 10)
        assert caught.value.member == "rollout-0"  # the engine did not know; the host names it

    asyncio.run(main())


def test_a_vigil_started_after_the_declaration_ends_at_once_and_so_does_every_later_one():
    h = host()
    h.user.declare_lost(died())

    async def main():
        for _ in range(2):
            with pytest.raises(EngineProcessDied):
                await asyncio.wait_for(h.vigil(Vigil()), 10)

    asyncio.run(main())


def test_outside_a_run_declaring_lost_does_nothing():
    Engine().declare_lost(died())  # no host: nothing to tell, nothing raised


def test_the_error_names_the_process_and_keeps_its_fields_across_a_pickle():
    import pickle

    err = pickle.loads(pickle.dumps(EngineProcessDied(process="VLLM::Worker_TP0", pid=7, how="died", member="rollout-1")))
    assert (err.process, err.pid, err.how, err.member) == ("VLLM::Worker_TP0", 7, "died", "rollout-1")
    assert str(err).startswith("rollout-1: engine process VLLM::Worker_TP0 (pid 7) died")
