"""``ftstate demo``: real RL on a local (or joined) Ray cluster, surviving real SIGKILLs, with proof.

Runs in the driver. Each step the rollouts sample the toy task (:mod:`ftstate.cli.demo.task`), the trainer
takes a REINFORCE step and ``rt.sync()`` pushes the weights; the same seeds run without faults and without Ray
(:func:`~ftstate.cli.demo.reinforce.train_local`) and the final weights must match. The trainer-rank,
maintenance and elastic-fleet scenarios are described in docs/quickstart.md. Output: ``audit.jsonl``,
``group.mmd``/``worker.mmd``, ``timeline.png`` (the ``plot`` extra; skipped with a note without it) and
``report.json`` (:mod:`ftstate.cli.demo.report`; the options in :mod:`ftstate.cli.demo.options`)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from ftstate.cli.demo.llm import ANSWER_TOKENS_MAX
from ftstate.cli.demo.options import ENGINES, NODES, NOTICE_DEADLINE_S, DemoOptions
from ftstate.cli.demo.report import run_nodes, trainer_ranks, write_report
from ftstate.core.config import RuntimeConfig
from ftstate.core.errors import ConfigError, FTError


def notice_step(steps: int) -> int:
    """The step at whose start the maintenance scenario announces the maintenance."""
    return max(0, steps // 3)


def fault_plan(steps: int) -> dict[int, str]:
    """Which fault hits at which step (a step runs generate -> train -> sync); with several ranks the trainer
    kill hits :func:`trainer_to_kill`."""
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
    """The trainer rank the trainer kill hits: the trainer, or rank 1 of several (rank 0 survives)."""
    return 1 if trainers > 1 else 0


def check_options(opts: DemoOptions) -> None:
    """Refuse options that cannot make a run, naming the option (ConfigError)."""
    if opts.engine not in ENGINES:
        raise ConfigError("engine", f"must be one of {', '.join(ENGINES)}, got {opts.engine!r}")
    if opts.engine == "vllm":
        for name, value, default in (("trainers", opts.trainers, 1), ("maintenance", opts.maintenance, False),
                                     ("address", opts.address, None)):
            if value != default:
                raise ConfigError(name, f"--engine vllm runs one trainer and its engines on a local cluster "
                                  f"(the model is written to --out on this machine): {name} must be {default!r}, "
                                  f"got {value!r}")
    if opts.answer_tokens and opts.engine != "vllm":
        raise ConfigError("answer_tokens", f"the answer length is --engine vllm's, got engine {opts.engine!r}")
    if isinstance(opts.answer_tokens, bool) or not isinstance(opts.answer_tokens, int) \
            or not 0 <= opts.answer_tokens <= ANSWER_TOKENS_MAX:
        raise ConfigError("answer_tokens", f"must be an int from 1 to {ANSWER_TOKENS_MAX} (the engines' context less "
                          f"the prompt), or 0 for the default, got {opts.answer_tokens!r}")
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
    """Run the demo; returns the exit code (0: survived and matched the fault-free run). faults None: on,
    except in the maintenance scenario."""
    return run_options(demo_options(out, steps, faults, options), _main)


def demo_options(out: str, steps: int, faults: bool | None, options: dict[str, Any]) -> DemoOptions:
    """The :class:`DemoOptions` of a call (steps 0: the default; faults None: on, except for maintenance)."""
    if faults is None:
        faults = not options.get("maintenance", False)
    return DemoOptions(out=out, steps=steps or DemoOptions.steps, faults=faults, **options)


def run_options(opts: DemoOptions, main: Any, *, engine: str = "policy", before: Any = None) -> int:
    """Check ``opts``, call ``before()``, then ``main(opts, console)``; returns its exit code, or 2 with one
    line for an FTError."""
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

        # Each node's GCE watcher finds its own server through the node's GCE_METADATA_HOST.
        maintenance = {"detect_node_maintenance": True, "maintenance_sources": ["gce"],
                       "maintenance_check_interval": 0.25, "maintenance_request_timeout_s": 1.0}
        # Trainer on the driver's node, rollouts spread: a rollout's node under notice has a node to move to.
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
    """``ftstate demo --async``: each step's samples as the steps taken before their weights, and every stamp
    that breaks the run's rules. ``versions[k]`` is the version after ``k`` steps; ``stamps`` holds per step
    the ``(prompt_id, version)`` of each sample. A faulted run need not stamp like a fault-free one; what
    holds is that it replays its stamps bit for bit, none more than ``max_staleness`` behind (nor ahead of)
    the trainer's version."""
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
    """The maintenance scenario's cluster and one metadata server per node (``GCE_METADATA_HOST``), all
    answering ``NONE`` until :meth:`announce`."""

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
        """Have a rollout node's metadata server announce maintenance; returns a note for the live view."""
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
        """After the last step: wait (bounded) for the announced node's drain to end, for the report."""
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
