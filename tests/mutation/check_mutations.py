"""Mutation check (the cheap form): break each core claim in a scratch copy and prove the suite notices.

For every claim ftstate makes (two-phase commit, the transport's checksum comparison, the
held-bytes comparison at commit, the writer hashing its source rather than the shared-memory
slot, MAC verification, replay on a new trainer, RESYNCED-only admission, the fail-fast
deadline, the claims issue 22 found unguarded, and the device digest's position binding and its
staying on the device), :data:`MUTATIONS` names one small edit that
breaks it and the tests that
must then fail. Each mutation is applied to a fresh copy of the checkout (the files git
knows), the named tests are run there (that copy first on ``PYTHONPATH``, so Ray's worker
processes import the mutant too), and the mutation is *caught* only if pytest reports failed
tests (exit status 1) or the run exceeds its bound (a claim whose loss makes a test hang).
An edit that no longer applies (the code moved) fails the check loudly, so the list cannot
silently rot. The unmutated tests pass in the main suite, which runs first.

Run: ``python tests/mutation/check_mutations.py`` (``make mutation-check``, part of ``make
test``; ~10 min on 2 cores). ``--only NAME`` runs one mutation.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Bound on one mutation's test run, seconds (a mutant that hangs a test counts as caught).
RUN_TIMEOUT_S = 300


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
        (Edit("ftstate/transport/sync.py",
              '    """None when everything matches, else what did not (first failing bucket first). ``state``:\n'
              '    the receiver\'s own whole-state checksum of ``tensor_sums``."""\n',
              '    """None when everything matches, else what did not (first failing bucket first). ``state``:\n'
              '    the receiver\'s own whole-state checksum of ``tensor_sums``."""\n    return None\n'),
         Edit("ftstate/controller/sync.py",
              '                    torn = [n for n, r in staged.items() if r["checksum"] != sent["checksum"]]\n',
              "                    torn = []\n")),
        ("tests/integration/test_runtime.py::TestAtomicSync::"
         "test_a_corrupted_bucket_aborts_the_sync_and_every_rollout_keeps_the_previous_version",),
    ),
    Mutation(
        "writer hashes its slot",
        "a write into a shared-memory slot after the writer's copy is never blessed: the writer hashes its "
        "source, so every reader of such bytes rejects them",
        (Edit("ftstate/transport/samehost.py",
              "write_slot = functools.partial(_copy_hash, hash_source=True) if slots.device is None",
              "write_slot = _copy_hash if slots.device is None"),),
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
        (Edit("ftstate/transport/sync.py",
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
        (Edit("ftstate/controller/sync.py", '            if r["checksum"] != checksum:\n', "            if False:\n"),),
        ("tests/integration/test_held_weights.py::"
         "test_an_engine_that_corrupts_its_own_copy_is_taken_out_of_serving_at_commit",),
    ),
    Mutation(
        "no replay",
        "a new trainer re-runs the calls since the last sync, so no step is lost",
        (Edit("ftstate/controller/failover.py",
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
        (Edit("ftstate/controller/ranks.py", '            if got["checksum"] != expected:\n', "            if False:\n"),),
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
              '    drop_slots(sender)\n    comm.abort(f"weight transfer failed during {stage}")\n',
              '    comm.abort(f"weight transfer failed during {stage}")\n'),),
        ("tests/integration/test_transport_shm.py::TestFaults::"
         "test_a_reader_lost_before_it_attached_leaves_no_segment_named_while_the_sender_lives",),
    ),
    Mutation(
        "rejected node copy kept",
        "a node copy (staging: node) whose version a reader rejected is unlinked: only a committed one stays",
        (Edit("ftstate/transport/samehost.py",
              "            node.close()\n    else:\n        node.unlink()\n        node.close()\n",
              "            node.close()\n"),),
        ("tests/integration/test_transport_nodecopy.py::TestOneCopyPerNode::"
         "test_a_damaged_bucket_at_one_reader_unlinks_the_new_copy",),
    ),
    Mutation(
        "spares on the nodes they cover",
        "a spare keeps off the nodes of the members it covers, where another node can hold it",
        (Edit("ftstate/controller/failover.py",
              "        covered = {self.launcher.node_of(m) for m in self.membership.live(role)} | self.avoided_nodes()\n",
              "        covered = self.avoided_nodes()\n"),),
        ("tests/multinode/test_node_loss.py::"
         "test_spares_keep_off_the_nodes_of_the_members_they_cover_whatever_ray_would_choose",),
    ),
    Mutation(
        "drain retires before the weights moved",
        "a drained member retires only once its replacement holds the current weights; rollouts serve throughout",
        (Edit("ftstate/controller/drain.py", "            await self.failover.resync(moved[m.name])\n",
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
              "or None.\"\"\"\n        if self.vouch is not None:\n            self._vouched()\n", "or None.\"\"\"\n"),),
        ("tests/unit/test_liveness.py::TestVouch",
         "tests/unit/test_watchdog_rounds.py::"
         "test_after_a_long_quiet_stretch_a_hung_spare_is_lost_after_the_timeout_and_a_hung_rollout_at_once"),
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
        (Edit("ftstate/simulation/members.py", '    hung = _watched("hung")\n', "    hung = False\n"),),
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
        (Edit("ftstate/transport/sync.py",
              '    mv = host_bytes(data[lo:hi]) if hasher.function == "xxh3" else None\n',
              "    mv = host_bytes(data[lo:hi])\n"),),
        ("tests/integration/test_transport_cudaipc.py::TestTheDigestWhereTheWeightsAre::"
         "test_a_sync_through_device_slots_is_proved_with_nh64_and_copies_no_byte_to_the_host",),
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


def apply(copy: Path, m: Mutation) -> None:
    for e in m.edits:
        path = copy / e.path
        text = path.read_text(encoding="utf-8")
        if text.count(e.old) != 1:
            raise SystemExit(f"mutation {m.name!r} no longer applies: {e.path} holds its text "
                             f"{text.count(e.old)} times, expected once; update tests/mutation/check_mutations.py")
        path.write_text(text.replace(e.old, e.new), encoding="utf-8")


def run(m: Mutation) -> tuple[bool, str, float]:
    with tempfile.TemporaryDirectory(prefix="ftstate-mutant-") as tmp:
        copy = Path(tmp)
        scratch_copy(copy)
        apply(copy, m)
        env = {**os.environ, "PYTHONPATH": str(copy), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return True, f"a test hung past {RUN_TIMEOUT_S}s", time.monotonic() - t0
        seconds = time.monotonic() - t0
        tail = (proc.stdout.strip().splitlines() or [""])[-1]
        if proc.returncode == 1:
            return True, tail, seconds
        if proc.returncode == 0:
            return False, f"SURVIVED: {tail}", seconds
        raise SystemExit(f"mutation {m.name!r}: pytest could not run the tests (exit {proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run the mutation of this name only")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.only in (None, m.name)]
    if not chosen:
        parser.error(f"no mutation named {args.only!r}; names: {', '.join(m.name for m in MUTATIONS)}")
    survived = []
    for m in chosen:
        caught, detail, seconds = run(m)
        print(f"{'caught  ' if caught else 'SURVIVED'} {m.name:<26} {seconds:5.0f}s  {detail}", flush=True)
        if not caught:
            survived.append(m)
    for m in survived:
        print(f"\nno test noticed {m.name!r}: the claim {m.claim!r} is not tested by {', '.join(m.tests)}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
