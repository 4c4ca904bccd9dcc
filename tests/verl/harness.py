"""verl's own worker groups on CPU, for the verl suite (imported by Ray workers from tests/).

What runs for real: verl 0.9.1's ``RayResourcePool``/``RayWorkerGroup``/``RayClassWithInitArgs``,
its ``CheckpointEngineWorker`` (the rollout side, unchanged but for the server adapter), its
``RolloutReplica`` and ``CheckpointEngineManager``, and the engine verl builds by name from
``CheckpointEngineRegistry`` after importing ``custom_backend_module``.

What is a stand-in, and why:

* the trainer: :class:`HFTrainerWorker`, a verl ``Worker`` holding a tiny Qwen2 made locally
  with transformers, rather than verl's FSDP ``TrainingWorker`` (verl 0.9.1 has no CPU
  platform; getting FSDP2 to run needs a registered CPU platform and several overrides, and
  costs more start-up time than the CI budget allows). Each rank keeps one shard of every
  parameter and its per-tensor generator all-gathers it across the trainer ranks, so, as with
  FSDP, producing each tensor is a collective: a trainer rank that stopped walking the
  generator would hang the others.
* the server adapter: :class:`RecordingAdapter`, verl's mock-server idea (there is no
  inference engine on CPU): it keeps a copy of every tensor it is given.
* the replica: :class:`LocalReplica`, verl's test ``MockReplica`` (its workers are slices of
  one rollout worker group; no HTTP servers).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

import ray
import torch
import torch.distributed as dist
from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig
from verl.workers.rollout import BaseRollout, RolloutReplica


def raw_broadcast(comm, buf: torch.Tensor, bucket: int, window: int = 3) -> float:
    """The baseline of benchmarks/verl_update.py: ``buf`` broadcast from rank 0 in buckets of
    ``bucket`` bytes on a plain gloo group (no manifest, no checksums, no vote), ``window``
    buckets on the wire at once; seconds between two barriers."""
    import time
    from collections import deque

    comm.barrier()
    started = time.perf_counter()
    posted: deque = deque()
    for at in range(0, buf.numel(), bucket):
        posted.append(comm.broadcast(buf[at : at + bucket], 0))
        while len(posted) >= window:
            posted.popleft().wait()
    while posted:
        posted.popleft().wait()
    comm.barrier()
    return time.perf_counter() - started


def join_raw(store: str, group: str, version: int, rank: int, world: int):
    from ftstate.transport import create_communicator

    return create_communicator("gloo", store_addr=store, group=group, version=version, rank=rank, world_size=world,
                               timeout_s=120)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class HFTrainerWorker(Worker):
    """The trainer side: an HF model sharded over the trainer ranks, verl's engine by name.

    ``synthetic_mb``: instead of the model, ``synthetic_mb`` MiB of float32 tensors of 16 MiB
    each (the benchmark's synthetic weights).
    """

    def __init__(self, model_path: str, checkpoint_engine: CheckpointEngineConfig, synthetic_mb: int = 0) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        if not dist.is_initialized():  # verl's Worker set MASTER_ADDR/PORT, RANK and WORLD_SIZE
            dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size)
        if synthetic_mb:
            g = torch.Generator().manual_seed(1)
            full = {f"synthetic.{i}": torch.randn(4 << 20, generator=g) for i in range(synthetic_mb // 16)}
        else:
            full = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
        self.shapes = {n: (t.shape, t.numel()) for n, t in full.items()}
        self.shards = {}
        for name, t in full.items():
            per = -(-t.numel() // self.world_size)
            flat = torch.zeros(per * self.world_size, dtype=t.dtype)
            flat[: t.numel()] = t.flatten()
            self.shards[name] = flat[self.rank * per : (self.rank + 1) * per].clone()
        # as verl's production ActorRolloutRefWorker does: import the plugin, then build by name
        import_external_libs(checkpoint_engine.custom_backend_module or None)
        kwargs = dict(checkpoint_engine.engine_kwargs.get(checkpoint_engine.backend, {}))
        if self.rank == 0:
            kwargs["is_master"] = True
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            checkpoint_engine.backend, bucket_size=checkpoint_engine.update_weights_bucket_megabytes << 20, **kwargs
        )
        self.tensors_walked = 0

    def per_tensor_param(self):
        """The full tensors, one at a time, each gathered across the trainer ranks (as FSDP does)."""
        for name, shard in self.shards.items():
            parts = [torch.empty_like(shard) for _ in range(self.world_size)]
            dist.all_gather(parts, shard)
            shape, numel = self.shapes[name]
            self.tensors_walked += 1
            yield name, torch.cat(parts)[:numel].view(shape)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto"):
        return await self.checkpoint_engine.send_weights(self.per_tensor_param(), global_steps=global_steps)

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self, step: int) -> None:
        """Change every weight (deterministically per step), so each update carries new bytes."""
        g = torch.Generator().manual_seed(1000 + step * 10 + self.rank)
        for shard in self.shards.values():
            shard.add_(torch.randn(shard.shape, generator=g, dtype=shard.dtype) * 1e-3)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def full_digests(self) -> dict[str, str]:
        """sha256 of every full tensor (a collective: every trainer rank takes part)."""
        return {name: digest(t) for name, t in self.per_tensor_param()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def state_checksum(self) -> str:
        """ftstate's whole-state checksum of the full weights (a collective, as above)."""
        from ftstate.transport.checksum import state_checksum

        return state_checksum(dict(self.per_tensor_param()))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def gather_full(self) -> int:
        """Rank 0 keeps the full weights as one byte buffer (for the raw baseline); every rank
        takes part in the gathers. Returns the byte count."""
        parts = [t.contiguous().view(-1).view(torch.uint8) for _, t in self.per_tensor_param()]
        self._full = torch.cat(parts) if self.rank == 0 else None
        return sum(p.numel() for p in parts)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def walk_generator(self) -> float:
        """Seconds to walk the per-tensor generator alone (the gathers, nothing sent)."""
        import time

        started = time.perf_counter()
        for _ in self.per_tensor_param():
            pass
        return time.perf_counter() - started

    def raw_broadcast(self, store: str, group: str, version: int, world: int, bucket: int) -> float:
        comm = join_raw(store, group, version, 0, world)
        try:
            return raw_broadcast(comm, self._full, bucket)
        finally:
            comm.close()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def engine_state(self) -> dict[str, Any]:
        return {**self.checkpoint_engine.describe(), "tensors_walked": self.tensors_walked}


class RecordingAdapter(BaseRollout):
    """verl's mock server adapter, keeping a copy of what it is given.

    ``pause_after``: stop consuming after that many tensors of the next update and wait to be
    told to go on (:meth:`release`), so a test can act mid-update on observed progress.
    """

    def __init__(self, config: RolloutConfig, model_config: HFModelConfig) -> None:
        super().__init__(config, model_config, device_mesh=None)
        self.received: dict[str, torch.Tensor] = {}
        self.updates = 0
        self.in_update = 0
        self.yielded: list[tuple[str, str]] = []
        self.recording = True
        self.pause_after: int | None = None
        self.paused = False
        self._go: asyncio.Event | None = None

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    async def update_weights(self, weights, **kwargs):
        self.in_update = 0
        self.yielded = []
        async for name, tensor in weights:
            if self.recording:
                self.received[name] = tensor.clone()
                self.yielded.append((name, digest(tensor)))
            self.in_update += 1
            if self.pause_after is not None and self.in_update >= self.pause_after:
                self.pause_after = None
                self.paused = True
                self._go = asyncio.Event()
                await self._go.wait()
                self.paused = False
        self.updates += 1


class RolloutWorker(CheckpointEngineWorker):
    """verl's ``CheckpointEngineWorker`` with the recording adapter (the only change)."""

    def __init__(self, rollout_config: RolloutConfig, model_config: HFModelConfig, *args, **kwargs) -> None:
        super().__init__(rollout_config, model_config, RecordingAdapter(rollout_config, model_config), *args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def digests(self) -> dict[str, str]:
        return {name: digest(t) for name, t in self.server_adapter.received.items()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def state_checksum(self) -> str:
        """ftstate's whole-state checksum of what the adapter was given."""
        from ftstate.transport.checksum import state_checksum

        return state_checksum(self.server_adapter.received)

    def progress(self) -> dict[str, Any]:
        a = self.server_adapter
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(), "updates": a.updates,
                "in_update": a.in_update, "paused": a.paused, **self.checkpoint_engine.describe()}

    def yielded(self) -> list[tuple[str, str]]:
        """(name, sha256) of every tensor the engine yielded in the last update, in order."""
        return list(self.server_adapter.yielded)

    def pause_after(self, tensors: int) -> None:
        self.server_adapter.pause_after = tensors

    def release(self) -> None:
        if self.server_adapter._go is not None:
            self.server_adapter._go.set()

    def raw_broadcast(self, store: str, group: str, version: int, rank: int, world: int, nbytes: int,
                      bucket: int) -> float:
        comm = join_raw(store, group, version, rank, world)
        try:
            return raw_broadcast(comm, torch.empty(nbytes, dtype=torch.uint8), bucket)
        finally:
            comm.close()

    def set_recording(self, on: bool) -> None:
        """Off: the adapter walks what it is given without copying it (the benchmark)."""
        self.server_adapter.recording = on

    async def block(self, seconds: float) -> None:
        """Occupy the actor's event loop (a worker that never reaches the next call in time)."""
        import time

        time.sleep(seconds)


class LocalReplica(RolloutReplica):
    """verl's test ``MockReplica``: a slice of one rollout worker group, no servers."""

    async def init_hybrid(self, worker_group: RayWorkerGroup):
        self.workers = worker_group.workers[self.world_size * self.replica_rank : self.world_size * (self.replica_rank + 1)]

    def get_ray_class_with_init_args(self) -> RayClassWithInitArgs:
        raise NotImplementedError

    async def launch_servers(self):
        raise NotImplementedError


def checkpoint_engine_config(backend: str = "ftstate", *, bucket_mb: int = 1, **settings: Any) -> CheckpointEngineConfig:
    """The config the issue's YAML gives (``custom_backend_module`` imported by verl)."""
    return CheckpointEngineConfig(
        backend=backend,
        update_weights_bucket_megabytes=bucket_mb,
        engine_kwargs={backend: dict(settings)},
        custom_backend_module="ftstate.integrations.verl",
    )


def trainer_group(model_path: str, ce: CheckpointEngineConfig, *, ranks: int = 2, synthetic_mb: int = 0,
                  prefix: str | None = None) -> RayWorkerGroup:
    pool = RayResourcePool([ranks], use_gpu=False, max_colocate_count=1, name_prefix=prefix)
    cls = RayClassWithInitArgs(cls=ray.remote(HFTrainerWorker), model_path=model_path, checkpoint_engine=ce,
                               synthetic_mb=synthetic_mb)
    wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, name_prefix=prefix)
    wg.ftstate_pool = pool
    return wg


def rollout_config(ce: CheckpointEngineConfig) -> RolloutConfig:
    return RolloutConfig(name="mock", tensor_model_parallel_size=1, data_parallel_size=1,
                         pipeline_model_parallel_size=1, checkpoint_engine=ce)


def rollout_replicas(model_path: str, ce: CheckpointEngineConfig, *, replicas: int = 2,
                     prefix: str | None = None,
                     nodes: list[int] | None = None) -> tuple[RayWorkerGroup, list[LocalReplica]]:
    """``replicas`` rollout replicas of one worker each; ``nodes``: verl's ``process_on_nodes``
    instead (one placement group per entry, each packed on one node: ``[2, 2]`` is 2 rollouts
    on each of two nodes where no node has room for two groups)."""
    model_config = HFModelConfig(path=model_path, load_tokenizer=True)
    rc = rollout_config(ce)
    if nodes is not None:
        replicas = sum(nodes)
    pool = RayResourcePool(nodes or [replicas], use_gpu=False, max_colocate_count=1, name_prefix=prefix)
    cls = RayClassWithInitArgs(cls=ray.remote(RolloutWorker), rollout_config=rc, model_config=model_config)
    wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, name_prefix=prefix)
    wg.ftstate_pool = pool
    reps = [LocalReplica(replica_rank=i, config=rc, model_config=model_config) for i in range(replicas)]

    async def init() -> None:
        await asyncio.gather(*[r.init_hybrid(wg) for r in reps])

    asyncio.run(init())
    return wg, reps


def release(wg: RayWorkerGroup) -> None:
    """End a worker group made here: its actors, then its placement groups (verl's resource
    pool reserves one CPU per worker until its placement group is removed; killing the
    actors alone leaves the reservation, and a later pool then waits for ever)."""
    import contextlib

    for handle in wg.workers:
        with contextlib.suppress(Exception):  # already gone
            ray.kill(handle, no_restart=True)
    pool = getattr(wg, "ftstate_pool", None)
    for pg in (pool.pgs or []) if pool is not None else []:
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(pg)
