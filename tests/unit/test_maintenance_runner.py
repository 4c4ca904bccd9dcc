"""The maintenance runner with scripted watchers (no sockets): each notice reported once, a
moved deadline again, withdrawals only on complete polls, problems once per streak, and a
watcher that hangs bounded and not polled again until it returns."""

from __future__ import annotations

import asyncio
import threading
import time

from ftstate.controller.maintenance import MaintenanceWatcher, Notice, PollProblem, PollResult


class Scripted:
    """A watcher answering from a list of results (the last one repeats)."""

    source = "file"
    bound_s = 0.2

    def __init__(self, *results: PollResult) -> None:
        self.results = list(results)
        self.calls = 0

    def poll(self) -> PollResult:
        self.calls += 1
        return self.results[min(self.calls, len(self.results)) - 1]


class Hanging:
    source = "gce"
    bound_s = 0.05
    hold_s = 5.0  # how long a poll hangs unless released: what an unbounded runner would wait out

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def poll(self) -> PollResult:
        self.calls += 1
        self.release.wait(self.hold_s)
        return PollResult("gce")


N1 = Notice("file", "terminate", 100.0, node="a")
N1_MOVED = Notice("file", "terminate", 90.0, node="a")
N2 = Notice("file", "drain", None, node="b")
DOWN = PollProblem("file", "/x", "error", "EACCES")


def ok(*notices: Notice) -> PollResult:
    return PollResult("file", notices)


def failed(*notices: Notice, problem: PollProblem = DOWN) -> PollResult:
    return PollResult("file", notices, (problem,))


def run(watchers, rounds: int, **callbacks):
    events: list[tuple[str, object]] = []
    runner = MaintenanceWatcher(
        watchers, interval=0.01,
        on_notice=lambda n: events.append(("notice", n)),
        on_withdrawn=lambda n: events.append(("withdrawn", n)),
        on_problem=lambda p: events.append(("problem", p)),
        on_recovered=lambda label, k: events.append(("recovered", (label, k))),
        **callbacks,
    )

    async def go():
        for _ in range(rounds):
            await runner.poll_once()

    asyncio.run(go())
    runner.close()
    return runner, events


class TestNotices:
    def test_a_standing_notice_is_reported_once(self):
        _, events = run([Scripted(ok(N1))], 4)
        assert events == [("notice", N1)]

    def test_a_moved_deadline_is_reported_again(self):
        _, events = run([Scripted(ok(N1), ok(N1_MOVED))], 3)
        assert events == [("notice", N1), ("notice", N1_MOVED)]

    def test_a_notice_gone_from_a_complete_poll_is_withdrawn_after_the_new_ones(self):
        runner, events = run([Scripted(ok(N1), ok(N2))], 2)
        assert events == [("notice", N1), ("notice", N2), ("withdrawn", N1)]
        assert runner.current == [N2]

    def test_an_incomplete_poll_withdraws_nothing(self):
        runner, events = run([Scripted(ok(N1), failed(), failed(N2), ok(N2))], 4)
        assert events == [("notice", N1), ("problem", DOWN), ("notice", N2), ("withdrawn", N1),
                          ("recovered", ("file", 2))]
        assert runner.current == [N2]


class TestProblems:
    def test_a_lasting_problem_is_one_warning_and_its_end_one_recovery(self):
        _, events = run([Scripted(failed(), failed(), failed(), ok())], 6)
        assert events == [("problem", DOWN), ("recovered", ("file", 3))]

    def test_a_problem_of_another_kind_is_reported_again(self):
        other = PollProblem("file", "/x", "malformed", "not JSON")
        _, events = run([Scripted(failed(), failed(problem=other))], 3)
        assert events == [("problem", DOWN), ("problem", other)]

    def test_a_watcher_that_raises_or_returns_nonsense_is_a_problem(self):
        class Raising:
            source, bound_s = "aws", 0.1

            def poll(self):
                raise RuntimeError("bug")

        class Nonsense:
            source, bound_s = "azure", 0.1

            def poll(self):
                return ["not", "a", "result"]

        _, events = run([Raising(), Nonsense()], 2)
        assert [(k, p.source, p.problem) for k, p in events] == [("problem", "aws", "error"), ("problem", "azure", "error")]

    def test_a_hanging_poll_is_bounded_and_not_started_twice(self):
        hanging = Hanging()
        t0 = time.monotonic()
        _, events = run([hanging, Scripted(ok(N1))], 3, slack_s=0.05)
        took = time.monotonic() - t0
        hanging.release.set()
        assert hanging.calls == 1  # still running when the next rounds came: not piled up
        # bounded: 3 rounds of bound_s + slack_s (0.3 s); waiting the hang out takes hold_s (5 s):
        # half of it tells the two apart with seconds to spare for a loaded machine
        assert took < Hanging.hold_s / 2, took
        assert ("notice", N1) in events  # the other watcher was not held up
        problems = [p for k, p in events if k == "problem"]
        # the bound passed, then it was still running: the same problem, reported once
        assert [p.problem for p in problems] == ["timeout"]
        assert "longer than its bound of 0.1s" in problems[0].detail


def test_async_callbacks_are_awaited():
    seen: list[Notice] = []

    async def on_notice(n: Notice) -> None:
        await asyncio.sleep(0)
        seen.append(n)

    runner = MaintenanceWatcher([Scripted(ok(N1, N2))], interval=0.01, on_notice=on_notice)
    asyncio.run(runner.poll_once())
    runner.close()
    assert seen == [N1, N2]


def test_run_polls_every_interval_until_cancelled():
    w = Scripted(ok())
    runner = MaintenanceWatcher([w], interval=0.02)

    async def go():
        task = asyncio.create_task(runner.run())
        await asyncio.sleep(0.15)
        task.cancel()

    asyncio.run(go())
    runner.close()
    assert 4 <= w.calls <= 9 and runner.polls == w.calls


def test_watchers_added_and_removed_between_rounds():
    a, b = Scripted(ok(N1)), Scripted(ok(N2))
    b.label = "file@node-b"
    seen: list[Notice] = []
    withdrawn: list[Notice] = []
    runner = MaintenanceWatcher([a], interval=0.01, on_notice=seen.append, on_withdrawn=withdrawn.append)

    async def go():
        await runner.poll_once()
        runner.add([b])
        await runner.poll_once()
        assert runner.remove(["file@node-b"]) == [N2]
        await runner.poll_once()

    asyncio.run(go())
    runner.close()
    assert seen == [N1, N2] and withdrawn == [] and b.calls == 1 and a.calls == 3
    assert runner.current == [N1]
