"""Liveness: which heartbeat observations make a worker suspect, and what brings it back."""

from __future__ import annotations

from ftstate.core.liveness import Heartbeat, Liveness, Vouch


def hb(progress=0, busy=False, version=3, checksum="abc") -> Heartbeat:
    return Heartbeat(progress=progress, busy=busy, weights_version=version, checksum=checksum)


def observe(lv, now, beat, state="READY", version=3, checksum="abc"):
    return lv.observe(now, beat, state=state, current_version=version, current_checksum=checksum)


class TestBecomingSuspect:
    def test_a_missed_heartbeat_makes_a_serving_worker_suspect(self):
        assert observe(Liveness(1.0, 5.0), 1.0, None) == "heartbeat_missed"

    def test_a_missed_heartbeat_of_a_standby_is_not_a_suspicion(self):
        assert observe(Liveness(1.0, 5.0), 1.0, None, state="STANDBY") is None

    def test_an_idle_worker_that_answers_is_fine(self):
        lv = Liveness(1.0, 5.0)
        assert [observe(lv, t, hb(progress=5)) for t in (1, 2, 3)] == [None, None, None]

    def test_a_busy_worker_whose_progress_stalls_for_an_interval_is_suspect(self):
        lv = Liveness(1.0, 5.0)
        assert observe(lv, 0.0, hb(progress=7, busy=True), state="SYNCING") is None
        assert observe(lv, 0.5, hb(progress=7, busy=True), state="SYNCING") is None
        assert observe(lv, 1.0, hb(progress=7, busy=True), state="SYNCING") == "heartbeat_missed"

    def test_a_busy_worker_making_progress_is_fine(self):
        lv = Liveness(1.0, 5.0)
        assert [observe(lv, t, hb(progress=t, busy=True), state="SYNCING") for t in range(5)] == [None] * 5


class TestComingBack:
    def test_a_suspect_showing_the_current_weights_is_verified(self):
        assert observe(Liveness(1.0, 5.0), 1, hb(version=3, checksum="abc"), state="SUSPECT") == "verified"

    def test_a_suspect_with_an_old_version_is_stale(self):
        assert observe(Liveness(1.0, 5.0), 1, hb(version=2, checksum="old"), state="SUSPECT") == "alive_stale"

    def test_a_suspect_with_the_right_version_but_wrong_bytes_is_stale(self):
        assert observe(Liveness(1.0, 5.0), 1, hb(version=3, checksum="torn"), state="SUSPECT") == "alive_stale"

    def test_a_suspect_trainer_mid_sync_is_verified_by_the_version_it_sends(self):
        # its weights move ahead of the committed version by design: a trainer suspected while
        # it sends version 4 shows 4 and that version's checksum, not the committed 3's
        lv = Liveness(1.0, 5.0)
        beat = hb(version=4, checksum="next")
        assert lv.observe(1, beat, state="SUSPECT", current_version=3, current_checksum="abc", source=True) == "verified"
        assert observe(Liveness(1.0, 5.0), 1, beat, state="SUSPECT") == "alive_stale"  # a rollout: not proven
        behind = hb(version=2, checksum="old")
        assert lv.observe(2, behind, state="SUSPECT", current_version=3, current_checksum="abc",
                          source=True) == "alive_stale"

    def test_a_suspect_still_stalled_stays_suspect(self):
        lv = Liveness(1.0, 5.0)
        observe(lv, 0, hb(progress=1, busy=True), state="SYNCING")
        assert observe(lv, 2, hb(progress=1, busy=True), state="SUSPECT") is None


class TestSpares:
    def test_a_spare_silent_for_the_timeout_is_unresponsive(self):
        lv = Liveness(1.0, 5.0)
        assert observe(lv, 0.0, hb(), state="STANDBY") is None
        assert observe(lv, 1.0, None, state="STANDBY") is None
        assert observe(lv, 4.9, None, state="STANDBY") is None
        assert observe(lv, 5.0, None, state="STANDBY") == "unresponsive"

    def test_a_spare_that_answers_again_is_fine(self):
        lv = Liveness(1.0, 5.0)
        observe(lv, 0.0, None, state="STANDBY")
        assert observe(lv, 4.0, hb(), state="STANDBY") is None
        assert observe(lv, 8.0, None, state="STANDBY") is None

    def test_a_worker_silent_while_joining_a_group_version_is_unresponsive(self):
        lv = Liveness(1.0, 5.0)
        assert observe(lv, 0.0, hb(), state="STANDBY") is None
        assert observe(lv, 3.0, None, state="RENDEZVOUS") is None
        assert observe(lv, 5.0, None, state="RENDEZVOUS") == "unresponsive"

    def test_a_silent_serving_worker_is_suspect_not_unresponsive(self):
        lv = Liveness(1.0, 5.0)
        observe(lv, 0.0, hb())
        assert observe(lv, 9.0, None, state="READY") == "heartbeat_missed"


class TestVouch:
    """A round's vouch stands for answers the same as the worker's last one, not busy: each
    time it moved is an answer then, which a later observation reads first."""

    def test_a_spare_vouched_for_is_silent_only_since_the_vouch_last_moved(self):
        lv = Liveness(1.0, 5.0)
        assert observe(lv, 0.0, hb(), state="STANDBY") is None
        lv.vouch = Vouch()
        lv.vouch.at = 4.0
        assert observe(lv, 8.0, None, state="STANDBY") is None  # silent 4 s, not 8
        assert observe(lv, 9.5, None, state="STANDBY") == "unresponsive"

    def test_a_vouched_worker_that_turns_busy_stalls_from_the_vouch_on(self):
        lv = Liveness(2.0, 10.0)
        assert observe(lv, 0.0, hb(progress=5)) is None
        lv.vouch = Vouch()
        lv.vouch.at = 5.0
        assert observe(lv, 6.0, hb(progress=5, busy=True), state="SYNCING") is None  # idle until 5
        assert observe(lv, 7.5, hb(progress=5, busy=True), state="SYNCING") == "heartbeat_missed"

    def test_a_vouch_before_its_first_round_says_nothing(self):
        lv = Liveness(1.0, 5.0)
        assert observe(lv, 0.0, hb(), state="STANDBY") is None
        lv.vouch = Vouch()
        assert observe(lv, 6.0, None, state="STANDBY") == "unresponsive"

    def test_taking_a_vouch_back_keeps_what_it_said_and_nothing_after(self):
        lv = Liveness(1.0, 5.0)
        assert observe(lv, 0.0, hb(), state="STANDBY") is None
        vouch = lv.vouch = Vouch()
        vouch.at = 5.0
        lv.unvouch()
        vouch.at = 100.0  # the round moves on without it
        assert lv.vouch is None
        assert observe(lv, 8.0, None, state="STANDBY") is None  # silent since 5
        assert observe(lv, 10.0, None, state="STANDBY") == "unresponsive"
