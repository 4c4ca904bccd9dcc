"""Benchmark: in-flight updates against a barrier, with real vLLM engines on CPU.

``benchmarks/async_update.py``'s loop with vLLM engines (``VLLMRollout``, the demo's tiny Qwen2, in
their actors' processes) in place of the toy rollout: every rollout generates without stop, one
``generate()`` after another, each of ``--batch`` prompts and a length in tokens drawn from a
log-normal (median ``--median-tokens``, sigma ``--sigma``, ``ignore_eos``); the trainer trains
(``--train-s``) and syncs, ``--steps`` times. The same draws run once with ``rollout_updates:
barrier`` and once with ``in_flight``, in one process, on one Ray cluster:

- the trainer's idle time per step: the time inside ``rt.sync()`` (a barrier waits there for every
  generation in flight; in_flight: a busy engine swaps between two engine steps instead);
- reach: the time from the call to ``rt.sync()`` to every rollout computing with the new version
  (the wall clock at the end of each engine's ``load_weights``, read back from the engines);
- samples lost: generations that never completed (``--kill``: one more in_flight run, one engine
  SIGKILLed mid-run, its generation made again on a serving engine; goal 0).

    HF_HUB_OFFLINE=1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python benchmarks/vllm_async.py [--steps 6] [--kill]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

# in-process engines, no hub: read by Ray's workers (inherited) and by vLLM at engine start
os.environ.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "HF_HUB_OFFLINE": "1",
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING",
                   "TOKENIZERS_PARALLELISM": "false"})
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ftstate
from benchmarks.async_update import lognormal_lengths, loop_options, sample_forever
from ftstate.cli.demo import llm
from ftstate.controller.ray import cluster
from ftstate.core.protocol import UserCall
from ftstate.integrations.vllm import VLLMRollout
from tests.vllm.harness import QwenTrainer

#: Room for the log-normal's tail (the draws are capped at this less the prompt).
MAX_MODEL_LEN = 512


def cfg(mode: str, rollouts: int, kill: bool) -> ftstate.RuntimeConfig:
    """async_update.py's settings, with the vLLM suite's heartbeat timeout (an engine starting on a
    loaded machine misses a 3 s one)."""
    ft = {"enable": True, "mode": "standby", "max_failovers": 4} if kill else {"enable": False}
    return ftstate.RuntimeConfig.from_dict({
        "rollout_workers": rollouts, "rollout_updates": mode, "init_timeout_s": 300, "sync_timeout_s": 120,
        "heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 8.0, "fault_tolerance": ft,
    }, environ={})


class TimedRollout(VLLMRollout):
    """A VLLMRollout that keeps the wall time at which each version's load ended."""

    def __init__(self, model: str) -> None:
        super().__init__(model, dtype="bfloat16", engine_kwargs={
            "enforce_eager": True, "max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": 64 << 20})
        self.loads: list[tuple[int, float]] = []

    def load_weights(self, state, version: int) -> None:
        super().load_weights(state, version)
        self.loads.append((version, time.time()))

    def loaded(self) -> list[tuple[int, float]]:
        return self.loads


class TimedTrainer(QwenTrainer):
    """A train step of ``seconds`` (the trainer's compute) that changes every tensor."""

    def train_for(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.train_step(0.002)


async def run(mode: str, args: argparse.Namespace, model: str, kill: bool = False) -> dict:
    lengths = lognormal_lengths(args.seed, args.median_tokens, args.sigma, cap=MAX_MODEL_LEN - llm.PROMPT_TOKENS)
    prompts = [tokens for _, tokens in llm.make_prompts(0, args.batch, args.seed)]
    done = asyncio.Event()
    samples: list[dict] = []
    tally = {"lost": 0, "retried": 0}
    async with ftstate.Runtime(cfg(mode, args.rollouts, kill), trainer=TimedTrainer, rollout=TimedRollout,
                               trainer_args=(model,), rollout_args=(model,)) as rt:
        await rt.sync()
        draws = iter(lengths)

        def call(tokens: int) -> UserCall:
            return UserCall("generate", (prompts,), {"max_tokens": tokens, "temperature": 1.0, "ignore_eos": True})

        tasks = [asyncio.ensure_future(sample_forever(rt, i, done, draws, call, samples, tally))
                 for i in range(args.rollouts)]
        await asyncio.sleep(args.warmup_s)
        idle, began = [], []
        for step in range(args.steps):
            await rt.trainer("train_for", args.train_s)
            if kill and step == args.steps // 2:
                victim = rt.serving_rollouts()[-1]
                os.kill(next(m.pid for m in rt.members() if m.member == victim), signal.SIGKILL)
            t0_wall, t0 = time.time(), time.perf_counter()
            report = await rt.sync()
            idle.append(time.perf_counter() - t0)
            began.append((report.weights_version, t0_wall))
        done.set()
        await asyncio.gather(*tasks)
        loads = await rt.rollout("loaded")
    # each sync: the last engine (of those serving at the end) to load that version or a newer one
    reach = []
    for version, t0_wall in began:
        firsts = [min((t for v, t in engine if v >= version and t >= t0_wall), default=None) for engine in loads]
        if all(t is not None for t in firsts):
            reach.append(max(firsts) - t0_wall)
    spans = sum(1 for s in samples if len(s["weights_spans"]) > 1)
    return {"idle_s": statistics.mean(idle), "idle_p50_s": statistics.median(idle), "idle_max_s": max(idle),
            "generations": len(samples) // args.batch, "lost": tally["lost"], "retried": tally["retried"],
            "reach_p50_s": statistics.median(reach) if reach else float("nan"),
            "reach_max_s": max(reach) if reach else float("nan"), "swapped_mid_answer": spans}


def main() -> None:
    p = loop_options(__doc__.splitlines()[0], rollouts=2, steps=6, warmup_s=2.0)
    p.add_argument("--batch", type=int, default=4, help="prompts per generate() call")
    p.add_argument("--median-tokens", type=int, default=64)
    args = p.parse_args()
    model = llm.write_policy(os.path.join(tempfile.mkdtemp(prefix="vllm-async-"), "model"), args.seed)
    cluster.connect(None, log_to_driver=False)
    try:
        barrier = asyncio.run(run("barrier", args, model))
        in_flight = asyncio.run(run("in_flight", args, model))
        print(f"{'mode':10s} {'idle/step s':>12s} {'p50 s':>8s} {'max s':>8s} {'generations':>12s} "
              f"{'reach p50 s':>12s} {'reach max s':>12s} {'mid-answer':>11s}")
        for name, r in (("barrier", barrier), ("in_flight", in_flight)):
            print(f"{name:10s} {r['idle_s']:12.3f} {r['idle_p50_s']:8.3f} {r['idle_max_s']:8.3f} "
                  f"{r['generations']:12d} {r['reach_p50_s']:12.3f} {r['reach_max_s']:12.3f} "
                  f"{r['swapped_mid_answer']:11d}")
        print(f"idle ratio in_flight / barrier: {in_flight['idle_s'] / barrier['idle_s']:.3f}")
        if args.kill:
            faulted = asyncio.run(run("in_flight", args, model, kill=True))
            print(f"in_flight with an engine SIGKILLed: generations {faulted['generations']}, lost "
                  f"{faulted['lost']} (goal 0), made again {faulted['retried']}, idle/step {faulted['idle_s']:.3f} s")
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
