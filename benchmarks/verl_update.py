"""One verl ``update_weights`` with backend ``ftstate`` against a raw gloo broadcast of the same bytes.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PYTHONPATH=. .venv-verl/bin/python benchmarks/verl_update.py \\
        [--synthetic-mb 256] [--bucket-mb 64] [--reps 3]

verl's stock engines cannot run on CPU (``naive`` is colocated-only, ``nccl`` needs GPUs), so
the baseline is the same bytes moved by a plain ``ProcessGroupGloo`` broadcast from trainer
rank 0 to the same two rollout workers (verl ``CheckpointEngineWorker`` actors), in buckets of
the same size with the same window, timed on the sender between two barriers: no manifest,
no checksums, no vote, no verl calls. Two payloads: the test suite's tiny Qwen2 (~5 MiB) and
``--synthetic-mb`` of float32 tensors of 16 MiB each; the trainer is 2 ranks (each holds a
shard of every tensor; the per-tensor generator all-gathers it, as FSDP does).

Three figures per payload, each the median over ``--reps`` rounds, each round running the
raw broadcast right before the update so a shared machine's drift largely cancels:

* ``update_weights``: the driver's wall time of ``FTStateCheckpointEngineManager.update_weights``
  (abort/resume hooks, prepare, build_topology, a new gloo group version, the transfer, the
  final vote, finalize: several verl round trips);
* ``engine``: trainer rank 0's ``send_weights`` (generator + transfer + vote; the rollouts
  consume each tensor without copying it);
* ``raw``: the baseline; ratios are ``update_weights / raw`` and ``engine / raw``;
* ``generator``: the trainer walking its generator alone (the all-gathers, nothing sent),
  which the raw baseline does not do: ``(generator + raw) / raw`` is what a transport with no
  protocol of its own and no overlap of generator and wire would cost.

``--modes`` instead compares the commit modes on the synthetic payload, each with its own two
rollout workers on the one node: ``update_weights`` wall time (median) and the **peak extra
memory of the node's rollouts** over every update, sampled every 10 ms as the sum of the
rollout processes' Pss (``/proc/PID/smaps_rollup``: a page shared by both, such as the staged
node copy in ``/dev/shm``, counts once) minus that sum before their first update. The
adapter copies nothing (recording off), so this is the transport's staging alone, beside the
engine's own copy; ratios are ``staged / stream`` in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # verl's wheel installs a `tests` package of its own
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

MiB = 1024 * 1024


def bench(name: str, trainer, rollout, replicas, config, bucket: int, reps: int) -> dict[str, float]:
    import ray

    from ftstate.integrations.verl import FTStateCheckpointEngineManager
    from ftstate.integrations.verl.engine import driver_store, issue_version

    nbytes = trainer.gather_full()[0]
    ray.get([w.set_recording.remote(False) for w in rollout.workers])
    manager = FTStateCheckpointEngineManager(config=config, actor_wg=trainer, replicas=list(replicas))
    store = driver_store()
    rounds = []
    try:
        manager.update_weights(global_steps=0)  # warm-up: buffers, first group version
        for rep in range(reps + 1):
            version = issue_version(store, "raw-bench")
            world = 1 + len(rollout.workers)
            calls = [trainer.workers[0].raw_broadcast.remote(str(store.address), "raw-bench", version, world, bucket)]
            calls += [w.raw_broadcast.remote(str(store.address), "raw-bench", version, r + 1, world, nbytes, bucket)
                      for r, w in enumerate(rollout.workers)]
            raw = ray.get(calls)[0]
            walk = trainer.walk_generator()[0]
            started = time.perf_counter()
            metrics = manager.update_weights(global_steps=rep + 1)
            update = time.perf_counter() - started
            if rep:  # the first round warms the raw path up
                rounds.append((update, metrics["ftstate/update_s"], raw, walk))
    finally:
        manager.close()
    update, engine, raw, walk = (statistics.median(r[i] for r in rounds) for i in range(4))
    ratio_update = statistics.median(u / r for u, _, r, _ in rounds)
    ratio_engine = statistics.median(e / r for _, e, r, _ in rounds)
    ratio_walk = statistics.median((w + r) / r for _, _, r, w in rounds)
    row = {"payload": name, "MiB": nbytes / MiB, "update_weights_s": update, "engine_s": engine, "raw_s": raw,
           "generator_s": walk, "update/raw": ratio_update, "engine/raw": ratio_engine,
           "(generator+raw)/raw": ratio_walk}
    print(f"| {name} | {nbytes / MiB:.1f} | {update:.3f} | {engine:.3f} | {raw:.3f} | {walk:.3f} | "
          f"{ratio_update:.2f} | {ratio_engine:.2f} | {ratio_walk:.2f} |", flush=True)
    return row


def _pss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def bench_modes(trainer, model: str, bucket_mb: int, reps: int) -> list[dict[str, float]]:
    """stream vs staged on the same trainer, each with two fresh rollout workers on this node."""
    import threading

    import ray

    from ftstate.integrations.verl import FTStateCheckpointEngineManager
    from tests.verl.harness import checkpoint_engine_config, release, rollout_replicas

    nbytes = trainer.gather_full()[0]
    rows = []
    for mode in ("stream", "staged"):
        config = checkpoint_engine_config(bucket_mb=bucket_mb, init_timeout_s=120, sync_timeout_s=600,
                                          commit_mode=mode)
        rollout, replicas = rollout_replicas(model, config, prefix=f"bench-{mode}")
        try:
            ray.get([w.set_recording.remote(False) for w in rollout.workers])
            pids = [ray.get(w.progress.remote())["pid"] for w in rollout.workers]
            base = _pss(pids)
            peak = [base]
            stop = threading.Event()

            def sample(pids=pids, peak=peak, stop=stop) -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], _pss(pids))
                    stop.wait(0.01)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            manager = FTStateCheckpointEngineManager(config=config, actor_wg=trainer, replicas=list(replicas))
            times = []
            try:
                for rep in range(reps + 1):
                    started = time.perf_counter()
                    manager.update_weights(global_steps=rep + 1)
                    if rep:  # the first one allocates the receive buffers
                        times.append(time.perf_counter() - started)
            finally:
                manager.close()
                stop.set()
                sampler.join()
            rows.append({"mode": mode, "update_weights_s": statistics.median(times), "extra_bytes": peak[0] - base})
        finally:
            release(rollout)
    stream = rows[0]
    print(f"synthetic {nbytes / MiB:.0f} MiB, bucket {bucket_mb} MiB, 2 trainer ranks -> 2 rollout workers on one "
          f"node, median of {reps} updates")
    print("| commit_mode | update_weights s | peak extra memory of the node's rollouts MiB | x payload "
          "| time / stream | memory / stream |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mode']} | {r['update_weights_s']:.3f} | {r['extra_bytes'] / MiB:.0f} | "
              f"{r['extra_bytes'] / nbytes:.2f} | {r['update_weights_s'] / stream['update_weights_s']:.2f} | "
              f"{r['extra_bytes'] / max(stream['extra_bytes'], 1):.2f} |", flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic-mb", type=int, default=256)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--modes", action="store_true", help="compare commit_mode stream and staged instead")
    args = parser.parse_args(argv)

    import ray

    from tests.tiny_qwen2 import make_tiny_qwen2
    from tests.verl.harness import checkpoint_engine_config, release, rollout_replicas, trainer_group

    if not ray.is_initialized():
        # a cluster of its own: never join one another job started on this machine
        ray.init(address="local", num_cpus=16, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    config = checkpoint_engine_config(bucket_mb=args.bucket_mb, init_timeout_s=120, sync_timeout_s=600)
    model = make_tiny_qwen2(os.path.join(tempfile.mkdtemp(), "tiny-qwen2"))
    if args.modes:
        trainer = trainer_group(model, config, synthetic_mb=args.synthetic_mb)
        try:
            return bench_modes(trainer, model, args.bucket_mb, args.reps)
        finally:
            release(trainer)
    rollout, replicas = rollout_replicas(model, config)
    groups = [("tiny Qwen2", trainer_group(model, config)),
              (f"synthetic {args.synthetic_mb} MiB", trainer_group(model, config, synthetic_mb=args.synthetic_mb))]
    print(f"bucket {args.bucket_mb} MiB, 2 trainer ranks -> 2 rollout replicas, median of {args.reps} rounds")
    print("| payload | MiB | update_weights s | engine s | raw gloo s | generator s | update/raw | engine/raw "
          "| (generator+raw)/raw |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    try:
        for name, trainer in groups:
            rows.append(bench(name, trainer, rollout, replicas, config, args.bucket_mb * MiB, args.reps))
    finally:
        for wg in [rollout, *(g for _, g in groups)]:
            release(wg)
    return rows


if __name__ == "__main__":
    main()
