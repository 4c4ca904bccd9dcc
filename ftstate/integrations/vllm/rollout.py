"""VLLMRollout: a ftstate rollout worker that owns a vLLM engine in its own process.

The engine is vLLM's offline ``LLM``, started in the actor's process when the worker is
constructed (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Weights reach it only through vLLM's own
in-place reload, ``collective_rpc("reload_weights", weights_iterator=..., is_checkpoint_format=True)``,
after ftstate's two-phase commit: every bucket received and verified, every rollout staged.

What the class guarantees, and why:

* **No request between the first and the last tensor.** ``load_weights`` and ``generate`` take
  one lock (and ftstate's host already runs user calls and the commit one at a time, so a call
  ``rt.rollout("generate", ...)`` waits for a load in progress). A load that raises part-way
  leaves the engine torn: ``generate`` then raises :class:`~ftstate.core.errors.EngineTorn`
  until a complete load, and ``held_weights()`` shows the mix (the member goes STALE).
* **Whole fused groups.** vLLM fuses q/k/v and gate/up into one layer each; reloading part of
  one corrupts the rest of it (measured: a reload of ``q_proj`` alone broke ``k_proj`` and
  ``v_proj``). A state that names part of a fused group, a tensor the engine does not hold, or
  a shape or dtype other than the engine's is refused with a
  :class:`~ftstate.core.errors.StateDictError` naming the tensor, before the engine is touched.
  The dtype must be the engine's: the proof compares bytes, so the trainer sends what the engine
  holds (bf16 copies of fp32 masters, say).
* **The prefix cache is reset** after every load: cached KV blocks were computed by the old weights.
* **In-flight updates** (``rollout_updates: in_flight``): a version committed while ``generate``
  runs is loaded between two ``llm_engine.step()`` calls, at a safe point taken as a pause
  (``safe_point(pause=True)``): the running requests are preempted with the prefix cache reset
  (``reset_prefix_cache(reset_running_requests=True)``), so their KV is recomputed on the new
  weights and they go on with their tokens so far. Each answer says the versions it spans
  (``weights_version``: the last; ``weights_versions``: every one, in order).
* **The proof reads the kernels.** ``held_weights()`` returns what the engine computes with,
  under the trainer's names (:mod:`ftstate.integrations.vllm.held`), so ftstate's held-bytes
  check compares the engine, not the tensors it was handed.
* **A wedged engine is seen.** While a ``generate`` runs, :meth:`activity` reports the worker
  busy and the engine's steps as its progress (each ``llm_engine.step()`` of vLLM's own loop is
  counted), so an engine stuck inside a kernel that released the GIL, whose actor still answers
  every heartbeat, stands still where the watchdog looks: it is suspected after half
  ``heartbeat_timeout_s`` without a step, declared lost at its SUSPECT deadline, killed with its
  actor and replaced. A single step longer than that bound (a prefill of minutes) would be
  taken for a wedge: the bound is the setting to raise.
* **One process, in-process engine only.** vLLM's multiprocess engine runs its core and
  workers in processes of their own: SIGKILL the actor and they stay orphaned for minutes with
  their ``/dev/shm`` segments, and a dead core leaves ``generate()`` neither returning nor
  raising (both measured in issue 23). In-process, the engine lives and dies with the actor,
  so ftstate's heartbeats and Ray's death notice cover it like any other worker. The
  multiprocess engine, tensor/pipeline/data parallelism and another executor are refused with
  :class:`~ftstate.core.errors.EngineRefused` naming the setting.

Standby: a spare constructs its engine when it starts (``load_format="dummy"``, the default:
random weights, no checkpoint read), so a promotion pays only the transfer; ``mode: cold``
pays the engine start (~2.5 s warm here, plus ``import vllm``) on every replacement.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from vllm import LLM, SamplingParams

from ftstate.core.errors import EngineRefused, EngineTorn, StateDictError
from ftstate.core.worker import RolloutWorker
from ftstate.integrations.vllm import held

#: The environment variable that puts vLLM's engine core in the caller's process ("0").
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"

#: Engine arguments that would start processes of their own beside the actor's: value allowed.
_ONE_PROCESS = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1}


class VLLMRollout(RolloutWorker):
    """A rollout worker whose engine is vLLM. Use it as ``rollout=VLLMRollout`` with
    ``rollout_args=(model,)``/``rollout_kwargs``, or subclass it (more user methods, a reward…).

    model: the model's path (a Hugging Face folder: config and tokenizer; its weights are read
    only with ``load_format="auto"``); dtype: the dtype the engine computes in (the trainer must
    send tensors of this dtype); load_format: ``"dummy"`` (the default: the engine starts with
    random weights, since ftstate loads the trainer's before the worker ever serves) or
    ``"auto"`` (read the checkpoint in ``model``); seed: the engine's sampling seed;
    engine_kwargs: any other argument of ``vllm.LLM`` (``max_model_len``, ``enforce_eager``,
    ``kv_cache_memory_bytes``, ``gpu_memory_utilization``…), checked for one-process mode.
    """

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "bfloat16",
        load_format: str = "dummy",
        seed: int = 0,
        engine_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        kwargs = dict(engine_kwargs or {})
        check_one_process(kwargs)
        # In-process engine: set for this process before vLLM reads it (it reads at engine start).
        os.environ.setdefault(MULTIPROCESSING_ENV, "0")
        self.model_path = model
        self.llm = LLM(model=model, dtype=dtype, load_format=load_format, seed=seed, **kwargs)
        # re-entrant: an in-flight swap loads inside generate(), on the thread that holds it
        self._lock = threading.RLock()
        self._generating = False
        self._versions: list[int] = []  # the versions the generate() under way ran on, in order
        self._steps = 0  # the engine's steps taken (read by activity(), on another thread)
        # vLLM's offline loop calls ``self.llm_engine.step()`` by attribute each time: counting it
        # on the instance sees every step without touching vLLM's classes.
        engine = self.llm.llm_engine
        self._step = engine.step
        engine.step = self._engine_step
        self._slots: dict[str, held.Slot] = self._on_model(held.layout)
        self._names: list[str] | None = None  # what the last complete load named
        self._torn: EngineTorn | None = None
        self.weights_version = 0

    # -- the RolloutWorker contract ------------------------------------------------------

    def load_weights(self, state: Mapping[str, Any], version: int) -> None:
        """Reload the engine in place from ``state`` (checked first: see the module docstring),
        then reset its prefix cache; no request runs meanwhile."""
        self._check_state(state)
        with self._lock:
            self._torn = EngineTorn(weights_version=version, cause="the load is in progress")
            try:
                self.llm.collective_rpc("reload_weights", kwargs={
                    "weights_iterator": self._weights(state), "is_checkpoint_format": True})
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
        """What the engine computes with now, under the names the last load gave, read from
        the engine itself (CPU: through each layer's packed kernel). None before any load."""
        with self._lock:
            if self._names is None:
                return None
            return self._on_model(held.read, self._slots, self._names)

    # -- serving -------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_tokens: int = 16,
        temperature: float = 0.0,
        **sampling: Any,
    ) -> list[dict[str, Any]]:
        """Generate for each prompt (text, or token ids) with ``vllm.SamplingParams(max_tokens,
        temperature, **sampling)`` (temperature 0: greedy). One dict per prompt: ``token_ids``,
        ``text``, the ``weights_version`` that produced its last tokens and ``weights_versions``,
        every version it ran on (two or more when an in-flight update swapped mid-way). Raises
        :class:`~ftstate.core.errors.EngineTorn` on an engine whose last load stopped part-way."""
        inputs: list[Any] = [p if isinstance(p, str) else {"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, **sampling)
        with self._lock:
            if self._torn is not None:
                raise self._torn
            self._versions = [self.safe_point(pause=True)]
            self._generating = True
            self._steps += 1  # its start moves too: a batch's admission is not a wedge
            try:
                outputs = self.llm.generate(inputs, params, use_tqdm=False)
            finally:
                self._generating = False
            versions, version = list(self._versions), self.weights_version
        return [{"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text, "weights_version": version,
                 "weights_versions": versions} for o in outputs]

    def activity(self) -> tuple[bool, int]:
        """(a ``generate`` under way, the engine steps taken so far): see the module docstring."""
        return self._generating, self._steps

    def held_checksum(self) -> str | None:
        """The checksum of :meth:`held_weights` (ftstate's whole-state checksum, the one the
        trainer's send is sealed with), for a caller that wants to see what the engine holds."""
        from ftstate.transport import state_checksum

        state = self.held_weights()
        return None if state is None else state_checksum(state)

    def pid(self) -> int:
        return os.getpid()

    # -- for subclasses ------------------------------------------------------------------

    def _weights(self, state: Mapping[str, Any]) -> Iterable[tuple[str, torch.Tensor]]:
        """The ``(name, tensor)`` pairs handed to vLLM's loader, in the engine's module order
        (so each fused group arrives together). A subclass may wrap it (e.g. to watch a load)."""
        order = {name: i for i, name in enumerate(self._slots)}
        return iter(sorted(state.items(), key=lambda kv: order[kv[0]]))

    def _engine_step(self) -> Any:
        """One step of the engine (vLLM's ``LLMEngine.step``), counted once it returns; before
        it, the safe point where an in-flight update waiting for this rollout is loaded."""
        if self._generating:
            self.safe_point(pause=True)
        out = self._step()
        self._steps += 1
        return out

    def _on_model(self, fn: Any, *args: Any) -> Any:
        """``fn(model, *args)`` in the engine's worker (this process: the engine is in-process)."""
        return self.llm.collective_rpc(_call_on_model, args=(fn, *args))[0]

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
    """Refuse, with :class:`~ftstate.core.errors.EngineRefused`, any setting that would run
    the engine in processes other than the actor's (see the module docstring for why)."""
    mp = os.environ.get(MULTIPROCESSING_ENV)
    if mp is not None and mp.strip() not in ("0", "false", "False"):
        raise EngineRefused(
            setting=MULTIPROCESSING_ENV, value=mp,
            why="vLLM's multiprocess engine outlives a SIGKILLed actor (EngineCore and Worker processes "
                "orphaned for minutes, with their /dev/shm segments) and a dead engine core leaves "
                "generate() hanging instead of failing; ftstate runs the engine in the actor's process: "
                f"leave {MULTIPROCESSING_ENV} unset or set it to 0")
    for key, allowed in _ONE_PROCESS.items():
        value = engine_kwargs.get(key, allowed)
        if value != allowed:
            raise EngineRefused(
                setting=f"engine_kwargs.{key}", value=value,
                why=f"it starts engine worker processes beside the actor's, which ftstate cannot watch or clean "
                    f"up; run one rollout per engine instance ({key}: {allowed}) and more rollout_workers")
    backend = engine_kwargs.get("distributed_executor_backend")
    if backend not in (None, "uni"):
        raise EngineRefused(setting="engine_kwargs.distributed_executor_backend", value=backend,
                            why="only the in-process executor ('uni') lives and dies with the actor")


def _call_on_model(worker: Any, fn: Any, *args: Any) -> Any:
    return fn(worker.model_runner.model, *args)


def _fused_groups(slots: Mapping[str, held.Slot]) -> Iterator[list[str]]:
    """The checkpoint names that share one engine parameter (q/k/v, gate/up), for each
    parameter holding more than one."""
    by_param: dict[tuple[str, str], list[str]] = {}
    for name, slot in slots.items():
        by_param.setdefault((slot.module, slot.attr), []).append(name)
    yield from (names for names in by_param.values() if len(names) > 1)
