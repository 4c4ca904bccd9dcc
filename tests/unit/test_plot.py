"""The timeline picture: drawn from a real trail file, the size it promises, failovers and
lanes found where the trail puts them, and a clear error when there is nothing to draw."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from ftstate.cli.plot import STATE_COLORS, _drains, _failovers, _lanes, _notices, figure_size, plot_timeline
from ftstate.core.audit import AuditTrail, read_trail

ROLES = {
    "trainer-0": ("trainer", 0),
    "rollout-0": ("rollout", 1),
    "rollout-1": ("rollout", 2),
    "standby-0": ("rollout", 3),
}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Run:
    """Writes a small run's records through :class:`AuditTrail` on an injected clock."""

    def __init__(self, path: Path | None) -> None:
        self.clock = Clock()
        self.trail = AuditTrail(path, clock=self.clock)
        self.state: dict[str, str] = {}

    def worker(self, member: str, to: str, trigger: str, **fields) -> None:
        role, rank = ROLES[member]
        src = self.state.get(member, "INIT")
        self.trail.record(
            "transition",
            machine="worker",
            member=member,
            role=role,
            rank=rank,
            group_version=1,
            weights_version=0,
            **{"from": src, "to": to},
            trigger=trigger,
            **fields,
        )
        self.state[member] = to

    def group(self, to: str, trigger: str, **fields) -> None:
        src = self.state.get("group", "INIT")
        self.trail.record(
            "transition",
            machine="group",
            member="group",
            group_version=1,
            weights_version=0,
            **{"from": src, "to": to},
            trigger=trigger,
            **fields,
        )
        self.state["group"] = to

    def at(self, t: float) -> Run:
        self.clock.now = t
        return self


def write_run(path: Path | None, *, rewards: bool = True) -> AuditTrail:
    """Rendezvous, five syncs with a reward each, rollout-1 lost at t=6 and replaced by the
    standby (failover from t=6.5 to t=7.5), a sync deadline expiring on rollout-0."""
    run = Run(path)
    run.group("RENDEZVOUS", "start")
    run.worker("standby-0", "STANDBY", "warm")
    for m in ("trainer-0", "rollout-0", "rollout-1"):
        run.worker(m, "RENDEZVOUS", "join")
    run.at(1.0).group("READY", "rendezvous_done")
    run.worker("trainer-0", "RESYNCED", "joined_as_source")
    run.worker("trainer-0", "READY", "admit")
    for m in ("rollout-0", "rollout-1"):
        run.worker(m, "STALE", "joined")
        run.worker(m, "RESYNCING", "resync")
        run.worker(m, "RESYNCED", "verified")
        run.worker(m, "READY", "admit")
    members = ["rollout-0", "rollout-1"]
    for step in range(1, 6):
        t = 1.0 + 2.0 * step
        run.at(t).group("SYNCING", "sync_start")
        for m in ["trainer-0", *members]:
            run.worker(m, "SYNCING", "sync")
        run.at(t + 0.4)
        if step == 2:
            run.trail.record(
                "deadline_expired",
                machine="worker",
                member="rollout-0",
                role="rollout",
                rank=1,
                state="SYNCING",
                key="sync_timeout_s",
                seconds=0.4,
                error="SyncTimeout",
            )
            run.worker("rollout-0", "STALE", "sync_timeout")
            run.worker("rollout-0", "RESYNCING", "resync")
            run.worker("rollout-0", "RESYNCED", "verified")
            run.worker("rollout-0", "READY", "admit")
        for m in ["trainer-0", *members]:
            if run.state[m] == "SYNCING":
                run.worker(m, "READY", "committed")
        run.group("READY", "sync_done")
        if rewards:
            run.at(t + 0.5).trail.record("reward", step=step, reward=0.1 * step)
        if step == 2:
            run.at(6.0).worker("rollout-1", "LOST", "died", reason="SIGKILL")
            run.at(6.5).group("DEGRADED", "member_lost", reason="rollout-1 died")
            run.group("PROMOTING", "promote", reason="rollout-1 died")
            run.worker("standby-0", "PROMOTING", "promote")
            run.worker("standby-0", "RENDEZVOUS", "join")
            run.worker("standby-0", "STALE", "joined")
            run.worker("standby-0", "RESYNCING", "resync")
            run.at(7.3).worker("standby-0", "RESYNCED", "verified")
            run.worker("standby-0", "READY", "admit")
            run.group("RESYNCED", "promoted")
            run.at(7.5).group("READY", "resume")
            run.worker("rollout-1", "RETIRED", "retire")
            members = ["rollout-0", "standby-0"]
    run.at(12.0)
    for m in ("trainer-0", *members):
        run.worker(m, "STOPPED", "stop")
    run.group("STOPPED", "stop")
    run.trail.close()
    return run.trail


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


@pytest.fixture
def trail_file(tmp_path: Path) -> Path:
    path = tmp_path / "audit.jsonl"
    write_run(path)
    return path


class TestPicture:
    def test_a_trail_file_becomes_a_png_of_the_promised_size(self, trail_file: Path, tmp_path: Path):
        out = plot_timeline(trail_file, tmp_path / "pics" / "timeline.png")
        assert out == tmp_path / "pics" / "timeline.png"
        assert out.stat().st_size > 20_000
        assert png_size(out) == figure_size(4, reward=True) == (1200, round((1.6 + 0.42 * 5 + 2.2) * 100))

    def test_without_reward_records_the_reward_panel_is_left_out(self, tmp_path: Path):
        out = plot_timeline(write_run(None, rewards=False), tmp_path / "t.png", title="no rewards")
        assert png_size(out) == figure_size(4, reward=False)
        assert figure_size(4, reward=False)[1] < figure_size(4, reward=True)[1]

    def test_records_as_dicts_or_line_pairs_draw_the_same_picture(self, trail_file: Path, tmp_path: Path):
        as_pairs = plot_timeline(list(read_trail(trail_file)), tmp_path / "a.png", title="t")
        as_dicts = plot_timeline([rec for _, rec in read_trail(trail_file)], tmp_path / "b.png", title="t")
        assert as_pairs.read_bytes() == as_dicts.read_bytes()

    def test_importing_the_module_does_not_import_matplotlib(self):
        code = "import sys, ftstate.cli.plot; assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


class TestWhatIsDrawn:
    def test_one_lane_per_worker_trainer_first_in_rank_order(self, trail_file: Path):
        recs = [rec for _, rec in read_trail(trail_file)]
        lanes = _lanes(recs, "worker", 13.0)
        assert [lane.member for lane in lanes] == ["trainer-0", "rollout-0", "rollout-1", "standby-0"]
        lost = next(lane for lane in lanes if lane.member == "rollout-1")
        assert [state for _, _, state in lost.segments][-2:] == ["LOST", "RETIRED"]
        assert (6.0, 7.5, "LOST") in lost.segments

    def test_a_failover_spans_promoting_until_ready(self, trail_file: Path):
        recs = [rec for _, rec in read_trail(trail_file)]
        (fo,) = _failovers(recs, 13.0)
        assert (fo.number, fo.start, fo.end, fo.finished) == (1, 6.5, 7.5, True)
        assert fo.reason == "rollout-1 died"

    def test_a_failover_still_open_at_the_end_is_unfinished(self):
        recs = [
            {"event": "transition", "machine": "group", "member": "group", "to": "PROMOTING", "t": 2.0},
        ]
        (fo,) = _failovers(recs, 9.0)
        assert (fo.start, fo.end, fo.finished) == (2.0, 9.0, False)


class TestNothingToDraw:
    def test_a_trail_without_worker_lanes_is_refused_by_name(self, tmp_path: Path):
        trail = AuditTrail(tmp_path / "group-only.jsonl")
        trail.record(
            "transition",
            machine="group",
            member="group",
            **{"from": "INIT", "to": "RENDEZVOUS"},
            trigger="start",
        )
        trail.record("reward", step=1, reward=0.5)
        trail.close()
        with pytest.raises(ValueError, match=r"no worker lanes.*machine='worker'"):
            plot_timeline(tmp_path / "group-only.jsonl", tmp_path / "t.png")
        assert not (tmp_path / "t.png").exists()

    def test_an_empty_trail_is_refused(self, tmp_path: Path):
        with pytest.raises(ValueError, match="no timed records"):
            plot_timeline([], tmp_path / "t.png")

    def test_a_trail_line_that_is_not_json_is_reported_with_its_line(self, trail_file: Path, tmp_path: Path):
        from ftstate.core.errors import AuditViolation

        bad = tmp_path / "bad.jsonl"
        bad.write_text(trail_file.read_text() + "{not json\n")
        with pytest.raises(AuditViolation, match="not a JSON object"):
            plot_timeline(bad, tmp_path / "t.png")
        assert json.loads(trail_file.read_text().splitlines()[0])["event"] == "transition"


def write_drain_run(path: Path | None, *, outcome: str | None = "drained") -> AuditTrail:
    """Two rollouts serving; a GCE notice for rollout-1's node at t=3 (two notices in one poll),
    rollout-1 DRAINING while standby-0 is brought up, then retired (or the drain undone)."""
    run = Run(path)
    run.group("RENDEZVOUS", "start")
    run.worker("standby-0", "STANDBY", "warm")
    for m in ("trainer-0", "rollout-0", "rollout-1"):
        run.worker(m, "RENDEZVOUS", "join")
    run.at(1.0).group("READY", "rendezvous_done")
    for m in ("trainer-0", "rollout-0", "rollout-1"):
        run.worker(m, "RESYNCED", "verified")
        run.worker(m, "READY", "admit")
    node = "96b723fd9531ab"
    run.at(2.9).trail.record("maintenance_announced", source="gce", kind="terminate", name="b", node_id=node, step=1)
    for kind in ("terminate", "maintenance"):
        run.at(3.0).trail.record("maintenance_notice", source="gce", kind=kind, deadline=1e9, node=node, node_id=node,
                                 action="drain")
    run.at(3.1).trail.record("drain_started", node=node, source="gce", kind="terminate", reason="r",
                             members=["rollout-1"], spares=[])
    run.worker("rollout-1", "DRAINING", "drain")
    run.at(3.3).worker("standby-0", "PROMOTING", "promote")
    run.worker("standby-0", "RENDEZVOUS", "join")
    run.worker("standby-0", "STALE", "joined")
    run.worker("standby-0", "RESYNCING", "resync")
    run.worker("standby-0", "RESYNCED", "verified")
    run.at(3.8).worker("standby-0", "READY", "admit")
    if outcome == "drained":
        run.worker("rollout-1", "RETIRED", "retire")
        run.at(3.9).trail.record("drain_drained", node=node, source="gce", kind="terminate", reason="r",
                                 moved={"rollout-1": "standby-0"}, seconds=0.8)
    elif outcome is not None:
        run.worker("rollout-1", "READY", "drain_cancelled")
        run.at(3.9).trail.record(f"drain_{outcome}", node=node, source="gce", kind="terminate",
                                 reason="no room elsewhere", moved={}, seconds=0.8)
    run.at(6.0).trail.record("reward", step=1, reward=0.2)
    run.trail.close()
    return run.trail


class TestMaintenance:
    def test_notices_and_drains_are_found_where_the_trail_puts_them(self, tmp_path: Path):
        trail = write_drain_run(None)
        notices = _notices(trail.records)
        assert [(n.t, n.label) for n in notices] == [(3.0, "gce terminate"), (3.0, "gce maintenance")]
        [drain] = _drains(trail.records, 10.0)
        assert (drain.start, drain.end, drain.outcome, drain.moved) == (3.1, 3.9, "drained", {"rollout-1": "standby-0"})

    @pytest.mark.parametrize("outcome", ["failed", "cancelled", None])
    def test_a_drain_that_did_not_finish_says_so(self, outcome: str | None):
        [drain] = _drains(write_drain_run(None, outcome=outcome).records, 10.0)
        assert drain.outcome == outcome and drain.moved == {}
        assert drain.end == (10.0 if outcome is None else 3.9)

    def test_draining_has_a_colour_of_its_own(self):
        assert STATE_COLORS["DRAINING"] not in {c for s, c in STATE_COLORS.items() if s != "DRAINING"}

    @pytest.mark.parametrize("outcome", ["drained", "failed", None])
    def test_a_trail_with_a_drain_becomes_a_picture(self, tmp_path: Path, outcome: str | None):
        path = tmp_path / "audit.jsonl"
        write_drain_run(path, outcome=outcome)
        out = plot_timeline(path, tmp_path / "t.png")
        assert png_size(out) == figure_size(4, True)
