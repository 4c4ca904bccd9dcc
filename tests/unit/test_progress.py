"""Start-up says what it waits for, and warns when the workers asked for far outnumber the CPUs."""

from __future__ import annotations

from ftstate.controller.progress import OVERSUBSCRIBED_RATIO, Progress


class TestTheOversubscribedWarning:
    def test_far_more_processes_than_cpus_warn_once_with_the_numbers(self):
        progress, heard = Progress(), []
        progress.listen(heard.append)
        assert progress.check_capacity(9, 2.0)
        assert [(e.phase, e.level, e.facts) for e in heard] == [
            ("oversubscribed", "warning", {"processes": 9, "cpus": 2.0})]
        assert "9 worker processes" in heard[0].message and "2 CPUs" in heard[0].message

    def test_up_to_the_ratio_nothing_is_said(self):
        progress, heard = Progress(), []
        progress.listen(heard.append)
        assert not progress.check_capacity(int(OVERSUBSCRIBED_RATIO * 2), 2.0)
        assert not progress.check_capacity(100, 0)  # a cluster that reports no CPUs: nothing to compare
        assert heard == [] and progress.last is None
