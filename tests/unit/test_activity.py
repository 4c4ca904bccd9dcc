"""What a user worker says of its own work (``Worker.activity``) reaches the heartbeat: busy
while its call runs, its counter added to ftstate's progress; a value of the wrong shape is
the class's error at its start, naming the method and what was expected. The worker host runs
here in the test's process (no Ray: the host is a plain class that Ray wraps)."""

from __future__ import annotations

import asyncio

import pytest

from ftstate.core.errors import WorkerInitError
from ftstate.core.protocol import Beat, Info
from ftstate.core.worker import RolloutWorker
from ftstate.worker.host import WorkerHost


class Plain(RolloutWorker):
    def load_weights(self, state, version):
        pass


class Generating(Plain):
    def __init__(self) -> None:
        self.now: tuple[bool, int] | None = (False, 0)

    def activity(self):
        return self.now


def host(cls) -> WorkerHost:
    return WorkerHost("rollout-0", "rollout", cls, (), {}, "gloo", 1 << 20)


def test_a_worker_that_says_nothing_is_busy_only_with_ftstates_own_work():
    beat = asyncio.run(host(Plain).heartbeat(Beat()))
    assert beat.busy is False and beat.progress == 0


def test_a_workers_own_work_makes_the_heartbeat_busy_and_its_counter_moves_the_progress():
    h = host(Generating)
    h.progress = 7  # ftstate's own work so far
    h.user.now = (True, 5)
    beat = asyncio.run(h.heartbeat(Beat()))
    assert beat.busy is True and beat.progress == 12
    h.user.now = (True, 6)
    assert asyncio.run(h.heartbeat(Beat())).progress == 13
    h.user.now = None  # nothing to say now
    beat = asyncio.run(h.heartbeat(Beat()))
    assert beat.busy is False and beat.progress == 7


@pytest.mark.parametrize("value", [{"busy": True}, (1, 2), (True, 2.5), (True, True), (True,)])
def test_an_activity_of_the_wrong_shape_is_said_at_the_start_naming_the_method(value):
    class Wrong(Plain):
        def activity(self):
            return value

    h = host(Wrong)
    with pytest.raises(WorkerInitError) as info:
        asyncio.run(h.info(Info()))
    text = str(info.value)
    assert "activity()" in text and "(busy: bool, progress: int)" in text
