"""Tiny torch workers for the integration tests (imported by the Ray worker processes)."""

from __future__ import annotations

import os
import signal
import time
import zlib

import torch

from ftstate import RolloutWorker, TrainerWorker
from ftstate.transport import state_checksum


def tiny_state(seed: int, big_floats: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {
        "layer.weight": torch.randn(32, 16, generator=g),
        "layer.bias": torch.randn(32, generator=g),
        "head.weight": torch.randn(8, 32, generator=g).to(torch.bfloat16),
        "step": torch.tensor([seed], dtype=torch.int64),
    }
    if big_floats:
        state["big"] = torch.randn(big_floats, generator=g)
    return state


def hang_once(marker: str) -> None:
    """The first process of the run to get here creates ``marker``, writes its pid into it
    (so a test can SIGKILL it) and hangs forever; every later one goes on."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    while True:
        time.sleep(3600)


class TinyTrainer(TrainerWorker):
    """Holds a few mixed-dtype tensors; ``train_step`` changes every one of them.
    hang_marker: as for :class:`TinyRollout` (the first trainer constructed hangs)."""

    def __init__(self, seed: int = 0, big_floats: int = 0, hang_marker: str | None = None) -> None:
        if hang_marker is not None:
            hang_once(hang_marker)
        self.state = tiny_state(seed, big_floats)
        self.steps = 0
        # optimizer state no rollout holds: a momentum buffer that every step changes
        self.momentum = torch.zeros(32, 16)

    def state_dict(self):
        if getattr(self, "_fail_state_dict", False):
            self._fail_state_dict = False
            raise RuntimeError("state_dict() failed: simulated user error")
        return self.state

    def fail_next_state_dict(self) -> None:
        self._fail_state_dict = True

    def load_state_dict(self, state) -> None:
        self.state = {k: v.clone() for k, v in state.items()}

    def train_step(self, lr: float = 0.1, seconds: float = 0.0) -> float:
        if seconds:
            time.sleep(seconds)  # a long step, so a fault can land in the middle of it
        self.steps += 1
        g = torch.Generator().manual_seed(1000 + self.steps)
        self.momentum.mul_(0.9).add_(torch.randn(self.momentum.shape, generator=g))
        with torch.no_grad():
            for _name, t in self.state.items():
                if t.is_floating_point():
                    t.add_((torch.randn(t.shape, generator=g) * lr).to(t.dtype))
                else:
                    t.add_(1)
        return float(self.state["layer.weight"].abs().mean())

    def checksum(self) -> str:
        return state_checksum(self.state)

    def pid(self) -> int:
        return os.getpid()

    def optimizer_checksum(self) -> str:
        return state_checksum({"momentum": self.momentum})

    def save_checkpoint(self, path: str) -> str:
        os.makedirs(path, exist_ok=True)
        torch.save({k: v.clone() for k, v in self.state.items()}, os.path.join(path, "state.pt"))
        torch.save({"momentum": self.momentum.clone()}, os.path.join(path, "optimizer.pt"))
        return self.checksum()

    def load_checkpoint(self, path: str) -> None:
        self.state = torch.load(os.path.join(path, "state.pt"))
        self.load_optimizer_checkpoint(path)

    def load_optimizer_checkpoint(self, path: str) -> None:
        self.momentum = torch.load(os.path.join(path, "optimizer.pt"))["momentum"]

    def reset_optimizer(self) -> None:
        self.momentum = torch.zeros(32, 16)


class ResidentTrainer(TinyTrainer):
    """Loads like ``torch.nn.Module.load_state_dict``: copies into the tensors it was built
    with (resident since its construction) instead of keeping new ones
    (benchmarks/failover.py --trainer resident)."""

    def load_state_dict(self, state) -> None:
        with torch.no_grad():
            for k, v in state.items():
                t = self.state.get(k)
                if t is not None and t.shape == v.shape and t.dtype == v.dtype:
                    t.copy_(v)
                else:
                    self.state[k] = v.clone()


class TinyRollout(RolloutWorker):
    """Keeps the weights it was given; ``generate`` answers with the version it serves.

    hang_marker: the first rollout constructed in this run creates that file, writes its pid
    into it and then hangs in its constructor forever (a group-init that never returns).
    hang_while: a rollout constructed while that file exists hangs in its constructor forever
    (a spare on a bad node), leaving ``{hang_while}.{pid}.pid`` behind. fail_marker: while that
    file exists, constructing a rollout fails (a replacement that cannot start).
    """

    def __init__(
        self, hang_marker: str | None = None, fail_marker: str | None = None, hang_while: str | None = None
    ) -> None:
        if fail_marker is not None and os.path.exists(fail_marker):
            raise RuntimeError(f"cannot start: {fail_marker} exists")
        if hang_while is not None and os.path.exists(hang_while):
            with open(f"{hang_while}.{os.getpid()}.pid", "w") as f:  # "I am hanging", for the test
                f.write(str(os.getpid()))
            while True:
                time.sleep(3600)
        if hang_marker is not None:
            hang_once(hang_marker)
        self.state: dict[str, torch.Tensor] = {}
        self.version = 0

    def load_weights(self, state, version: int) -> None:
        if getattr(self, "_fail_load", False):
            self._fail_load = False
            self.state = {}  # half-loaded: the model is unusable until the next full load
            raise RuntimeError("load_weights() failed: simulated user error")
        self.state = {k: v.clone() for k, v in state.items()}
        self.version = version

    def fail_next_load(self) -> None:
        self._fail_load = True

    def generate(self, prompt: str) -> tuple[str, int]:
        return (prompt, self.version)

    def checksum(self) -> str | None:
        return state_checksum(self.state) if self.state else None

    def pid(self) -> int:
        return os.getpid()


class SteppingRollout(TinyRollout):
    """Generates step by step and says so (:meth:`activity`): busy while ``generate`` runs, its
    steps as progress. ``wedge_next_generate()``: the next generate stops stepping (sleeps with
    the GIL released, as a kernel stuck on a device would) while the actor answers."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._generating = False
        self._steps = 0
        self._wedged = False

    def activity(self):
        return self._generating, self._steps

    def wedge_next_generate(self) -> None:
        self._wedged = True

    def generate(self, prompt: str, steps: int = 20, step_s: float = 0.05) -> tuple[str, int]:
        self._generating = True
        try:
            for _ in range(steps):
                time.sleep(3600 if self._wedged else step_s)
                self._steps += 1
        finally:
            self._generating = False
        return (prompt, self.version)


class ResidentRollout(TinyRollout):
    """Loads like an inference engine: its parameters exist (and are resident) from its
    construction, and ``load_weights`` copies into them (``big_floats``: the size of the
    ``big`` tensor it is built with; benchmarks/failover.py --rollout resident)."""

    def __init__(self, big_floats: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        if big_floats:  # filled, not torch.zeros: calloc'd pages would only be faulted in at the first load
            self.state = {"big": torch.empty(big_floats).fill_(0.0)}

    def load_weights(self, state, version: int) -> None:
        loaded = {}
        with torch.no_grad():
            for k, v in state.items():
                t = self.state.get(k)
                if t is not None and t.shape == v.shape and t.dtype == v.dtype:
                    loaded[k] = t.copy_(v)
                else:
                    loaded[k] = v.clone()
        self.state, self.version = loaded, version


class HeldResidentRollout(ResidentRollout):
    """A :class:`ResidentRollout` whose parameters are its engine: ``held_weights()`` gives
    them back, so the transport keeps no copy of its own (the engine's weights are the
    rollout's copy; sends to a newcomer or a new trainer read them from here)."""

    def held_weights(self):
        return self.state if self.version else None

    def scribble(self) -> None:
        """Change the engine's weights behind ftstate's back (one byte)."""
        next(iter(self.state.values())).view(torch.uint8).view(-1)[0] ^= 0xFF


class ViewHoldingRollout(HeldResidentRollout):
    """An engine that serves from the very tensors ``load_weights`` was handed (views into
    the transport's staging buffer), keeping no copy: what a careless engine does, and what
    ``staging_spare`` must never write into."""

    def load_weights(self, state, version: int) -> None:
        self.state, self.version = dict(state), version


class PartsRollout(HeldResidentRollout):
    """An engine on a device that loads a version part by part (``weights_device()`` +
    ``load_weights_part``). The "device" is this process's CPU (no GPU here: the GPU is
    mocked); each part is copied into the engine's weights, built at the first load, and what
    each part was is recorded (``parts()``) so a test sees the bucket bound from outside."""

    def weights_device(self):
        return "cpu"

    def load_weights_part(self, state, version: int, *, first: bool, last: bool) -> None:
        if first:
            self._parts = []
        self._parts.append((sum(t.numel() * t.element_size() for t in state.values()), len(state), first, last))
        with torch.no_grad():
            for k, v in state.items():
                t = self.state.get(k)
                self.state[k] = t.copy_(v) if t is not None and t.shape == v.shape and t.dtype == v.dtype else v.clone()
        if last:
            self.version = version

    def load_weights(self, state, version: int) -> None:
        raise AssertionError("a rollout with a device loads by parts")

    def parts(self) -> list:
        return list(getattr(self, "_parts", []))


class LayeredTrainer(TinyTrainer):
    """A :class:`TinyTrainer` with ``layers`` tensors of ``layer_floats`` float32 each beside its
    few small ones, as a model's layers: its largest tensor is a small part of the whole, so a
    bound of a few buckets on a load tells a load by parts from a load whole."""

    def __init__(self, layers: int = 0, layer_floats: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        g = torch.Generator().manual_seed(7)
        for i in range(layers):
            self.state[f"layers.{i}.weight"] = torch.randn(layer_floats, generator=g)


class LossyTrainer(TinyTrainer):
    """Sends bf16 copies of fp32 master weights: a rollout cannot give the masters back."""

    lossy_state_dict = True


class EngineRollout(TinyRollout):
    """A rollout whose "engine" keeps its own copy of the weights, read back through the
    ``held_weights()`` hook; ``flip_next_load`` / ``flip_now`` corrupt that copy silently
    (one byte), as a buggy engine would, while ``load_weights`` returns normally."""

    def load_weights(self, state, version: int) -> None:
        super().load_weights(state, version)
        self.engine = {k: v.clone() for k, v in state.items()}
        if getattr(self, "_flip_next", False):
            self._flip_next = False
            self.flip_now()

    def held_weights(self):
        return getattr(self, "engine", None)

    def flip_next_load(self) -> None:
        self._flip_next = True

    def flip_now(self) -> None:
        self.engine["layer.weight"].view(torch.uint8)[0] ^= 0xFF

    def engine_checksum(self) -> str | None:
        return state_checksum(self.engine) if getattr(self, "engine", None) else None


class BadNewcomerRollout(EngineRollout):
    """An engine rollout constructed while ``marker`` exists holds a corrupted copy after every
    load (one byte flipped in its engine, ``load_weights`` returning normally): a newcomer whose
    every resync fails without it dying."""

    def __init__(self, marker: str | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self._bad = marker is not None and os.path.exists(marker)

    def load_weights(self, state, version: int) -> None:
        super().load_weights(state, version)
        if self._bad:
            self.flip_now()


class ReplayTrainer(TinyTrainer):
    """A trainer whose step is deterministic in its arguments, as ftstate's replay requires:
    ``train_step(seed)`` adds noise drawn from ``seed`` (stateless SGD: no optimizer state, so
    a rebuilt trainer's reset optimizer changes nothing). ``reference(seeds)`` is the state a
    fault-free run reaches, computed in the caller's process. ``marker``: a file created when
    the step starts, so a test can kill the process inside it (then it lasts ``seconds``)."""

    def train_step(self, seed: int, seconds: float = 0.0, marker: str | None = None) -> int:  # type: ignore[override]
        if marker is not None:
            with open(marker, "a") as f:
                f.write(f"{os.getpid()}\n")
        if seconds:
            time.sleep(seconds)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _name, t in sorted(self.state.items()):
                if t.is_floating_point():
                    t.add_((torch.randn(t.shape, generator=g) * 0.1).to(t.dtype))
                else:
                    t.add_(seed)
        return seed

    @classmethod
    def reference(cls, seeds, **kwargs) -> str:
        trainer = cls(**kwargs)
        for seed in seeds:
            trainer.train_step(seed)
        return trainer.checksum()


def sharded_state(seed: int, step: int) -> dict[str, torch.Tensor]:
    """The full reference a ShardTrainer run holds after ``step`` steps (every rank builds it
    the same way: its step is deterministic in its arguments, like ReplayTrainer's)."""
    g = torch.Generator().manual_seed(seed)
    state = {
        "emb": torch.randn(10, 6, generator=g),                      # dim-0: 10 rows over 3 -> 4, 4, 2
        "proj": torch.randn(5, 7, generator=g).to(torch.bfloat16),   # dim-1: 7 cols over 3 -> 3, 3, 1
        "layer0.w": torch.randn(9, 4, generator=g),
        "layer1.w": torch.randn(4, 4, generator=g),
        "layer2.b": torch.randn(4, generator=g),
        "count": torch.tensor([seed], dtype=torch.int64),
    }
    for s in range(1, step + 1):
        gs = torch.Generator().manual_seed(seed * 7919 + s)
        for t in state.values():
            if t.is_floating_point():
                t.add_((torch.randn(t.shape, generator=gs) * 0.1).to(t.dtype))
            else:
                t.add_(1)
    return state


class ShardTrainer(TrainerWorker):
    """One trainer rank of several; ``style`` says what each rank's ``state_dict()`` owns:
    ``gather`` (rank 0 everything), ``pipeline`` (each rank whole layers), ``slices`` (dim-0 and
    dim-1 slices with uneven last slices, the rest whole on rank 0 and 1), or a bad one
    (``overlap``, ``gap``, ``twice``, ``mismatch``) from ``bad_from_step`` on.
    ``train_step`` all-reduces a step counter on the trainer group (a collective per step)."""

    def __init__(self, seed: int = 3, style: str = "slices", bad_from_step: int | None = None) -> None:
        self.seed, self.style, self.bad_from_step = seed, style, bad_from_step
        self.steps = 0
        self.state = sharded_state(seed, 0)
        self.group = None
        self.rank, self.world = 0, 1
        self.setups = 0

    def setup(self, group, rank: int, world_size: int) -> None:
        self.group, self.rank, self.world = group, rank, world_size
        self.setups += 1

    def facts(self) -> dict:
        return {"rank": self.rank, "world": self.world, "setups": self.setups, "pid": os.getpid(),
                "env": (os.environ.get("RANK"), os.environ.get("WORLD_SIZE"))}

    def fail_next_state_dict(self, rank: int) -> None:
        self._fail_rank = rank

    def mark_and_wait_in_step(self, marker: str) -> None:
        """The next train_step of the rank that gets this writes its pid to ``marker`` and waits
        in the all-reduce for ever-slow peers (a collective in flight when a peer dies)."""
        self._marker = marker

    def train_step(self) -> int:
        box = torch.tensor([1], dtype=torch.int64)
        marker = getattr(self, "_marker", None)
        if marker is not None and self.rank == 1:
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(3600)  # SIGKILLed here by the test, while rank 0 waits in the all-reduce
        self.group.allreduce([box]).wait()  # every rank steps together
        self.steps += 1
        self.state = sharded_state(self.seed, self.steps)
        return int(box.item())

    def _style(self) -> str:
        if self.bad_from_step is not None and self.steps >= self.bad_from_step:
            return self.style
        return "slices" if self.style in ("overlap", "gap", "twice", "mismatch") else self.style

    def state_dict(self):
        from ftstate import Shard

        r, n, s = self.rank, self.world, self.state
        if getattr(self, "_fail_rank", None) == r:
            self._fail_rank = None
            raise RuntimeError(f"state_dict() failed on rank {r}: simulated user error")
        style = self._style()
        if style == "gather":
            return dict(s) if r == 0 else {}
        if style == "pipeline":
            names = sorted(s)
            return {k: s[k] for i, k in enumerate(names) if i % n == r}
        out = {"emb": Shard(s["emb"].chunk(n, 0)[r], 0, r, n), "proj": Shard(s["proj"].chunk(n, 1)[r], 1, r, n)}
        whole = ["layer0.w", "layer1.w", "layer2.b", "count"]
        out.update({k: s[k] for i, k in enumerate(whole) if i % 2 == r})  # rank 2+: slices only
        if style == "overlap" and r == 1:
            out["emb"] = Shard(s["emb"].chunk(n, 0)[0], 0, 0, n)
        if style == "gap" and r == n - 1:
            del out["emb"]
        if style == "twice" and r == 1:
            out["layer0.w"] = s["layer0.w"]
        if style == "mismatch" and r == 1:
            out["proj"] = Shard(s["proj"].chunk(n, 1)[r][:4], 1, r, n)
        return out

    def load_state_dict(self, state) -> None:
        raise NotImplementedError("fault tolerance is off for several trainer ranks")

    def reference_checksum(self) -> str:
        return state_checksum(dict(sorted(sharded_state(self.seed, self.steps).items())))


def part_noise(name: str, shape, seed: int) -> torch.Tensor:
    """Step ``seed``'s noise for the full tensor ``name`` (every rank draws the full tensor's
    and keeps its slice, so a sharded run steps bit-identically to one full copy)."""
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed * 100003 + zlib.crc32(name.encode())))


class PartTrainer(TrainerWorker):
    """One trainer rank holding only what it owns, as an FSDP rank holds its shard: dim-0 and
    dim-1 slices (uneven last slices) of two tensors, the whole ones dealt over ranks 0 and 1
    (ShardTrainer's ``slices`` layout over :func:`sharded_state`). ``train_step(seed)``
    all-reduces each rank's ``rank + 1`` on the trainer group (a collective per step: the sum
    depends on the world being whole) and adds ``part_noise * 0.01 * sum`` to its floats
    (``sum`` to its ints): deterministic in its arguments and the world size, so
    :meth:`reference` computes a fault-free run's full state in the test process. Stateless
    SGD: a replaced rank's reset optimizer changes nothing. ``loads``/``setups`` count the
    calls of ``load_state_dict``/``setup`` (a survivor left untouched has no load)."""

    def __init__(self, seed: int = 3, big_floats: int = 0) -> None:
        self.seed = seed
        self.big_floats = big_floats  # benchmarks: one more float32 tensor, sharded along dim 0
        self.part: dict | None = None
        self.group = None
        self.rank, self.world = 0, 1
        self.setups = self.loads = self.steps = 0
        self._marker: str | None = None

    def setup(self, group, rank: int, world_size: int) -> None:
        self.group, self.rank, self.world = group, rank, world_size
        self.setups += 1
        if getattr(self, "_setup_marker", None):  # hold_next_setup: killed in here by the test
            with open(self._setup_marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(3600)
        if self.part is None:  # the first ranks (and a newcomer, until its part comes back): version 0
            self.part = self._owned(self._initial())

    def _initial(self) -> dict:
        state = sharded_state(self.seed, 0)
        if self.big_floats:
            state["big"] = torch.full((self.big_floats,), 0.5)
        return state

    def _owned(self, s: dict) -> dict:
        from ftstate import Shard

        r, n = self.rank, self.world
        out = {"emb": Shard(s["emb"].chunk(n, 0)[r].clone(), 0, r, n),
               "proj": Shard(s["proj"].chunk(n, 1)[r].clone(), 1, r, n)}
        if "big" in s:
            out["big"] = Shard(s["big"].chunk(n, 0)[r].clone(), 0, r, n)
        whole = ["layer0.w", "layer1.w", "layer2.b", "count"]
        out.update({k: s[k].clone() for i, k in enumerate(whole) if i % 2 == r})
        return out

    def facts(self) -> dict:
        return {"rank": self.rank, "world": self.world, "setups": self.setups, "loads": self.loads,
                "steps": self.steps, "pid": os.getpid()}

    def hold_next_setup(self, marker: str) -> None:
        """The next ``setup`` (a failover's re-formed trainer group) writes this process's pid to
        ``marker`` and sleeps: a rank lost while the ranks are being recovered."""
        self._setup_marker = marker

    def mark_and_wait_in_step(self, marker: str) -> None:
        """Rank 1's next step writes its pid to ``marker`` and sleeps before its all-reduce
        (the others wait in theirs): the test SIGKILLs it there, a collective in flight."""
        self._marker = marker

    def _sum(self) -> int:
        box = torch.tensor([self.rank + 1], dtype=torch.int64)
        self.group.allreduce([box]).wait()
        return int(box.item())

    def train_step(self, seed: int) -> int:
        if self._marker is not None and self.rank == 1:
            with open(self._marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(3600)
        total = self._sum()
        full = self._initial()
        with torch.no_grad():
            for name, v in self.part.items():
                t = v.tensor if hasattr(v, "tensor") else v
                if not t.is_floating_point():
                    t.add_(total)
                    continue
                noise = part_noise(name, full[name].shape, seed)
                if hasattr(v, "tensor"):
                    noise = noise.chunk(v.count, v.dim)[v.index]
                t.add_((noise * 0.01 * total).to(t.dtype))
        self.steps += 1
        return total

    def state_dict(self):
        return dict(self.part)

    def load_state_dict(self, state) -> None:
        from ftstate import Shard

        self.loads += 1
        self.part = {k: Shard(v.tensor.clone(), v.dim, v.index, v.count) if isinstance(v, Shard) else v.clone()
                     for k, v in state.items()}

    @classmethod
    def reference(cls, seeds, world: int, seed: int = 3) -> str:
        """The full state's checksum after ``seeds`` steps of a fault-free run of ``world`` ranks."""
        full = sharded_state(seed, 0)
        total = world * (world + 1) // 2
        with torch.no_grad():
            for s in seeds:
                for name, t in full.items():
                    if t.is_floating_point():
                        t.add_((part_noise(name, t.shape, s) * 0.01 * total).to(t.dtype))
                    else:
                        t.add_(total)
        return state_checksum(full)


class LocalPartTrainer(PartTrainer):
    """:class:`PartTrainer` whose calls touch only the rank's own state (``rank_local_calls``):
    the step's sum is the whole world's, computed locally instead of all-reduced."""

    rank_local_calls = True

    def _sum(self) -> int:
        return self.world * (self.world + 1) // 2


class MisloadingPartTrainer(LocalPartTrainer):
    """A rank constructed while ``marker`` exists does not reproduce the part it is given: its
    ``load_state_dict`` nudges one value (a resharding bug, a wrong dtype cast), and returns
    normally."""

    def __init__(self, marker: str | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self._misload = marker is not None and os.path.exists(marker)

    def load_state_dict(self, state) -> None:
        super().load_state_dict(state)
        if self._misload:
            with torch.no_grad():
                t = self.part["emb"].tensor
                t.view(-1)[0] += 1.0


class InFlightRollout(TinyRollout):
    """Generates token by token, with a safe point between two tokens (``rollout_updates:
    in_flight``): each token records the weights version it was computed with and the checksum
    of the weights it read, so a test sees exactly where a generation swapped and that no token
    ran on a mix. ``safe_points=False``: a loop that never offers one."""

    _generating = False
    _steps = 0

    def activity(self):
        return self._generating, self._steps

    def generate_steps(self, prompts: list, steps: int = 20, step_s: float = 0.05,
                       safe_points: bool = True) -> list:
        tokens = []
        swaps = []  # (version, wall time) of each swap at a safe point, for the benchmark
        self._generating = True
        try:
            for _ in range(steps):
                before = self.version
                if safe_points:
                    self.safe_point()
                if self.version != before:
                    swaps.append((self.version, time.time()))
                tokens.append((self.version, state_checksum(self.state) if self.state else None))
                self._steps += 1
                time.sleep(step_s)
        finally:
            self._generating = False
        return [{"prompt": p, "tokens": tokens, "swaps": swaps} for p in prompts]

    def generate_shard(self, steps: int, step_s: float, prompts: list) -> list:
        """:meth:`generate_steps` as ``rt.rollout_map`` calls it (the shard last)."""
        return self.generate_steps(prompts, steps, step_s)

    def tag(self, prompts: list) -> list:
        """One short call: each prompt with the version that answered it."""
        return [(p, self.version) for p in prompts]

    def wait_for(self, marker: str, timeout_s: float = 60.0) -> int:
        """A call that holds the rollout until ``marker`` exists (no safe point meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.version


class DyingRollout(SteppingRollout):
    """A :class:`SteppingRollout` that dies in its load once: while ``die_marker`` exists, the
    first rollout to load removes it and SIGKILLs itself (a newcomer killed while it is fed)."""

    def __init__(self, die_marker: str | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self._die_marker = die_marker

    def load_weights(self, state, version: int) -> None:
        marker = self._die_marker
        if marker is not None and os.path.exists(marker):
            try:
                os.remove(marker)  # once: the one started in its place loads normally
            except FileNotFoundError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        super().load_weights(state, version)
