"""The fault matrix: every fault x target x phase that can apply, on real processes, each
cell asserting its own expected outcome.

fault:  kill (SIGKILL), hang (SIGSTOP: alive, no progress), corrupt (a flipped byte in the
        next bucket the target receives)
target: a rollout, the trainer, a standby, two rollouts at once
phase:  idle (between syncs), mid-sync (inside a broadcast), during a train step, during
        a re-rendezvous (the target is armed to fail on its next unit of progress, which is
        joining the next group version, and a bystander rollout is killed to start a failover)

Cells that cannot apply are not in the matrix (a corruption needs a bucket the target
receives: the trainer never receives one, an idle spare neither, and nothing moves during a
train step); see :data:`CELLS`. Each remaining cell states what must happen
(:func:`expected`) and checks it:

- *replaced*: each hit member is declared LOST, detected in the phase the fault was aimed at
  (the state its first fault transition leaves: READY idle, SYNCING mid-sync, RENDEZVOUS /
  PROMOTING in the re-rendezvous), within the detection bound, and a failover record names
  its replacement;
- *spare lost*: a hit spare is declared LOST (from STANDBY) within the bound, costs no
  failover, and a new spare warms up in its place;
- *rejected*: a corrupted bucket is rejected by the checksum and the sync made again without
  a failover (a ``sync_retry`` naming the member), or, for a spare promoted in the
  re-rendezvous, its resync is made again (``resync_failed``, then serving).

After every cell the step's sync completes and every serving rollout holds exactly the
trainer's committed weights (checksum); the failover budget was spent once per replaced
member. Faults land where the test says: a mid-sync fault fires on the member's own progress
counter, a train-step fault is injected once the trainer process is inside the step (a marker
file it writes) and checked to have cut the call short, a re-rendezvous fault fires on the
join. The trainer's steps are deterministic in their arguments (``ReplayTrainer``), so at the
end the committed weights equal a fault-free run of the same steps, bit for bit, whatever
was replayed; `ftstate audit --check` passes and no actor or process is left.

To fit CI on 2 cores, one runtime per (phase, fault) absorbs its targets in turn. The set is
marked `slow`; it runs in `make test`.
"""

from __future__ import annotations

import asyncio

import pytest

import ftstate
from ftstate.core.audit_check import check_trail
from tests.integration.test_runtime import assert_gone, wait_until
from tests.integration.workers import ReplayTrainer, TinyRollout

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TARGETS = ("rollout", "trainer", "standby", "two rollouts")
PHASES = ("idle", "mid-sync", "train-step", "rendezvous")
FAULTS = ("kill", "hang", "corrupt")
BIG_FLOATS = 200_000
HEARTBEAT_INTERVAL_S = 0.2
HEARTBEAT_TIMEOUT_S = 2.0
#: Detection bound of an idle fault: a death is seen by the next heartbeat call, a hang once
#: the SUSPECT state's heartbeat_timeout_s runs out; plus slack for a CPU-starved CI machine.
DETECT_BOUND_S = {"kill": HEARTBEAT_INTERVAL_S + 3.0, "hang": HEARTBEAT_TIMEOUT_S + 2 * HEARTBEAT_INTERVAL_S + 3.0}
FAULT_TRIGGERS = frozenset({"died", "heartbeat_missed", "unresponsive", "node_lost"})


def applies(phase: str, fault: str, target: str) -> bool:
    if fault != "corrupt":
        return True
    if phase == "train-step" or target == "trainer":
        return False  # no bucket reaches the target
    return target != "standby" or phase == "rendezvous"  # only a promoted spare receives one


CELLS = {(p, f): [t for t in TARGETS if applies(p, f, t)] for p in PHASES for f in FAULTS}
CELLS = {k: v for k, v in CELLS.items() if v}


def expected(phase: str, fault: str, target: str) -> str:
    if fault == "corrupt":
        return "rejected"
    if target == "standby" and phase != "rendezvous":
        return "spare lost"
    return "replaced"


def config(tmp_path) -> ftstate.RuntimeConfig:
    return ftstate.RuntimeConfig.from_dict(
        {
            "rollout_workers": 2,
            "bucket_size_mb": 0.0625,
            "init_timeout_s": 60,
            "sync_timeout_s": 60,
            "failover_timeout_s": 30,
            "heartbeat_interval_s": HEARTBEAT_INTERVAL_S,
            "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
            "audit_log": str(tmp_path / "audit.jsonl"),
            # the matrix kills the same slots over and over on purpose: the crash-loop limit
            # (max_slot_failovers, tested in tests/unit/test_failover_budget.py) is set above it
            "fault_tolerance": {"enable": True, "reverse_weight_sync": True, "max_failovers": 20,
                                "max_slot_failovers": 20, "standby_workers": 1},
        },
        environ={},
    )


def state_of(rt, name: str) -> str:
    return next(m.state for m in rt.members() if m.member == name)


def trainer_name(rt) -> str:
    return next(m.member for m in rt.members() if m.role == "trainer" and m.rank == 0
                and m.state not in ("LOST", "RETIRED", "STOPPED", "FAILED"))


def warm_spares(rt, role: str | None = None) -> list[str]:
    return [m.member for m in rt.members() if m.state == "STANDBY" and (role is None or m.role == role)]


async def hit(rt, fault: str, name: str, *, after_progress: int | None = None) -> None:
    """One fault on one member (corrupt always hits the next bucket it receives)."""
    if fault == "kill":
        await rt.chaos.kill(name, after_progress=after_progress)
    elif fault == "hang":
        await rt.chaos.hang(name, after_progress=after_progress)
    else:
        await rt.chaos.corrupt(name)


def pick(rt, target: str, spare_role: str | None = None) -> list[str]:
    if target == "standby":
        spares = warm_spares(rt, spare_role)
        assert spares, rt.members()
        return spares[:1]
    if target == "two rollouts":
        return rt.serving_rollouts()[:2]
    if target == "trainer":
        return [trainer_name(rt)]
    return rt.serving_rollouts()[-1:]


class Cell:
    """One (phase, fault, target) run inside a long-running runtime, and its checks."""

    def __init__(self, rt, phase: str, fault: str, target: str) -> None:
        self.rt, self.phase, self.fault, self.target = rt, phase, fault, target
        self.mark = len(rt.audit.records)
        self.failovers_before = len(rt.failovers)
        self.group_version = rt.group_version
        self.hit: list[str] = []
        self.bystander: str | None = None

    def records(self, **match) -> list[dict]:
        return [r for r in self.rt.audit.records[self.mark:] if all(r.get(k) == v for k, v in match.items())]

    def first_fault(self, name: str) -> dict | None:
        return next((r for r in self.records(event="transition", member=name) if r["trigger"] in FAULT_TRIGGERS),
                    None)

    def new_failovers(self) -> list:
        return self.rt.failovers[self.failovers_before:]

    # -- what must have happened -----------------------------------------------------

    def check(self) -> None:
        outcome = expected(self.phase, self.fault, self.target)
        where = f"{self.phase} x {self.fault} x {self.target}"
        if outcome == "replaced":
            # An armed spare that fails while being promoted is a candidate, not a member: only
            # the bystander it was to replace must be.
            lost = [*([] if self.target == "standby" else self.hit), *([self.bystander] if self.bystander else [])]
            replaced = {f.lost: f.replacement for f in self.new_failovers()}
            for name in lost:
                assert replaced.get(name), f"{where}: {name} was not replaced: {self.new_failovers()}"
            for name in self.hit:
                first = self.first_fault(name)
                assert first is not None, f"{where}: no fault transition of {name}"
                if self.phase == "rendezvous":
                    # Joining the next group version (a survivor keeps serving while it joins).
                    assert first["group_version"] > self.group_version, f"{where}: {name} failed before the re-rendezvous: {first}"
                else:
                    states = {"idle": "READY", "train-step": "READY", "mid-sync": "SYNCING"}[self.phase]
                    assert first["from"] == states, f"{where}: {name}'s fault was detected in {first['from']}: {first}"
            if self.target == "standby":  # armed spare promoted, failed on joining: not the replacement
                assert replaced[self.bystander] not in self.hit, (where, replaced)
        elif outcome == "spare lost":
            (spare,) = self.hit
            first = self.first_fault(spare)
            assert first is not None and first["from"] == "STANDBY" and first["to"] == "LOST", first
            assert state_of(self.rt, spare) in ("LOST", "RETIRED", "STOPPED")
            assert not self.new_failovers(), f"{where}: a spare's loss is no failover: {self.new_failovers()}"
        else:  # rejected by the checksum, made again, no failover for the corruption
            if self.target == "standby":
                (spare,) = self.hit
                assert any(f.replacement == spare for f in self.new_failovers()), (where, self.new_failovers())
                assert self.records(event="transition", member=spare, trigger="resync_failed"), where
                assert spare in self.rt.serving_rollouts()
            else:
                retries = [r for r in self.records(event="sync_retry") if "ChecksumMismatch" in r.get("reason", "")]
                assert retries, f"{where}: no sync made again after a checksum mismatch"
                named = " ".join(r["reason"] for r in retries)
                assert any(n in named for n in self.hit), (where, named)
                lost = {f.lost for f in self.new_failovers()}
                assert not lost & set(self.hit), f"{where}: a corrupted member was replaced: {lost}"


async def detect(cell: Cell) -> None:
    """Idle faults: wait for their detection, bounded."""
    for name in cell.hit:
        await wait_until(lambda n=name: state_of(cell.rt, n) in ("LOST", "RETIRED"), DETECT_BOUND_S[cell.fault],
                         f"{name} declared lost ({cell.fault}, idle)")


async def run_cell(cell: Cell, seeds: list[int]) -> ftstate.SyncReport:
    rt, fault, target = cell.rt, cell.fault, cell.target
    seed = len(seeds) + 1
    seeds.append(seed)
    if cell.phase == "idle":
        await rt.trainer("train_step", seed)
        cell.hit = pick(rt, target)
        for name in cell.hit:
            await hit(rt, fault, name)
        if fault != "corrupt":
            await detect(cell)
        return await rt.sync()
    if cell.phase == "mid-sync":
        await rt.trainer("train_step", seed)
        cell.hit = pick(rt, target)
        if target != "standby":
            for name in cell.hit:  # fires on the member's own third unit of progress: a bucket
                await hit(rt, fault, name, after_progress=3)
            return await rt.sync()
        # A spare makes no progress: hit it once the sync is under way.
        sync = asyncio.ensure_future(rt.sync())
        await wait_until(lambda: rt.state == "SYNCING", 30, "the sync under way")
        await hit(rt, fault, cell.hit[0])
        await detect(cell)
        return await sync
    if cell.phase == "rendezvous":
        await rt.trainer("train_step", seed)
        serving = rt.serving_rollouts()
        if target == "two rollouts":
            # One is killed outright, the other fails while the group re-forms.
            cell.hit, cell.bystander = [serving[1]], serving[0]
            await rt.chaos.kill(serving[0])
            await hit(rt, fault, serving[1], after_progress=1)
        else:
            await wait_until(lambda: bool(warm_spares(rt, "rollout")), 60, "a warm rollout spare")
            cell.hit = pick(rt, target, spare_role="rollout")
            for name in cell.hit:
                await hit(rt, fault, name, after_progress=1)
            cell.bystander = next(n for n in serving if n not in cell.hit)
            await rt.chaos.kill(cell.bystander)
        return await rt.sync()
    # train-step: the fault lands while the trainer is inside a (long) step
    marker = cell.rt.config.audit_log + f".step{seed}"
    old_trainer = next(m.pid for m in rt.members() if m.member == trainer_name(rt))
    call = asyncio.ensure_future(rt.trainer("train_step", seed, 0.8, marker))
    await wait_until(lambda: _pids(marker)[:1] == [old_trainer], 30, "the trainer inside its step")
    cell.hit = pick(rt, target)
    for name in cell.hit:
        await hit(rt, fault, name)
    assert not call.done(), "the fault must land inside the step"
    assert await call == seed
    if target == "trainer":
        # cut short on the old trainer, made again once on the new one
        assert len(_pids(marker)) == 2 and _pids(marker)[1] != old_trainer, _pids(marker)
    else:
        await detect(cell)  # detected while idle again (the sync would otherwise find it)
    return await rt.sync()


def _pids(marker: str) -> list[int]:
    try:
        with open(marker) as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


async def assert_consistent(rt) -> None:
    serving = rt.serving_rollouts()
    assert serving, rt.members()
    assert await rt.rollout("checksum") == [rt.checksum] * len(serving)
    assert rt.checksum == await rt.trainer("checksum")


def promotions(rt) -> int:
    return sum(1 for r in rt.audit.records if r["event"] == "transition" and r.get("machine") == "group"
               and r["to"] == "PROMOTING")


def paid_for(rt) -> tuple[list[str], list[str]]:
    """The members the budget's units went to: one a unit, or every member of a node lost whole
    (one unit between them: ``node <id> lost: a, b``); and, apart, the replacements that died
    before they served (``a: b, its replacement, died``), a unit each: a slot's crash-loop strike."""
    lost: list[str] = []
    replacements: list[str] = []
    for r in rt.audit.records:
        if r["event"] != "budget_spent":
            continue
        reason = str(r.get("reason", ""))
        if reason.startswith("node ") and " lost: " in reason:
            lost += reason.split(" lost: ", 1)[1].split(", ")
        elif ", its replacement, died" in reason:
            replacements.append(reason.split(": ", 1)[1].split(", its replacement", 1)[0])
        else:
            lost.append(reason.split(":", 1)[0])
    return lost, replacements


def budget_ok(rt, cell: Cell, failovers_before: int, promoted_before: int) -> None:
    promoted = promotions(rt)
    # Every replaced member paid for once (members lost together on their node: one unit between
    # them); one entry into PROMOTING per failover round.
    rounds = {f.group_version for f in rt.failovers}
    paid, replacements = paid_for(rt)
    assert sorted(paid) == sorted(f.lost for f in rt.failovers) and promoted == len(rounds), (
        paid, promoted, [f.lost for f in rt.failovers], rounds)
    died = {r.get("member") for r in rt.audit.records if r["event"] == "transition" and r.get("to") == "LOST"}
    assert set(replacements) <= died and len(replacements) == len(set(replacements)), (replacements, died)
    # Members lost together (the "two rollouts" target) are replaced in one round, not one
    # round each; only in the rendezvous phase is a second loss, during the first round's
    # re-rendezvous, a round of its own.
    new = rt.failovers[failovers_before:]
    if new and cell.phase != "rendezvous":
        assert len({f.group_version for f in new}) == 1 and promoted - promoted_before == 1, (
            f"{cell.target}: {[(f.lost, f.group_version) for f in new]} replaced in "
            f"{promoted - promoted_before} rounds where one was due")


def test_the_matrix_leaves_out_only_cells_that_cannot_apply():
    removed = {(p, f, t) for p in PHASES for f in FAULTS for t in TARGETS if not applies(p, f, t)}
    assert all(f == "corrupt" for _, f, _ in removed)
    assert ("rendezvous", "corrupt", "standby") not in removed  # a promoted spare does receive
    assert sum(len(v) for v in CELLS.values()) == 4 * 4 * 3 - len(removed) == 39


@pytest.mark.parametrize(("phase", "fault"), list(CELLS), ids=[f"{p}-{f}" for p, f in CELLS])
async def test_fault_matrix(ray_cluster, tmp_path, phase, fault):
    rt = ftstate.Runtime(config(tmp_path), trainer=ReplayTrainer, rollout=TinyRollout,
                         trainer_kwargs={"big_floats": BIG_FLOATS})
    await rt.start()
    seeds: list[int] = []
    try:
        await wait_until(lambda: len(warm_spares(rt)) >= 2, 60, "warm spares")
        seeds.append(0)
        await rt.trainer("train_step", 0)
        version = (await rt.sync()).weights_version
        for target in CELLS[(phase, fault)]:
            await wait_until(lambda: len(warm_spares(rt)) >= 1, 60, "a warm spare")
            cell = Cell(rt, phase, fault, target)
            failovers_before, promoted_before = len(rt.failovers), promotions(rt)
            report = await run_cell(cell, seeds)
            version += 1
            assert report.weights_version == version, (target, report)
            await assert_consistent(rt)
            cell.check()
            if expected(phase, fault, target) == "spare lost":
                await wait_until(lambda: len(warm_spares(rt)) >= 1, 60, "a new spare in the lost one's place")
            budget_ok(rt, cell, failovers_before, promoted_before)
        # Whatever was replayed, the weights are those of a fault-free run of the same steps.
        assert rt.checksum == ReplayTrainer.reference(seeds, big_floats=BIG_FLOATS)
    finally:
        pids = [m.pid for m in rt.members()]
        await rt.close()
    assert check_trail(tmp_path / "audit.jsonl") == []
    import ray

    assert_gone(ray, rt.run_id, pids)
