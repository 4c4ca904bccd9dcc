"""``ftstate demo``: real RL on a local Ray cluster, surviving real SIGKILLs, with proof.

One trainer (or ``trainers`` sharded ranks), two rollouts and one prewarmed spare per role, on the embedded default (a
local Ray cluster on the CPU) or on a running Ray cluster it joins (``address``: ``auto``
or ``host:port``; the report says on how many nodes the workers ran). Each step the rollouts sample completions of the toy task
(:mod:`ftstate.cli.demo.task`: sort three digits) for a batch of prompts, seeded per
(seed, step, prompt) and never per worker; the trainer takes a REINFORCE step; ``rt.sync()``
pushes the weights. With faults on, the demo SIGKILLs a rollout while it generates, a
rollout in the middle of a sync, and the trainer in the middle of a train step, and ftstate
recovers from each.

**Several trainer ranks** (``trainers``, ``ftstate demo --trainers N``; config
``trainer_workers: N``): the policy is sharded FSDP/ZeRO-3 style over ``N`` ranks
(:class:`~ftstate.cli.demo.workers.ShardedPolicyTrainer`: each rank holds its dim-0 slice of
every tensor, a step gathers the full model on the trainer group, computes the gradient of its
slice of the batch, and the ranks' gradients are all-gathered and added in rank order, so every
rank applies the same bits to its own rows), and every sync sends each rank's part from that
rank. The third fault then SIGKILLs trainer rank 1 as the step starts: rank 0's all-gather
loses its peer mid-step, rank 1 is replaced, the group re-forms, both ranks get their part of
the last sync back from a rollout and replay the steps since, and the step is made again. The
report lists each rank's pid at the start and the end (the survivor's is unchanged), and the
reference is the same ``N``-rank arithmetic run in one process
(``train_local(..., trainer_ranks=N)``).

**Proof that nothing was lost.** The same seeds are also run without faults and without
Ray (:func:`~ftstate.cli.demo.reinforce.train_local`, the same sampling and step code). A
failover that lost or repeated a step, or served stale weights, would change the samples
and so the weights: the demo compares the final weights' checksum and the reward curve of
both runs and exits non-zero if they differ.

**The maintenance scenario** (``maintenance``, ``ftstate demo --maintenance``): a cloud
announces host maintenance on one node mid-run and ftstate drains it while training goes on.
A drain moves members to another node, so the scenario starts a local cluster of three
nodes (``ray.cluster_utils.Cluster``, all on 127.0.0.1: :mod:`ftstate.cli.demo.nodes`): ``a``
(the driver's; the trainer), ``b`` and ``c`` (the rollouts, spread), each with a loopback GCE
metadata server of its own (:mod:`ftstate.cli.demo.metadata_server`, reached through the
node's ``GCE_METADATA_HOST`` as on a real VM). The runtime watches them
(``detect_node_maintenance``, ``maintenance_sources: [gce]``); at step ``steps // 3`` the
server of a node holding a rollout answers ``TERMINATE_ON_HOST_MAINTENANCE`` with a window
starting in :data:`NOTICE_DEADLINE_S`; the runtime drains the node (its rollout DRAINING and
serving on while a replacement on another node gets the current weights, then retired) and the
RL loop never stops. The report says the notices, the drains and their outcome, and the same
proof holds: a drain changes nothing of the training. Without ``faults`` given, the scenario
injects no kills (``--maintenance --faults`` does both).

**The elastic fleet** (``grow_to``, ``ftstate demo --grow-to N``): a third of the way in the
fleet grows to ``N`` rollouts (``rt.add_rollouts``: each newcomer is fed the current weights by
a rollout that holds them, never by the trainer, and proven by checksum before it serves), and
two thirds in it shrinks back to ``rollouts`` (``rt.scale_rollouts``: out of serving, out of the
group, then the processes stop). Samples are seeded per prompt, never per worker, so the same
proof holds: the run stays bit-identical to the fault-free one with a fixed fleet. The report
lists each change (who, fed by whom, how long) under ``scaling``.

Output folder: ``audit.jsonl`` (the trail), ``group.mmd``/``worker.mmd`` (the machines),
``timeline.png`` (states over time, failovers, the reward curve; needs matplotlib, the
``plot`` extra: without it the picture is skipped with one line, and ``report.json`` says
why under ``timeline_picture_skipped``) and ``report.json`` (written by
:mod:`ftstate.cli.demo.report`; the options are :mod:`ftstate.cli.demo.options`).

Runs in the driver process (``ftstate demo``); the workers are Ray actors.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from ftstate.cli.demo.options import ENGINES, NODES, NOTICE_DEADLINE_S, DemoOptions
from ftstate.cli.demo.report import run_nodes, trainer_ranks, write_report
from ftstate.core.config import RuntimeConfig
from ftstate.core.errors import ConfigError, FTError


def notice_step(steps: int) -> int:
    """The step at whose start the maintenance scenario announces the maintenance."""
    return max(0, steps // 3)


def fault_plan(steps: int) -> dict[int, str]:
    """Which fault hits at which step (a step runs generate -> train -> sync). With several
    trainer ranks, "kill trainer mid-step" hits :func:`trainer_to_kill`."""
    if steps < 4:
        return {min(1, steps - 1): "kill rollout while generating"} if steps > 1 else {}
    return {
        steps // 4: "kill rollout while generating",
        steps // 2: "kill rollout mid-sync",
        (3 * steps) // 4: "kill trainer mid-step",
    }


def scale_plan(steps: int, rollouts: int, grow_to: int) -> dict[int, int]:
    """At which step's start the fleet is scaled to how many rollouts (``grow_to``: none when 0)."""
    if not grow_to:
        return {}
    return {max(0, steps // 3): grow_to, max(1, (2 * steps) // 3): rollouts}


def trainer_to_kill(trainers: int) -> int:
    """The trainer rank the "kill trainer mid-step" fault kills: the trainer, or rank 1 of
    several (rank 0 survives, its all-gather cut short by the loss)."""
    return 1 if trainers > 1 else 0


def check_options(opts: DemoOptions) -> None:
    """Refuse options that cannot make a run, naming the option (ConfigError)."""
    if opts.engine not in ENGINES:
        raise ConfigError("engine", f"must be one of {', '.join(ENGINES)}, got {opts.engine!r}")
    if opts.engine == "vllm":
        for name, value, default in (("trainers", opts.trainers, 1), ("maintenance", opts.maintenance, False),
                                     ("address", opts.address, None), ("in_flight", opts.in_flight, False)):
            if value != default:
                raise ConfigError(name, f"--engine vllm runs one trainer and its engines on a local cluster "
                                  f"(the model is written to --out on this machine): {name} must be {default!r}, "
                                  f"got {value!r}")
    if isinstance(opts.trainers, bool) or not isinstance(opts.trainers, int) or opts.trainers < 1:
        raise ConfigError("trainers", f"must be an int >= 1 (trainer ranks), got {opts.trainers!r}")
    if opts.trainers > opts.batch_size:
        raise ConfigError("trainers", f"{opts.trainers} trainer ranks each train on a slice of the batch: "
                          f"batch_size must be at least that, got {opts.batch_size}")
    if opts.grow_to and (isinstance(opts.grow_to, bool) or not isinstance(opts.grow_to, int)
                         or opts.grow_to <= opts.rollouts):
        raise ConfigError("grow_to", f"must be more than rollouts ({opts.rollouts}) to grow the fleet, or 0, "
                          f"got {opts.grow_to!r}")
    if opts.grow_to and opts.engine != "policy":
        raise ConfigError("grow_to", f"the elastic fleet runs with --engine policy, got {opts.engine!r}")
    if opts.grow_to and opts.in_flight:
        # the asynchronous loop keeps a generation running across the change: not tried yet
        raise ConfigError("grow_to", "the elastic fleet runs with the synchronous loop (drop --async)")
    if opts.maintenance and opts.address is not None:
        raise ConfigError("address", "the maintenance scenario starts a local 3-node cluster of its own, each "
                          "node with its own loopback metadata server; it cannot join a running cluster "
                          "(drop --address)")


def run_demo(out: str = "ftstate-demo", steps: int = 0, faults: bool | None = None, **options: Any) -> int:
    """Run the demo; returns the exit code (0: it survived and matched the fault-free run).
    faults: None injects the kills except in the maintenance scenario. The dict-of-tensors
    policy only: ``ftstate.cli.demo.run_demo`` also runs ``engine="vllm"``."""
    return run_options(demo_options(out, steps, faults, options), _main)


def demo_options(out: str, steps: int, faults: bool | None, options: dict[str, Any]) -> DemoOptions:
    """The :class:`DemoOptions` of a call (steps 0: the default; faults None: on, except in
    the maintenance scenario)."""
    if faults is None:
        faults = not options.get("maintenance", False)
    return DemoOptions(out=out, steps=steps or DemoOptions.steps, faults=faults, **options)


def run_options(opts: DemoOptions, main: Any, *, engine: str = "policy", before: Any = None) -> int:
    """Check ``opts``, call ``before()`` (a check of what the run needs), then run
    ``main(opts, console)``; returns its exit code, or 2 with one line for an FTError.
    engine: the engine ``main`` runs (``opts.engine`` must be it)."""
    from rich.console import Console

    console = Console()
    try:
        check_options(opts)
        if opts.engine != engine:
            raise ConfigError("engine", f"this entry point runs engine {engine!r}, got {opts.engine!r} "
                              "(ftstate.cli.demo.run_demo runs every engine)")
        if before is not None:
            before()
        return asyncio.run(main(opts, console))
    except FTError as exc:
        from rich.markup import escape

        console.print(f"[bold red]demo failed:[/] {type(exc).__name__}: {escape(str(exc))}")
        return 2


def demo_config(opts: DemoOptions, folder: Path) -> RuntimeConfig:
    maintenance: dict[str, Any] = {}
    placement: dict[str, Any] = {}
    if opts.maintenance:
        from ftstate.cli.demo.nodes import LABEL

        # Each node's GCE watcher finds its own server through the node's GCE_METADATA_HOST;
        # an endpoint here would point every node at one server.
        maintenance = {"detect_node_maintenance": True, "maintenance_sources": ["gce"],
                       "maintenance_check_interval": 0.25, "maintenance_request_timeout_s": 1.0}
        # The trainer on the driver's node, the rollouts spread over the others: a notice for
        # a rollout's node then has a node to move to (the spares keep off the nodes they cover).
        placement = {"placement": {"trainer": {"labels": {LABEL: NODES[0]}},
                                   "rollout": {"labels": {LABEL: f"in({','.join(NODES[1:])})"}}}}
    return RuntimeConfig.from_dict(
        {
            "trainer_workers": opts.trainers,
            "rollout_workers": opts.rollouts,
            "address": opts.address,
            "bucket_size_mb": 8,
            "init_timeout_s": 180,
            "sync_timeout_s": 120,
            "failover_timeout_s": 60,
            "heartbeat_interval_s": 0.5,
            "heartbeat_timeout_s": 5.0,
            "audit_log": str(folder / "audit.jsonl"),
            "fault_tolerance": {
                "enable": True,
                "mode": "standby",
                "standby_workers": 1,
                "reverse_weight_sync": True,
                "max_failovers": opts.max_failovers,
                **maintenance,
            },
            **placement,
            **({"rollout_updates": "in_flight", "max_staleness": 1} if opts.in_flight else {}),
        }
    )


def stamp_steps(versions: list[int], stamps: list[list[tuple[int, int]]], max_staleness: int) -> tuple[
        list[dict[int, int]], list[str]]:
    """``ftstate demo --async``: each step's samples as the steps taken before the weights they
    ran on (what :func:`~ftstate.cli.demo.reinforce.train_local` replays), and every stamp that
    breaks the run's rules. versions: the weights version each sync committed, the initial
    weights' first (the version after ``k`` steps is ``versions[k]``); stamps: per step, the
    ``(prompt_id, version)`` of each sample.

    Which version a sample runs on depends on when its rollout reached a safe point, so a faulted
    run and a fault-free one need not stamp alike; what holds is that the run is its stamps'
    replay, bit for bit, and that no stamp is more than ``max_staleness`` behind the version the
    trainer had pushed when it took the samples (nor ahead of it)."""
    steps_of = {v: k for k, v in enumerate(versions)}
    out: list[dict[int, int]] = []
    problems: list[str] = []
    for step, row in enumerate(stamps):
        pushed = versions[min(step, len(versions) - 1)]
        done: dict[int, int] = {}
        for pid, version in row:
            if version not in steps_of or not 0 <= pushed - version <= max_staleness:
                problems.append(f"step {step}: prompt {pid} ran on version {version}, the trainer had pushed "
                                f"{pushed} (max_staleness {max_staleness})")
            done[pid] = steps_of.get(version, -1)
        out.append(done)
    return out, problems


class _MaintenanceScenario:
    """The maintenance scenario's cluster and metadata servers, and the announcement.

    One :class:`~ftstate.cli.demo.metadata_server.GceServer` per node, each given to its node
    only (``GCE_METADATA_HOST`` in that node's environment), all answering ``NONE`` until
    :meth:`announce` has one of them schedule maintenance."""

    def __init__(self) -> None:
        from ftstate.cli.demo.metadata_server import GceServer

        self.servers = {name: GceServer(keep_requests=64) for name in NODES}
        self.local: Any = None
        self.announced: dict[str, Any] | None = None

    def start_cluster(self) -> None:
        from ftstate.cli.demo.nodes import start_local_cluster

        self.local = start_local_cluster(NODES, env={n: {"GCE_METADATA_HOST": s.host} for n, s in self.servers.items()})

    def names(self) -> dict[str, str]:
        return self.local.names() if self.local is not None else {}

    def announce(self, rt: Any, step: int) -> str | None:
        """Have the metadata server of a node holding a rollout (not the trainer's) announce
        TERMINATE_ON_HOST_MAINTENANCE; returns a note for the live view."""
        members = [m for m in rt.members() if m.rank >= 0]
        trainer_nodes = {m.node_id for m in members if m.role == "trainer"}
        candidates = [m.node_id for m in members if m.role == "rollout" and m.node_id not in trainer_nodes]
        candidates = candidates or [m.node_id for m in members if m.node_id]
        name = next((self.local.name_of(n) for n in candidates if self.local.name_of(n)), None)
        if name is None:
            rt.audit.record("maintenance_announced", source="gce", kind="terminate", step=step,
                            reason="no member runs on a node of the local cluster: nothing announced")
            return None
        node_id = self.local.node_id(name)
        deadline = self.servers[name].announce("TERMINATE_ON_HOST_MAINTENANCE", seconds=NOTICE_DEADLINE_S)
        self.announced = {"node": name, "node_id": node_id, "step": step, "deadline": deadline,
                          "server": self.servers[name].url, "at": time.time()}
        rt.audit.record("maintenance_announced", source="gce", kind="terminate", name=name, node_id=node_id,
                        step=step, deadline=deadline, server=self.servers[name].url,
                        reason=f"GCE metadata server of node {name}: maintenance-event "
                               "TERMINATE_ON_HOST_MAINTENANCE")
        return f"GCE announced maintenance on node {name}"

    async def wait_for_drain(self, rt: Any, timeout: float) -> None:
        """After the last step: wait (bounded) until the announced node's drain has ended, so
        the report can say how it went."""
        if self.announced is None:
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end and rt.state not in ("FAILED", "STOPPED"):
            if any(d.node == self.announced["node_id"] for d in rt.drains):
                return
            await asyncio.sleep(0.05)

    def close(self) -> None:
        try:
            if self.local is not None:
                self.local.shutdown()
        finally:
            for server in self.servers.values():
                server.close()


async def _main(opts: DemoOptions, console: Any) -> int:
    from ftstate.cli.demo import task
    from ftstate.cli.demo.live import LiveView
    from ftstate.cli.demo.workers import PolicyRollout, PolicyTrainer, ShardedPolicyTrainer
    from ftstate.controller.ray import cluster
    from ftstate.controller.runtime import Runtime

    folder = Path(opts.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "audit.jsonl").unlink(missing_ok=True)
    cfg = demo_config(opts, folder)
    size = {"pad_mb": opts.pad_mb}
    lr = 0.005
    plan = fault_plan(opts.steps) if opts.faults else {}
    t_start = time.monotonic()
    scenario = _MaintenanceScenario() if opts.maintenance else None
    started_ray = False
    try:
        if scenario is not None:
            scenario.start_cluster()
        else:
            started_ray = cluster.connect(opts.address, log_to_driver=False)
        cluster.mute_worker_death_notices()  # every death is in the audit trail and the view
    except BaseException:
        if scenario is not None:
            scenario.close()
        raise
    rt = Runtime(cfg, trainer=ShardedPolicyTrainer if opts.trainers > 1 else PolicyTrainer, rollout=PolicyRollout,
                 trainer_kwargs={"seed": opts.seed, "size": size, "lr": lr},
                 rollout_kwargs={"seed": opts.seed, "size": size})
    rewards: list[float] = []
    syncs: list[Any] = []
    error: FTError | None = None
    view = LiveView(rt, opts.steps, console, enabled=opts.live,
                    node_names=scenario.names() if scenario is not None else None)
    nodes: dict[str, Any] = {}
    first_members: list[Any] = []
    announce_at = notice_step(opts.steps) if scenario is not None else None
    stamps: list[list[tuple[int, int]]] = []
    # --async: the next step's generation, started before this step trains and syncs
    ahead: asyncio.Future[Any] | None = None
    scaling = scale_plan(opts.steps, opts.rollouts, opts.grow_to)
    try:
        with view:
            await rt.start()
            first_members = rt.members()
            report = await rt.sync()  # version 1: the initial weights
            syncs.append(report)
            for step in range(opts.steps):
                fault = plan.get(step)
                note = fault or ""
                if step == announce_at and scenario is not None:
                    note = scenario.announce(rt, step) or note
                if step in scaling:
                    view.update(step=step, note=f"scaling the fleet to {scaling[step]} rollouts")
                    change = await rt.scale_rollouts(scaling[step])
                    if change is not None:
                        note = (f"{change.kind} {', '.join(change.members)} in {change.seconds:.2f}s"
                                + (f", fed by {', '.join(sorted({str(s) for s in change.sources.values()}))}"
                                   if change.sources else ""))
                view.update(step=step, note=note)
                batch = task.make_prompts(step, opts.batch_size, opts.seed)
                if not opts.in_flight:
                    if fault == "kill rollout while generating":
                        await rt.chaos.kill("rollout", opts.rollouts - 1)
                    results = await rt.rollout_map("generate", batch, step)
                else:
                    if ahead is None:
                        ahead = asyncio.ensure_future(rt.rollout_map("generate_stamped", batch, step))
                    if fault == "kill rollout while generating":
                        await asyncio.sleep(0.2)  # into the generation under way
                        await rt.chaos.kill("rollout", opts.rollouts - 1)
                    results, ahead = await ahead, None
                    stamps.append([(r[0], r[3]) for r in results])
                    rt.audit.record("samples_stamped", step=step, versions=sorted({r[3] for r in results}),
                                    stamps=[r[3] for r in results])
                    if step + 1 < opts.steps:
                        ahead = asyncio.ensure_future(rt.rollout_map(
                            "generate_stamped", task.make_prompts(step + 1, opts.batch_size, opts.seed), step + 1))
                ids = [r[0] for r in results]
                prompts = [tokens for _, tokens in batch]
                completions = [r[1] for r in results]
                scores = [r[2] for r in results]
                if fault == "kill trainer mid-step":
                    await rt.chaos.kill("trainer", trainer_to_kill(opts.trainers))
                stats = await rt.trainer("train", ids, prompts, completions, scores)
                rewards.append(stats["reward"])
                rt.audit.record("reward", step=step, reward=stats["reward"])
                if fault == "kill rollout mid-sync":
                    await rt.chaos.kill("rollout", 0, after_progress=2)
                syncs.append(await rt.sync())
                view.update(step=step + 1, reward=stats["reward"])
            if scenario is not None:
                view.update(note="waiting for the drain to end" if not rt.drains else "")
                await scenario.wait_for_drain(rt, cfg.failover_timeout_s + 30)
            final_checksum = await rt.trainer("checksum")
            serving = await rt.rollout("checksum")
    except FTError as exc:
        error = exc
        final_checksum, serving = None, []
    finally:
        if ahead is not None:
            ahead.cancel()
        members = rt.members() if rt.group is not None else []
        nodes = run_nodes(rt, members)
        failovers = rt.failovers
        drains = rt.drains
        injected = list(rt.chaos.injected) if rt.group is not None else []
        try:
            await rt.close()
        finally:
            if scenario is not None:
                scenario.close()
            elif started_ray:
                cluster.shutdown()
    seconds = time.monotonic() - t_start

    reference = None
    replay, stamp_problems = (stamp_steps([r.weights_version for r in syncs], stamps, cfg.max_staleness)
                              if opts.in_flight else (None, []))
    if error is None and not stamp_problems:
        from ftstate.cli.demo.reinforce import train_local
        from ftstate.transport import state_checksum

        ref = train_local(opts.seed, opts.steps, batch_size=opts.batch_size, lr=lr, shards=opts.rollouts,
                          trainer_ranks=opts.trainers, stamps=replay, **size)
        reference = {
            "checksum": state_checksum({k: v.detach() for k, v in ref.model.state_dict().items()}),
            "rewards": ref.rewards,
        }
    maintenance = None
    if scenario is not None:
        maintenance = {"announced": scenario.announced, "drains": drains, "node_names": scenario.names()}
    in_flight = None
    if opts.in_flight:
        staleness = [syncs[min(step, len(syncs) - 1)].weights_version - v for step, row in enumerate(stamps)
                     for _, v in row]
        in_flight = {"max_staleness": cfg.max_staleness, "stamp_problems": stamp_problems,
                     "samples_by_staleness": {str(k): staleness.count(k) for k in sorted(set(staleness))},
                     "stamps": [[v for _, v in row] for row in stamps]}
    return write_report(opts, console, folder, rewards, syncs, failovers, injected, members, final_checksum, serving,
                   reference, error, seconds, cfg, nodes=nodes, maintenance=maintenance,
                   trainer_ranks=trainer_ranks(first_members, members), in_flight=in_flight)
