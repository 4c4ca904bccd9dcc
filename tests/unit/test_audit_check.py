"""The audit checker: a well-behaved run passes; each planted fault is reported at its line."""

from __future__ import annotations

import io
import itertools
from pathlib import Path
from typing import Any

import pytest

from ftstate.core.audit import AuditTrail
from ftstate.core.audit_check import Violation, assert_trail_valid, check, check_trail
from ftstate.core.errors import AuditViolation

Record = dict[str, Any]


def tr(member: str, src: str, trigger: str, dst: str, *, wv: int = 0, gv: int = 1, **extra: Any) -> Record:
    """One transition record laid out as ftstate.core.machine writes it."""
    machine = "group" if member == "group" else "worker"
    rec: Record = {"event": "transition", "machine": machine, "member": member}
    if member != "group":
        rec["role"] = "trainer" if member.startswith("trainer") else "rollout"
        rec["rank"] = int(member.rsplit("-", 1)[-1])
    rec.update({"group_version": gv, "weights_version": wv, "from": src, "to": dst, "trigger": trigger})
    rec["seconds_in_state"] = 0.01
    rec.update(extra)
    return rec


def joined_rollout(member: str, wv: int = 0) -> list[Record]:
    return [
        tr(member, "INIT", "join", "RENDEZVOUS"),
        tr(member, "RENDEZVOUS", "joined", "STALE"),
        tr(member, "STALE", "resync", "RESYNCING"),
        tr(member, "RESYNCING", "verified", "RESYNCED", wv=wv),
        tr(member, "RESYNCED", "admit", "READY", wv=wv),
    ]


def good_run() -> list[Record]:
    """Start, one sync to weights version 1, lose rollout-2, promote a spare, stop."""
    return [
        tr("group", "INIT", "start", "RENDEZVOUS"),
        tr("trainer-0", "INIT", "join", "RENDEZVOUS"),
        tr("trainer-0", "RENDEZVOUS", "joined_as_source", "RESYNCED"),
        tr("trainer-0", "RESYNCED", "admit", "READY"),
        *joined_rollout("rollout-1"),
        *joined_rollout("rollout-2"),
        tr("group", "RENDEZVOUS", "rendezvous_done", "READY"),
        tr("spare-3", "INIT", "warm", "STANDBY"),
        # one sync: the group pushes version 1; every rollout commits it before the group does
        tr("group", "READY", "sync_start", "SYNCING", wv=1),
        tr("rollout-1", "READY", "sync", "SYNCING"),
        tr("rollout-2", "READY", "sync", "SYNCING"),
        tr("rollout-1", "SYNCING", "committed", "READY", wv=1),
        tr("rollout-2", "SYNCING", "committed", "READY", wv=1),
        tr("group", "SYNCING", "sync_done", "READY", wv=1),
        # rollout-2 dies; the spare replaces it and is resynced to version 1 before serving
        {
            "event": "error",
            "machine": "worker",
            "member": "rollout-2",
            "role": "rollout",
            "state": "READY",
            "error": "ActorDiedError",
            "message": "actor died",
            "weights_version": 1,
        },
        tr("rollout-2", "READY", "died", "LOST", wv=1),
        tr("group", "READY", "member_lost", "DEGRADED", wv=1),
        tr("group", "DEGRADED", "promote", "PROMOTING", wv=1),
        {
            "event": "budget_spent",
            "machine": "group",
            "member": "group",
            "state": "PROMOTING",
            "budget": "fault_tolerance.max_failovers",
            "limit": 5,
            "spent": 1,
            "remaining": 4,
            "weights_version": 1,
        },
        tr("spare-3", "STANDBY", "promote", "PROMOTING", role="rollout"),
        tr("spare-3", "PROMOTING", "join", "RENDEZVOUS", gv=2),
        tr("spare-3", "RENDEZVOUS", "joined", "STALE", gv=2),
        tr("spare-3", "STALE", "resync", "RESYNCING", gv=2),
        tr("spare-3", "RESYNCING", "verified", "RESYNCED", gv=2, wv=1),
        tr("group", "PROMOTING", "promoted", "RESYNCED", gv=2, wv=1),
        tr("spare-3", "RESYNCED", "admit", "READY", gv=2, wv=1),
        tr("group", "RESYNCED", "resume", "READY", gv=2, wv=1),
        tr("rollout-2", "LOST", "retire", "RETIRED", wv=1),
        {"event": "note", "reason": "done"},  # a runtime event: no machine, no state
        tr("trainer-0", "READY", "stop", "STOPPED", gv=2, wv=1),
        tr("rollout-1", "READY", "stop", "STOPPED", gv=2, wv=1),
        tr("spare-3", "READY", "stop", "STOPPED", gv=2, wv=1),
        tr("group", "READY", "stop", "STOPPED", gv=2, wv=1),
    ]


def index_of(recs: list[Record], member: str, trigger: str, nth: int = 0) -> int:
    hits = [i for i, r in enumerate(recs) if r.get("member") == member and r.get("trigger") == trigger]
    return hits[nth]


def write(path: Path, recs: list[Record]) -> Path:
    """Write the records through the real AuditTrail, so the format is the real one."""
    clock = itertools.count(0, 0.25)
    with AuditTrail(path, clock=lambda: next(clock)) as trail:
        for rec in recs:
            rec = dict(rec)
            trail.record(rec.pop("event"), **rec)
    return path


def line_of(index: int) -> int:
    return index + 1


def only(violations: list[Violation]) -> Violation:
    assert len(violations) == 1, "\n".join(map(str, violations))
    return violations[0]


class TestAWellBehavedRunPasses:
    def test_the_file_written_by_audit_trail_has_no_violation(self, tmp_path: Path) -> None:
        path = write(tmp_path / "audit.jsonl", good_run())
        assert check_trail(path) == []
        assert_trail_valid(path)

    def test_the_checker_counts_records_and_members(self, tmp_path: Path) -> None:
        recs = good_run()
        result = check(write(tmp_path / "audit.jsonl", recs))
        assert result.records == len(recs)
        assert len(result.members) == 5  # group, trainer-0, rollout-1, rollout-2, spare-3

    def test_in_memory_records_and_numbered_pairs_are_accepted(self) -> None:
        trail = AuditTrail()
        for rec in good_run():
            rec = dict(rec)
            trail.record(rec.pop("event"), **rec)
        assert check_trail(trail) == []
        assert check_trail(trail.records) == []
        assert check_trail(list(enumerate(trail.records, 1))) == []


class TestContinuity:
    def test_a_transition_that_leaves_a_state_the_member_is_not_in_is_reported(self, tmp_path: Path) -> None:
        recs = good_run()
        del recs[index_of(recs, "rollout-1", "resync")]  # rollout-1 is still STALE
        verified = index_of(recs, "rollout-1", "verified")
        v = only(check_trail(write(tmp_path / "a.jsonl", recs)))
        assert v.line == line_of(verified)
        assert v.member == "rollout-1"
        assert "continuity" in v.problem and "RESYNCING" in v.problem and "STALE" in v.problem

    def test_the_first_transition_must_leave_the_initial_state(self) -> None:
        v = only(check_trail([tr("group", "RENDEZVOUS", "rendezvous_done", "READY")]))
        assert v.line == 1
        assert "starts in INIT" in v.problem


class TestLegality:
    def test_a_trigger_the_state_does_not_accept_is_reported(self, tmp_path: Path) -> None:
        recs = good_run()
        i = index_of(recs, "rollout-1", "resync")
        recs[i]["trigger"] = "verified"  # STALE --verified--> RESYNCING is no edge
        v = only(check_trail(write(tmp_path / "a.jsonl", recs)))
        assert v.line == line_of(i)
        assert "illegal transition STALE --verified--> RESYNCING" in v.problem

    def test_a_trigger_that_leads_elsewhere_is_reported(self) -> None:
        recs = [tr("group", "INIT", "start", "READY")]
        v = only(check_trail(recs))
        assert "leads from INIT to RENDEZVOUS, not READY" in v.problem


class TestResyncedIsTheOnlyWayBackToServing:
    def test_serving_entered_from_stale_is_reported_in_those_words(self, tmp_path: Path) -> None:
        recs = good_run()
        for trigger in ("resync", "verified"):
            del recs[index_of(recs, "rollout-1", trigger)]
        admit = index_of(recs, "rollout-1", "admit")
        recs[admit]["from"] = "STALE"
        v = only(check_trail(write(tmp_path / "a.jsonl", recs)))
        assert v.line == line_of(admit)
        assert v.problem == "entered serving state READY from STALE without passing RESYNCED"

    def test_a_record_that_hides_where_the_member_really_was_is_still_caught(self) -> None:
        recs = [*joined_rollout("rollout-1")[:2], tr("rollout-1", "RESYNCED", "admit", "READY")]
        problems = [v.problem for v in check_trail(recs)]
        assert "entered serving state READY from STALE without passing RESYNCED" in problems


class TestNoStaleServing:
    def test_a_rollout_admitted_with_an_old_version_is_reported(self, tmp_path: Path) -> None:
        recs = good_run()
        admit = index_of(recs, "spare-3", "admit")
        recs[admit]["weights_version"] = 0
        v = only(check_trail(write(tmp_path / "a.jsonl", recs)))
        assert v.line == line_of(admit)
        assert v.member == "spare-3"
        assert v.problem.startswith("spare-3 serving weights version 0 while current is 1")

    def test_a_rollout_still_serving_the_old_version_when_the_group_commits_is_reported(
        self, tmp_path: Path
    ) -> None:
        recs = good_run()
        recs[index_of(recs, "rollout-2", "committed")]["weights_version"] = 0
        done = index_of(recs, "group", "sync_done")
        v = only(check_trail(write(tmp_path / "a.jsonl", recs)))
        assert v.line == line_of(done)
        assert v.member == "rollout-2"
        assert v.problem.startswith("rollout-2 serving weights version 0 while current is 1")

    def test_while_the_group_syncs_the_previous_version_may_still_serve(self) -> None:
        recs = good_run()
        assert recs[index_of(recs, "rollout-1", "sync")]["weights_version"] == 0
        assert check_trail(recs) == []

    def test_an_abandoned_sync_leaves_the_previous_version_current(self) -> None:
        recs = good_run()
        done = index_of(recs, "group", "sync_done")
        # The group gives up on version 1 (its record still carries the target it pushed) and
        # the rollouts fall back to serving version 0.
        recs[done] = tr("group", "SYNCING", "sync_failed", "READY", wv=1)
        for member in ("rollout-1", "rollout-2"):
            i = index_of(recs, member, "committed")
            recs[i] = tr(member, "SYNCING", "sync_aborted", "READY", wv=0)
            recs.insert(done, recs.pop(i))  # after the group's sync_failed: the check is strict then
        # Nothing after it may claim version 1 was committed.
        for rec in recs[done + 1 :]:
            if rec.get("weights_version") == 1:
                rec["weights_version"] = 0
        assert check_trail(recs) == []

    def test_a_rollout_holding_the_committed_version_back_for_a_safe_point_may_serve_the_one_before(
        self, tmp_path: Path
    ) -> None:
        """rollout_updates: in_flight: a rollout busy in a call commits by holding the version
        back (``swap_pending``); it keeps serving the one before until it swaps."""
        recs = good_run()
        i = index_of(recs, "rollout-2", "committed")
        recs[i] = tr("rollout-2", "SYNCING", "committed", "READY", wv=0, swap_pending=1)
        assert check_trail(write(tmp_path / "a.jsonl", recs)) == []
        # held back for another version than the one committed: it serves a stale one
        recs[i]["swap_pending"] = 2
        v = only(check_trail(write(tmp_path / "b.jsonl", recs)))
        assert v.problem.startswith("rollout-2 serving weights version 0 while current is 1")

    def test_trainers_are_not_held_to_the_rollout_rule(self) -> None:
        recs = good_run()
        recs[index_of(recs, "trainer-0", "admit")]["weights_version"] = 7
        assert check_trail(recs) == []


class TestTerminalIsFinal:
    def test_a_record_after_a_terminal_state_is_reported(self, tmp_path: Path) -> None:
        recs = good_run()
        recs.append(
            {"event": "error", "machine": "group", "member": "group", "error": "X", "message": "late"}
        )
        v = only(check_trail(write(tmp_path / "a.jsonl", recs)))
        assert v.line == len(recs)
        assert v.member == "group"
        assert "after group entered terminal state STOPPED" in v.problem
        assert f"(line {len(recs) - 1})" in v.problem


class TestMalformedInput:
    def test_an_unknown_machine_is_reported_with_its_line(self, tmp_path: Path) -> None:
        recs = good_run()
        recs.insert(3, {**tr("group", "INIT", "start", "RENDEZVOUS"), "machine": "trainer_group"})
        v = only(check_trail(write(tmp_path / "a.jsonl", recs)))
        assert v.line == 4
        assert "unknown machine 'trainer_group'" in v.problem

    def test_a_line_that_is_not_json_is_reported_and_the_rest_still_checked(self, tmp_path: Path) -> None:
        path = write(tmp_path / "a.jsonl", good_run())
        lines = path.read_text().splitlines(keepends=True)
        lines.insert(5, '{"event": "transition", "machine": "gro\n')
        path.write_text("".join(lines))
        v = only(check_trail(path))
        assert v.line == 6
        assert "not a JSON object" in v.problem

    def test_a_json_line_without_an_event_is_reported(self, tmp_path: Path) -> None:
        path = write(tmp_path / "a.jsonl", good_run())
        path.write_text(path.read_text() + '{"machine": "group"}\n')
        v = only(check_trail(path))
        assert v.line == len(good_run()) + 1
        assert "no 'event' field" in v.problem


class TestRaisingForTheFirstViolation:
    def test_assert_trail_valid_raises_audit_violation_naming_file_and_line(self, tmp_path: Path) -> None:
        recs = good_run()
        i = index_of(recs, "rollout-1", "resync")
        recs[i]["trigger"] = "verified"
        path = write(tmp_path / "a.jsonl", recs)
        with pytest.raises(
            AuditViolation, match=rf"a\.jsonl:{line_of(i)}: rollout-1: illegal transition"
        ) as info:
            assert_trail_valid(path)
        assert info.value.line == line_of(i)


class TestViews:
    """The timeline and the summary the `ftstate audit` command prints."""

    def test_the_summary_adds_up_each_members_story(self) -> None:
        from ftstate.cli.audit_view import summarize

        s = summarize(good_run())
        assert list(s) == ["group", "trainer-0", "rollout-1", "rollout-2", "spare-3"]
        assert s["rollout-2"]["final"] == "RETIRED"
        assert s["rollout-2"]["errors"] == ["actor died"]
        assert s["rollout-1"]["role"] == "rollout" and s["rollout-1"]["rank"] == 1
        assert s["spare-3"]["states"][:3] == ["INIT", "STANDBY", "PROMOTING"]
        assert s["group"]["transitions"] == 9
        assert s["group"]["seconds"]["READY"] == pytest.approx(0.03)  # left three times

    def test_the_timeline_has_a_row_per_record_and_highlights_faults(self) -> None:
        from rich.console import Console

        from ftstate.cli.audit_view import render_summary, render_timeline

        recs = good_run()
        recs.insert(
            5,
            {
                "event": "deadline_expired",
                "machine": "group",
                "member": "group",
                "state": "RENDEZVOUS",
                "message": "rendezvous timed out after 600s (init_timeout_s); missing: ['rollout-2']",
            },
        )
        table = render_timeline(recs)
        assert table.row_count == len(recs)
        assert table.rows[5].style == "bold red"
        console = Console(width=250, record=True, file=io.StringIO())
        console.print(table)
        console.print(render_summary(recs))
        text = console.export_text()
        assert "missing: ['rollout-2']" in text  # brackets are text, not markup
        assert "RESYNCED → READY" in text


def with_checksums(recs: list[Record], sent: str = "00000000000000aa") -> list[Record]:
    """good_run() as the runtime writes it now: the group's sync_done carries the sender's
    checksum, each rollout's committed / verified record the checksum of what it holds."""
    for member, trigger in (("group", "sync_done"), ("rollout-1", "committed"), ("rollout-2", "committed"),
                            ("spare-3", "verified")):
        recs[index_of(recs, member, trigger)]["checksum"] = sent
    return recs


class TestHeldIsSent:
    """A rollout may serve a version only with its own checksum equal to the sender's."""

    def test_a_run_where_every_rollout_holds_what_was_sent_passes(self, tmp_path: Path) -> None:
        assert check_trail(write(tmp_path / "a.jsonl", with_checksums(good_run()))) == []

    def test_a_rollout_committed_with_a_checksum_of_its_own_is_flagged_when_the_group_commits(
        self, tmp_path: Path
    ) -> None:
        # The run took rollout-2 out of serving (SYNCING --sync_failed--> STALE, its held checksum
        # on the record); a trail doctored to say it committed keeps that checksum and is caught.
        recs = with_checksums(good_run())
        recs[index_of(recs, "rollout-2", "committed")]["checksum"] = "00000000000000bb"
        done = index_of(recs, "group", "sync_done")
        v = only(check_trail(write(tmp_path / "a.jsonl", recs)))
        assert v.line == line_of(done)
        assert v.member == "rollout-2"
        assert v.problem == ("rollout-2 serving weights version 1 with checksum 00000000000000bb, "
                             "the sender's is 00000000000000aa")

    def test_a_rollout_that_reports_no_checksum_of_its_own_is_flagged(self) -> None:
        recs = with_checksums(good_run())
        del recs[index_of(recs, "rollout-1", "committed")]["checksum"]
        v = only(check_trail(recs))
        assert v.member == "rollout-1" and "no checksum of its own" in v.problem

    def test_a_newcomer_admitted_holding_other_bytes_is_flagged_at_its_admission(self) -> None:
        recs = with_checksums(good_run())
        recs[index_of(recs, "spare-3", "verified")]["checksum"] = "00000000000000cc"
        admit = index_of(recs, "spare-3", "admit")
        v = only(check_trail(recs))
        assert v.line == line_of(admit) and v.member == "spare-3"
        assert "with checksum 00000000000000cc, the sender's is 00000000000000aa (entered READY by admit)" in v.problem
