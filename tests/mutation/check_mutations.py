"""Mutation check (the cheap form): break each claim in a scratch copy and prove the suite notices.

For every claim the README's "What it does" makes, :data:`MUTATIONS` names one small edit that
breaks it and the tests that must then fail. First the named tests of every chosen mutation run
on an unmutated copy of the checkout (the files git knows); the check refuses to start unless
they all pass, since a test that fails or is skipped as the code stands tells no mutant apart.
Then each mutation is applied to a fresh copy and its tests run there (that copy first on
``PYTHONPATH``, so Ray's worker processes import the mutant too; the verl and vLLM suites'
tests in their own venvs, :data:`VENVS`).

pytest writes a junit report, and a mutation is *caught* only where a named test failed with
an assertion (or ``pytest.fail``/``DID NOT RAISE``) or one of ftstate's own errors: the test
said why. A collection error, a set-up or fixture error, a start-up failure, any other
exception or a run past :data:`RUN_TIMEOUT_S` is *unknown*: it would read the same with the
claim intact, so it is shown as such and fails the check, like a mutation that survived. The
report names the test that caught each mutation. An edit that no longer applies (the code
moved) fails the check loudly, so the list cannot silently rot.

Run: ``python tests/mutation/check_mutations.py`` (``make mutation-check``, part of ``make
test``; 27 min on 2 shared cores at load average 10-17, 9 of them the unmutated run). ``--only NAME`` (repeatable) runs the named mutations only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[2]
#: Bound on one mutation's test run, seconds (a run past it is unknown, never caught).
RUN_TIMEOUT_S = 300
#: The suites that run in venvs of their own (the Makefile's VERL_VENV and VLLM_VENV).
VENVS = {"verl": ".venv-verl", "vllm": ".venv-vllm"}


@dataclasses.dataclass(frozen=True)
class Edit:
    path: str
    old: str
    new: str


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One broken claim: ``edits`` (each must apply exactly once) make ``tests`` fail."""

    name: str
    claim: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]
    #: The venv the tests run in: ``core`` (this interpreter's), ``verl`` or ``vllm`` (:data:`VENVS`).
    venv: str = "core"


MUTATIONS = (
    Mutation(
        "one-phase commit",
        "a rollout hands weights to load_weights only after every rollout staged the same version",
        (Edit("ftstate/worker/transfers.py",
              "                field=\"weights_version\",\n            )\n        self._staged = staged\n",
              "                field=\"weights_version\",\n            )\n        self._staged = staged\n"
              "        await self._run(self.user.load_weights, dict(staged.tensors), weights_version)\n"),),
        ("tests/integration/test_runtime.py::TestAtomicSync::"
         "test_a_corrupted_bucket_aborts_the_sync_and_every_rollout_keeps_the_previous_version",),
    ),
    Mutation(
        "no checksum comparison in the transfer",
        "a version whose received bytes do not match the sender's checksums is never staged or committed "
        "(the receiver's comparison, and the controller's of each receiver's own checksum with the sender's)",
        (Edit("ftstate/transport/hashing.py",
              '    """None when everything matches, else what did not (first failing bucket first). ``state``:\n'
              '    the receiver\'s own whole-state checksum of ``tensor_sums``."""\n',
              '    """None when everything matches, else what did not (first failing bucket first). ``state``:\n'
              '    the receiver\'s own whole-state checksum of ``tensor_sums``."""\n    return None\n'),
         Edit("ftstate/controller/sync.py",
              '                    torn = [n for n, r in staged.items() if r.checksum != sent.checksum]\n',
              "                    torn = []\n")),
        ("tests/integration/test_runtime.py::TestAtomicSync::"
         "test_a_corrupted_bucket_aborts_the_sync_and_every_rollout_keeps_the_previous_version",),
    ),
    Mutation(
        "writer hashes its slot",
        "a write into a shared-memory slot after the writer's copy is never blessed: the writer hashes its "
        "source, so every reader of such bytes rejects them",
        (Edit("ftstate/transport/routes/slots.py",
              "write_slot = functools.partial(copy_hash, hash_source=True) if self.slots.device is None",
              "write_slot = copy_hash if self.slots.device is None"),),
        ("tests/integration/test_transport_shm.py::TestFaults::"
         "test_a_slot_tampered_right_after_the_writers_copy_is_refused_and_the_next_sync_succeeds",),
    ),
    Mutation(
        "a kept staging buffer reused under an engine's views",
        "with staging_spare, the next transfer never lands in a buffer the engine still serves from "
        "(a failed vote would leave that engine holding the rejected bytes)",
        (Edit("ftstate/transport/sync.py",
              "if buf.device == device and buf.numel() >= nbytes and count is not None and count <= baseline:",
              "if buf.device == device and buf.numel() >= nbytes:"),),
        ("tests/integration/test_memory.py::test_a_kept_buffer_is_never_rewritten_under_an_engine_that_serves_from_it",),
    ),
    Mutation(
        "gloo's rendezvous values untagged",
        "with the run authenticated, torch's gloo backend writes and reads its rendezvous values (each "
        "member's address) through the tagged store, and a planted value is never handed to it",
        (Edit("ftstate/transport/signedstore.py",
              "            if payload is not None:\n                return payload",
              "            return raw"),
         Edit("ftstate/transport/gloo.py",
              "init_timeout_s=timeout_s) if auth.enabled() else store",
              "init_timeout_s=timeout_s) if False else store")),
        ("tests/integration/test_gloo_rendezvous_security.py",),
    ),
    Mutation(
        "keyed digests with a key anyone has",
        "with integrity: keyed, bytes injected by anyone without the run's secret cannot match their bucket's "
        "digest (the digest's key is derived from the secret)",
        (Edit("ftstate/transport/checksum.py",
              'key.secret, digest_size=32, person=b"ftstate-bucket"',
              'b"", digest_size=32, person=b"ftstate-bucket"'),),
        ("tests/unit/test_integrity.py::TestAnOutsiderCannotMatchAKeyedDigest",),
    ),
    Mutation(
        "keyed receiver trusts the seal's tensor sums unchecked",
        "a keyed receiver, which takes its per-tensor checksums from the seal, commits nothing whose bucket "
        "digests do not match",
        (Edit("ftstate/transport/hashing.py",
              "    for k, (got, want) in enumerate(zip(digests, seal.bucket_checksums, strict=True)):\n"
              "        if got != want:",
              "    for k, (got, want) in enumerate(zip(digests, seal.bucket_checksums, strict=True)):\n"
              "        if got != want and __import__('ftstate.transport.checksum', fromlist=['_']).INTEGRITY != 'keyed':"),),
        ("tests/unit/test_integrity.py::TestAKeyedReceiverHashesOnceAndTrustsOnlyAVerifiedSeal",
         "tests/integration/test_transport_security.py::TestAuthenticated::"
         "test_a_keyed_reader_refuses_one_damaged_byte_from_its_slot_and_from_gloo"),
    ),
    Mutation(
        "tags not checked",
        "a message whose MAC does not verify (store value, zmq signal, gloo message, vote) is never acted on",
        (Edit("ftstate/transport/auth.py", "    if problem is not None:\n        if record:\n",
              "    if problem is not None and False:\n        if record:\n"),),
        ("tests/unit/test_auth.py",
         "tests/integration/test_transport_security.py::TestAuthenticated::"
         "test_a_manifest_from_a_member_without_the_secret_is_refused_before_it_is_decoded"),
    ),
    Mutation(
        "held bytes not compared",
        "a rollout is recorded as holding a version only if the bytes it holds hash to the sender's checksum",
        (Edit("ftstate/controller/sync.py", '            if r.checksum != checksum:\n', "            if False:\n"),),
        ("tests/integration/test_held_weights.py::"
         "test_an_engine_that_corrupts_its_own_copy_is_taken_out_of_serving_at_commit",),
    ),
    Mutation(
        "no replay",
        "a new trainer re-runs the calls since the last sync, so no step is lost",
        (Edit("ftstate/controller/resync.py",
              "        for c in calls:\n            await self.calls.call(trainer.name, trainer.handle, UserCall(",
              "        for c in calls[:0]:\n            await self.calls.call(trainer.name, trainer.handle, UserCall("),),
        ("tests/integration/test_replay.py::test_calls_since_the_last_sync_are_replayed_on_the_new_trainer",),
    ),
    Mutation(
        "suspect admitted unproven",
        "a suspect worker serves again only through RESYNCED, after showing the current weights",
        (Edit("ftstate/core/liveness.py",
              "            proven = heartbeat.weights_version == current_version and (",
              "            proven = True or heartbeat.weights_version == current_version and ("),),
        ("tests/unit/test_liveness.py",
         "tests/integration/test_held_weights.py::"
         "test_a_suspect_rollout_is_readmitted_only_if_a_fresh_hash_of_what_it_holds_matches"),
    ),
    Mutation(
        "serving edge allowed",
        "no machine may enter a serving state except from RESYNCED (the spec refuses such an edge)",
        (Edit("ftstate/core/spec.py",
              "                if t.dest in spec.serving_states and t.source not in spec.serving_states "
              "and t.source != RESYNCED:",
              "                if False:"),),
        ("tests/unit/test_spec.py",),
    ),
    Mutation(
        "no deadlines",
        "every state with a deadline leaves it when the deadline passes (fail-fast init, bounded failover)",
        (Edit("ftstate/core/machine.py",
              "        d = self.spec.states[state].deadline\n        if d is None:\n            return\n",
              "        d = self.spec.states[state].deadline\n        if True:\n            return\n"),),
        ("tests/unit/test_machine.py",),
    ),
    # Claims a plausible one-line bug once broke with every test green (issue 22), each now
    # held by a test that fails without it.
    Mutation(
        "restored rank admitted unproven",
        "a trainer rank restored from a rollout rejoins only if what it then owns hashes to the part it sent",
        (Edit("ftstate/controller/ranks.py", '            if got.checksum != expected:\n', "            if False:\n"),),
        ("tests/integration/test_sharded_failover.py::"
         "test_a_restored_rank_that_does_not_reproduce_its_part_is_never_admitted",),
    ),
    Mutation(
        "resync retries unbounded",
        "a newcomer whose every transfer fails without a death ends the failover after resync_retries + 1 tries",
        (Edit("ftstate/controller/failover.py",
              "                    if transfer_tries > self.ft.resync_retries:\n",
              "                    if transfer_tries > self.ft.resync_retries + 1000:\n"),),
        ("tests/integration/test_failover.py::TestRolloutFailover::"
         "test_a_newcomer_whose_every_resync_fails_ends_the_failover_after_resync_retries",),
    ),
    Mutation(
        "slow detection",
        "a hung worker is SUSPECT within an interval or two and LOST heartbeat_timeout_s later, no later",
        (Edit("ftstate/controller/watchdog.py", "_PROVE if prove else _ASK,\n"
              "                                        timeout=self.config.heartbeat_interval_s)",
              "_PROVE if prove else _ASK,\n"
              "                                        timeout=self.config.heartbeat_timeout_s)"),
         Edit("ftstate/controller/watchdog.py", "args,\n"
              "                                              timeout=self.config.heartbeat_interval_s, mark=",
              "args,\n"
              "                                              timeout=self.config.heartbeat_timeout_s, mark=")),
        ("tests/integration/test_failover.py::TestRolloutFailover::"
         "test_a_hung_rollout_is_declared_lost_within_the_heartbeat_timeout_plus_an_interval",),
    ),
    Mutation(
        "segments left named",
        "a sender whose transfer fails before every reader mapped its segments unlinks them itself",
        (Edit("ftstate/transport/samehost.py",
              '"on_failure": functools.partial(drop_slots, sender)}',
              '"on_failure": lambda: None}'),),
        ("tests/integration/test_transport_shm.py::TestFaults::"
         "test_a_reader_lost_before_it_attached_leaves_no_segment_named_while_the_sender_lives",),
    ),
    Mutation(
        "rejected node copy kept",
        "a node copy (staging: node) whose version a reader rejected is unlinked: only a committed one stays",
        (Edit("ftstate/transport/routes/nodecopy.py",
              "            node.close()\n    else:\n        node.unlink()\n        node.close()\n",
              "            node.close()\n"),),
        ("tests/integration/test_transport_nodecopy.py::TestOneCopyPerNode::"
         "test_a_damaged_bucket_at_one_reader_unlinks_the_new_copy",),
    ),
    Mutation(
        "spares on the nodes they cover",
        "a spare keeps off the nodes of the members it covers, where another node can hold it",
        (Edit("ftstate/controller/spares.py",
              "        covered = ({self.launcher.node_of(m) for m in self.membership.live(role)} | self.avoided_nodes()) - {None}\n",
              "        covered = self.avoided_nodes() - {None}\n"),),
        ("tests/multinode/test_node_loss.py::"
         "test_spares_keep_off_the_nodes_of_the_members_they_cover_whatever_ray_would_choose",),
    ),
    Mutation(
        "drain retires before the weights moved",
        "a drained member retires only once its replacement holds the current weights; rollouts serve throughout",
        (Edit("ftstate/controller/drain.py", "            await self.failover.resyncer.resync(moved[m.name])\n",
              "            pass  # resynced by the next sync\n"),),
        ("tests/multinode/test_drain.py::test_a_node_with_two_rollouts_is_drained_while_serving",),
    ),
    Mutation(
        "one round per loss",
        "members lost together are replaced in one failover round under one new group version",
        (Edit("ftstate/controller/failover.py", "            batch, self._pending = self._pending, []\n",
              "            batch, self._pending = self._pending[:1], self._pending[1:]\n"),),
        ("tests/integration/test_fault_matrix.py::test_fault_matrix[idle-kill]",),
    ),
    Mutation(
        "transfer under an unformed version",
        "a sync never runs under a group version that was abandoned or never formed (issue 22's defect)",
        (Edit("ftstate/controller/sync.py", "        await self.formation.ensure_formed()\n", ""),),
        ("tests/integration/test_runtime.py::TestAtomicSync::"
         "test_a_trainer_whose_state_dict_fails_fails_the_sync_fast_and_the_next_one_works",),
    ),
    Mutation(
        "a second copy beside the engine",
        "a rollout whose engine gives its weights back keeps no copy of its own after a load",
        (Edit("ftstate/worker/holdings.py", "        self._received = staged.state_checksum\n        if from_engine:\n",
              "        self._received = staged.state_checksum\n        if False:\n"),),
        ("tests/integration/test_memory.py::test_what_a_rollout_keeps_beside_its_own_weights[held_weights]",),
    ),
    Mutation(
        "a deterministic replacement failure waited out",
        "a replacement whose own code raises while it is brought up ends the run at once with that cause",
        (Edit("ftstate/controller/failover.py", "                                raise replacement_failed(replacement, lost, exc) from exc\n",
              "                                raise\n"),),
        ("tests/integration/test_user_errors.py::"
         "test_a_replacement_whose_own_code_raises_at_its_resync_ends_the_run_at_once[trainer]",),
    ),
    Mutation(
        "a replayed store version believed",
        "an older, genuinely signed current_version written back does not reopen a fenced version",
        (Edit("ftstate/transport/store.py", "    if where is None or value is None:\n        return value\n",
              "    if True:\n        return value\n"),),
        ("tests/integration/test_transport_store.py::"
         "test_an_older_current_version_written_back_does_not_reopen_a_fenced_version",),
    ),
    Mutation(
        "a vouched round not counted",
        "a worker whose quiet answers its node's round vouched for is silent only since the vouch last moved",
        (Edit("ftstate/core/liveness.py",
              "checksum aside.\"\"\"\n        if self.vouch is not None:\n            self._vouched()\n",
              "checksum aside.\"\"\"\n"),),
        ("tests/unit/test_liveness.py::TestVouch",
         "tests/unit/test_watchdog_rounds.py::"
         "test_after_a_long_quiet_stretch_a_hung_spare_is_lost_after_the_timeout_and_a_hung_rollout_at_once"),
    ),
    Mutation(
        "rollouts added for a node placed anywhere",
        "rt.add_rollouts(n, nodes=[...]) puts the newcomers on the nodes named and nowhere else",
        (Edit("ftstate/controller/scaling.py", "avoid = self.launcher.alive_nodes() - self._only",
              "avoid = set()"),),
        ("tests/simulation/test_scaling_sim.py::"
         "test_a_node_that_joins_is_given_rollouts_by_name_and_a_bad_node_is_refused_before_anything_changes",),
    ),
    Mutation(
        "newcomers fed one at a time",
        "rollouts added are fed in waves: every holder feeds one, and each newcomer fed feeds the next",
        (Edit("ftstate/controller/scaling.py", "                if src is None and wave:\n",
              "                if wave:\n"),),
        ("tests/simulation/test_scaling_sim.py::"
         "test_newcomers_are_fed_in_waves_each_holder_feeding_one_and_each_newcomer_fed_feeding_the_next",),
    ),
    Mutation(
        "warm spares passed over by an addition",
        "rt.add_rollouts takes warm standby spares first: no process to start, only their transfer",
        (Edit("ftstate/controller/scaling.py", "promoted = await self._promote_spares(n, started)",
              "promoted = []"),),
        ("tests/simulation/test_scaling_sim.py::"
         "test_a_run_syncing_every_step_scales_two_to_eight_to_two_and_every_sync_commits",),
    ),
    Mutation(
        "a spare sharing a node sent to a quarantined one",
        "a quarantined node gets no spare, even where a spare must share a node with the members it covers",
        (Edit("ftstate/controller/spares.py", "        if never and not self.launcher.placeable(pool, covered):\n",
              "        if False:\n"),),
        ("tests/simulation/test_quarantine_sim.py::"
         "test_a_spare_that_must_share_a_node_goes_to_a_healthy_one_never_to_the_quarantined_one",),
    ),
    Mutation(
        "an async sample's staleness unchecked",
        "ftstate demo --async fails a run whose samples ran more than max_staleness versions behind",
        (Edit("ftstate/cli/demo/run.py",
              "if version not in steps_of or not 0 <= pushed - version <= max_staleness:",
              "if version not in steps_of:"),),
        ("tests/unit/test_demo_rl.py::TestStamps::test_a_stamp_too_stale_ahead_or_unknown_is_named",),
    ),
    Mutation(
        "a suspected trainer held to the committed checksum",
        "a trainer rank suspected mid-sync is proven by the version it sends, not made STALE",
        (Edit("ftstate/core/liveness.py", "proven = heartbeat.weights_version >= current_version",
              "proven = heartbeat.weights_version == current_version and heartbeat.checksum == current_checksum"),),
        ("tests/unit/test_liveness.py::TestComingBack::"
         "test_a_suspect_trainer_mid_sync_is_verified_by_the_version_it_sends",),
    ),
    Mutation(
        "a suspect's unproven answer believed",
        "an answer a suspect gave without being asked to hash its weights afresh re-admits nothing",
        (Edit("ftstate/controller/watchdog.py", 'if state == "SUSPECT" and not proved and beat is not None:',
              'if False:'),),
        ("tests/unit/test_watchdog_rounds.py::"
         "test_a_suspect_whose_answer_was_not_asked_to_prove_its_weights_is_not_verified_by_it",),
    ),
    Mutation(
        "an agent quiet about a reply it no longer keeps",
        "a node's agent answers QUIET only when the round names the very reply it keeps, for the same members",
        (Edit("ftstate/controller/backend.py",
              "quiet = since is not None and since == self.mark and handles == self.handles and answers == self.answers",
              "quiet = since is not None and answers == self.answers"),),
        ("tests/unit/test_watchdog_rounds.py::"
         "test_an_agent_answers_quiet_only_to_the_reply_it_keeps_for_the_same_members_and_answers",),
    ),
    Mutation(
        "the roster deaf to a suspect",
        "a member suspected, lost or started moves the roster, so the watchdog's lists are walked again",
        (Edit("ftstate/controller/membership.py",
              "if src in _ROSTER_STATES or dest in _ROSTER_STATES:", "if False:"),),
        ("tests/unit/test_watchdog_rounds.py::test_the_roster_moves_with_whom_the_watchdog_polls_and_nothing_else",),
    ),
    Mutation(
        "a worker's own work unseen",
        "a worker busy in its own work (a generation) whose steps stand still is suspected like a stalled transfer",
        (Edit("ftstate/worker/host.py", "        if user is not None:  # the user's own work", "        if False:  # the user's own work"),),
        ("tests/unit/test_activity.py",),
    ),
    Mutation(
        "a simulated agent blind to a hang",
        "the simulated agent answers QUIET without reading its members only while nothing on the node changed",
        # a hang no longer counted as a change on the node (the attribute still set)
        (Edit("ftstate/simulation/members.py", '    hung = _watched("hung")\n',
              '    hung = property(operator.attrgetter("_hung"), lambda self, v: setattr(self, "_hung", v))\n'),),
        ("tests/unit/test_simulation.py::TestHeartbeatsPerNode::"
         "test_a_change_of_any_answer_on_the_node_ends_the_agents_quiet_replies",),
    ),
    Mutation(
        "an abandoned version's connections left open",
        "abandoning a gloo version ends the point-to-point waits on it, here and at its peers",
        (Edit("ftstate/transport/gloo.py", "            self._close_connections(pg)\n", ""),),
        ("tests/integration/test_transport_threads.py::"
         "test_abandoning_a_version_releases_a_member_blocked_in_a_point_to_point_receive",
         "tests/integration/test_transport_threads.py::test_a_peer_that_abandons_releases_the_ranks_waiting_on_it"),
    ),
    Mutation(
        "nh64 blind to where a chunk sits",
        "the device digest keys each chunk by its place in its tensor, so swapped chunks or tensors change it",
        (Edit("ftstate/transport/digest.py",
              "total += _l2(_l1(w, k1, 0), k2[first + c : first + c + n])",
              "total += _l2(_l1(w, k1, 0), k2[:1].expand(n, 8))"),
         Edit("ftstate/transport/digest.py",
              "rows = k2[first + c : first + c + blk.shape[0]].numpy()",
              "rows = k2[:1].expand(blk.shape[0], 8).numpy()"),),
        ("tests/unit/test_digest.py::TestWhatItCatches::"
         "test_two_same_shaped_tensors_swapped_change_the_bytes_digest_and_the_state_checksum",),
    ),
    Mutation(
        "a device sync hashed through the host",
        "a transfer proved with nh64 hashes each bucket where its bytes are: no weight byte goes to the host",
        (Edit("ftstate/transport/hashing.py",
              '    mv = host_bytes(data[lo:hi]) if hasher.function == "xxh3" else None\n',
              "    mv = host_bytes(data[lo:hi])\n"),),
        ("tests/integration/test_transport_cudaipc.py::TestTheDigestWhereTheWeightsAre::"
         "test_a_sync_through_device_slots_is_proved_with_nh64_and_copies_no_byte_to_the_host",),
    ),
    # Claims issue 47 broke with every test green, and claims of the README that had no mutation.
    Mutation(
        "a config digest blind to the config",
        "a run's first record tells two configs apart by their digest (and one config's runs compare equal)",
        (Edit("ftstate/core/config.py", "hashlib.sha256(canonical.encode())", 'hashlib.sha256(b"")'),),
        ("tests/unit/test_config.py::TestTheDigestTellsConfigsApart",),
    ),
    Mutation(
        "a manifest larger than its tensors",
        "a manifest whose total_bytes runs past its tensors and buckets is refused (a peer cannot make each "
        "receiver allocate staging it never fills)",
        (Edit("ftstate/transport/manifest.py", "    if total != end:\n", "    if total < end:\n"),),
        ("tests/unit/test_decoders_fuzz.py::TestManifest::test_the_reported_attacks_are_typed_errors",),
    ),
    Mutation(
        "a recycled staging buffer's gaps left stale",
        "the alignment gaps of a recycled staging buffer are zeroed before it is filled, so a resend from it "
        "leaks nothing of an earlier transfer",
        (Edit("ftstate/transport/sync.py", "            flat[cursor : e.offset].zero_()\n", "            pass\n"),),
        ("tests/integration/test_transport_threads.py::"
         "test_the_gaps_of_a_recycled_staging_buffer_are_zeroed_before_a_resend_from_it",),
    ),
    Mutation(
        "a whole-state checksum blind to names",
        "the held-bytes proof tells apart an engine that swapped two same-shaped tensors (q/k, gate/up)",
        (Edit("ftstate/transport/checksum.py", "rows = sorted([name, dtype,", 'rows = sorted(["", dtype,'),),
        ("tests/unit/test_integrity.py::TestTheWholeStateChecksumBindsNames",),
    ),
    Mutation(
        "a rendezvous that gave up forms anyway",
        "a first rendezvous that misses a rank past init_timeout_s fails with RendezvousTimeout naming who "
        "joined and who did not",
        (Edit("ftstate/transport/store.py", "    if not missing:  # everyone arrived just as the wait gave up\n",
              "    if True:  # everyone arrived just as the wait gave up\n"),),
        ("tests/integration/test_transport_store.py::"
         "test_the_controller_bounds_a_rendezvous_and_names_who_is_missing",),
    ),
    Mutation(
        "a seal of another transfer believed",
        "a seal recorded from another transfer and played back, even of the same weights version, closes nothing",
        (Edit("ftstate/transport/manifest.py", "    if transfer != manifest.transfer:\n", "    if False:\n"),),
        ("tests/unit/test_manifest.py::TestValidationNamesTheField::"
         "test_a_seal_of_another_transfer_is_refused_even_for_the_same_weights_version",),
    ),
    Mutation(
        "an audit check blind to serving without RESYNCED",
        "ftstate audit --check reports a member that entered a serving state other than through RESYNCED",
        (Edit("ftstate/core/audit_check.py",
              "next((s for s in (src, prev) if s not in spec.serving_states and s != RESYNCED), None)",
              "None"),),
        ("tests/unit/test_audit_check.py::TestResyncedIsTheOnlyWayBackToServing",),
    ),
    Mutation(
        "an audit check blind to stale serving",
        "ftstate audit --check reports a rollout admitted to serve a version other than the current one",
        (Edit("ftstate/core/audit_check.py", "        elif wv not in allowed and m.pending not in allowed:",
              "        elif False:"),),
        ("tests/unit/test_audit_check.py::TestNoStaleServing",),
    ),
    Mutation(
        "an audit check blind to held bytes that differ",
        "ftstate audit --check reports a rollout serving at a commit with a checksum other than the sender's",
        (Edit("ftstate/core/audit_check.py",
              "                elif other.weights_version == self._run.current and checksum is not None \\\n"
              "                        and other.checksum != checksum:\n",
              "                elif False:\n"),),
        ("tests/unit/test_audit_check.py::TestHeldIsSent::"
         "test_a_rollout_committed_with_a_checksum_of_its_own_is_flagged_when_the_group_commits",),
    ),
    Mutation(
        "a failover budget that never runs out",
        "each promotion spends one of max_failovers, and a run whose budget is spent fails naming what it "
        "went to",
        (Edit("ftstate/core/budget.py", "        self.spent_on.append(charge.reason)\n", "        pass  # nothing charged\n"),),
        ("tests/unit/test_machine.py::TestBudgets",),
    ),
    Mutation(
        "a placement the cluster can never hold accepted",
        "a placement the cluster can never meet fails start() at once with PlacementUnsatisfiable",
        (Edit("ftstate/controller/feasibility.py",
              "    elif sum(_capacity(n, pool.bundle) for n in fits) < pool.slots:\n", "    elif False:\n"),),
        ("tests/unit/test_placement_rules.py::TestFeasibility",),
    ),
    Mutation(
        "an oversubscribed start-up said nothing of it",
        "start-up warns when the workers asked for far outnumber the cluster's CPUs",
        (Edit("ftstate/controller/progress.py",
              "        if cpus <= 0 or processes <= OVERSUBSCRIBED_RATIO * cpus:\n", "        if True:\n"),),
        ("tests/unit/test_progress.py",),
    ),
    Mutation(
        "a checkpoint that rolls the run back admitted",
        "a trainer rebuilt from a checkpoint older than the current version is refused (StaleCheckpointRefused), "
        "never admitted to roll the run back",
        (Edit("ftstate/controller/resync.py", "        if expected is None or held == expected:\n",
              "        if True:\n"),),
        ("tests/integration/test_replay.py::TestCheckpointRecovery::"
         "test_an_older_checkpoint_is_refused_naming_the_version_it_holds",),
    ),
)


def scratch_copy(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True, capture_output=True
    ).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def stale(m: Mutation, tree: Path = ROOT) -> str | None:
    """Why ``m`` no longer applies to the sources under ``tree``, or None: each edit's text must
    occur exactly once, or the mutant would differ from what its claim says."""
    for e in m.edits:
        count = (tree / e.path).read_text(encoding="utf-8").count(e.old)
        if count != 1:
            return (f"mutation {m.name!r} no longer applies: {e.path} holds its text {count} times, "
                    f"expected once; update tests/mutation/check_mutations.py")
    return None


def apply(copy: Path, m: Mutation) -> None:
    why = stale(m, copy)
    if why:
        raise SystemExit(why)
    for e in m.edits:
        path = copy / e.path
        text = path.read_text(encoding="utf-8")
        path.write_text(text.replace(e.old, e.new), encoding="utf-8")


# -- reading what pytest says ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One test case of a junit report: ``kind`` is passed, failed, error or skipped; ``raised``
    the exception that ended it (pytest's last traceback line, ``path:line: Name``)."""

    test: str
    kind: str
    message: str = ""
    raised: str = ""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """``caught`` (a named test failed for the mutation's sake), ``survived`` or ``unknown``."""

    kind: str
    detail: str
    by: tuple[str, ...] = ()


def ftstate_errors() -> frozenset[str]:
    """The names of ftstate's own exception classes (``FTError`` and everything under it)."""
    from ftstate.core import errors

    return frozenset(name for name, obj in vars(errors).items()
                     if isinstance(obj, type) and issubclass(obj, errors.FTError))


#: pytest's last traceback line: ``path:line: Name`` (Ray's wrapper: ``RayTaskError(Name)``).
_WHERE = re.compile(r"^\S.*:\d+: ([\w.]+(?:\(\w+\))?)$")
#: ``Name`` or ``pkg.Wrapper(Name)``: the name that counts is the innermost.
_NAME = re.compile(r"^(?:[\w.]+\.)?(\w+)(?:\((\w+)\))?$")
#: What a test says when its own check fails: an assertion, or pytest.fail / pytest.raises' DID NOT RAISE.
_ASSERTIONS = frozenset({"AssertionError", "Failed"})


def is_claim_failure(raised: str, own: frozenset[str]) -> bool:
    """Whether a failure ended in a test's own check (an assertion) or in one of ftstate's typed
    errors; anything else (a TypeError of a broken edit, a Ray start-up error, a timeout) says
    nothing about the claim."""
    match = _NAME.match(raised)
    if match is None:
        return False
    name = match.group(2) or match.group(1)
    return name in _ASSERTIONS or name in own


def read_junit(text: str) -> list[Outcome]:
    """The test cases of a junit report (``-o junit_family=xunit1``: cases carry their file)."""
    out = []
    for case in ElementTree.fromstring(text).iter("testcase"):
        file, cls, name = case.get("file", ""), case.get("classname", ""), case.get("name", "")
        module = file[:-3].replace("/", ".") if file.endswith(".py") else ""
        inner = cls[len(module) + 1:] if module and cls.startswith(module + ".") else ""
        test = "::".join(filter(None, (file or cls, inner, name)))
        kind, message, raised = "passed", "", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                kind = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                lines = (child.text or "").strip().splitlines()
                message = child.get("message") or (lines[0] if lines else "")
                where = _WHERE.match(lines[-1]) if lines else None
                raised = where.group(1) if where and kind != "skipped" else ""
                break
        out.append(Outcome(test, kind, message, raised))
    return out


def classify(outcomes: list[Outcome], returncode: int | None, own: frozenset[str]) -> Verdict:
    """What a mutant's run of its named tests says. ``returncode`` None: the run timed out.

    Caught only where a named test *failed* (not errored in set-up, not skipped) with an
    assertion or an ftstate error; a run that collected nothing, timed out, errored or failed
    in any other way is unknown, because it would read the same with the claim intact."""
    caught = [o for o in outcomes if o.kind == "failed" and is_claim_failure(o.raised, own)]
    if caught:
        return Verdict("caught", caught[0].message.splitlines()[0][:160] if caught[0].message else "",
                       tuple(o.test for o in caught))
    if returncode is None:
        return Verdict("unknown", f"the tests ran past {RUN_TIMEOUT_S}s (a hang, or a loaded machine)")
    others = [o for o in outcomes if o.kind in ("failed", "error")]
    if others:
        o = others[0]
        return Verdict("unknown", f"{o.test} {o.kind} ({o.raised or 'no exception named'}), not on an "
                                  f"assertion or an ftstate error: {o.message.splitlines()[0][:160] if o.message else ''}")
    if returncode != 0 or not outcomes:
        return Verdict("unknown", f"pytest exited {returncode} with {len(outcomes)} test(s) reported "
                                  "(a collection or start-up error)")
    skipped = [o.test for o in outcomes if o.kind == "skipped"]
    if skipped:
        return Verdict("unknown", f"skipped: {', '.join(skipped)}")
    return Verdict("survived", f"{len(outcomes)} test(s) passed")


# -- running ------------------------------------------------------------------------------------


def python_of(venv: str) -> Path:
    """The interpreter of a suite's venv (the verl and vLLM suites run in venvs of their own)."""
    if venv == "core":
        return Path(sys.executable)
    return ROOT / VENVS[venv] / "bin" / "python"


def pytest_run(copy: Path, venv: str, tests: list[str], report: Path,
               timeout_s: float = RUN_TIMEOUT_S) -> tuple[list[Outcome], int | None, str]:
    """Run ``tests`` in ``copy`` with that copy first on ``PYTHONPATH`` (Ray's worker processes
    import it too): the outcomes, pytest's exit status (None: timed out) and its output's tail."""
    env = {**os.environ, "PYTHONPATH": str(copy), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           **({"HF_HUB_OFFLINE": "1"} if venv == "vllm" else {})}
    # -x: a mutant whose first failure is caught need not wait out tests it also hangs
    cmd = [str(python_of(venv)), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
           f"--junitxml={report}", *tests]
    report.unlink(missing_ok=True)
    try:
        proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return (read_junit(report.read_text()) if report.exists() else []), None, out[-3000:]
    outcomes = read_junit(report.read_text()) if report.exists() else []
    return outcomes, proc.returncode, (proc.stdout[-3000:] + proc.stderr[-2000:])


def session_of(m: Mutation) -> tuple[str, str]:
    # a driver joins one Ray cluster only: the multinode suites run in sessions of their own
    multinode = any(t.split("/")[1].endswith("multinode") for t in m.tests)
    return m.venv, "multinode" if multinode else "main"


def baseline(chosen: list[Mutation]) -> list[str]:
    """Run every chosen mutation's tests on an unmutated copy; the problems found (a named test
    that does not pass as it stands could never tell a mutant from the code)."""
    problems = []
    for venv in sorted({m.venv for m in chosen}):
        if not python_of(venv).exists():
            problems.append(f"the {venv} suite's venv is missing ({python_of(venv)}): make test-{venv}")
    if problems:
        return problems
    sessions: dict[tuple[str, str], list[str]] = {}
    counts: dict[tuple[str, str], int] = {}
    for m in chosen:
        sessions.setdefault(session_of(m), [])
        sessions[session_of(m)] += [t for t in m.tests if t not in sessions[session_of(m)]]
        counts[session_of(m)] = counts.get(session_of(m), 0) + 1
    with tempfile.TemporaryDirectory(prefix="ftstate-unmutated-") as tmp:
        copy = Path(tmp) / "copy"
        scratch_copy(copy)
        for (venv, session), tests in sessions.items():
            t0 = time.monotonic()
            # one session runs every mutation's tests: each mutation's own bound, added up
            outcomes, code, tail = pytest_run(copy, venv, tests, Path(tmp) / "baseline.xml",
                                              RUN_TIMEOUT_S * counts[(venv, session)])
            bad = [o for o in outcomes if o.kind != "passed"]
            print(f"unmutated {venv:<5} {session:<9} {len(outcomes)} test(s) {time.monotonic() - t0:5.0f}s  "
                  f"{'ok' if code == 0 and outcomes and not bad else 'NOT PASSING'}", flush=True)
            problems += [f"{o.test}: {o.kind} {o.message.splitlines()[0][:200] if o.message else ''}" for o in bad]
            if code != 0 and not bad:
                why = "ran past its bound" if code is None else f"exited {code}"
                problems.append(f"pytest {why} on the unmutated copy ({venv}, {session}):\n{tail}")
    return problems


def run(m: Mutation, own: frozenset[str]) -> tuple[Verdict, float]:
    with tempfile.TemporaryDirectory(prefix="ftstate-mutant-") as tmp:
        copy = Path(tmp) / "copy"
        scratch_copy(copy)
        apply(copy, m)
        t0 = time.monotonic()
        outcomes, code, tail = pytest_run(copy, m.venv, list(m.tests), Path(tmp) / "mutant.xml")
        verdict = classify(outcomes, code, own)
        if verdict.kind == "unknown" and not outcomes:
            verdict = dataclasses.replace(verdict, detail=f"{verdict.detail}\n{tail}")
        return verdict, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", help="run the mutation of this name only (repeatable)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    missing = set(args.only or ()) - {m.name for m in MUTATIONS}
    if missing or not chosen:
        parser.error(f"no mutation named {sorted(missing)}; names: {', '.join(m.name for m in MUTATIONS)}")
    # checked before the unmutated run, so that a moved line fails in a second, not after it
    stale_edits = [why for why in map(stale, chosen) if why]
    if stale_edits:
        print("\n".join(stale_edits), flush=True)
        return 2
    problems = baseline(chosen)
    if problems:
        print("\nthe named tests do not pass on the unmutated copy; no mutation was tried:\n  "
              + "\n  ".join(problems), flush=True)
        return 2
    own = ftstate_errors()
    results = []
    for m in chosen:
        verdict, seconds = run(m, own)
        results.append((m, verdict))
        label = {"caught": "caught  ", "survived": "SURVIVED", "unknown": "UNKNOWN "}[verdict.kind]
        print(f"{label} {m.name:<40} {seconds:5.0f}s  {verdict.detail}", flush=True)
        for test in verdict.by:
            print(f"{'':9} by {test}", flush=True)
    for m, v in results:
        if v.kind == "survived":
            print(f"\nno test noticed {m.name!r}: the claim {m.claim!r} is not tested by {', '.join(m.tests)}")
        elif v.kind == "unknown":
            print(f"\n{m.name!r} is unknown: its tests neither passed nor failed on an assertion or an "
                  f"ftstate error ({v.detail.splitlines()[0]})")
    return 0 if all(v.kind == "caught" for _, v in results) else 1


if __name__ == "__main__":
    sys.exit(main())
