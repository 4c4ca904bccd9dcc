"""The rollout of ``ftstate demo --engine vllm``, in the demo's rollout actors (and the reference run's
driver): :class:`~ftstate.integrations.vllm.VLLMRollout` plus seeded sampling per (run, step, prompt), so a
re-dealt prompt samples the same answer, and the "killed mid-update" fault armed inside vLLM's own loader."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ftstate.cli.demo import llm
from ftstate.integrations.vllm import VLLMRollout

#: Engine arguments for the demo's tiny model: a small KV cache, no graph capture.
ENGINE_KWARGS = {"enforce_eager": True, "max_model_len": llm.MAX_MODEL_LEN, "kv_cache_memory_bytes": 16 << 20}
#: One sample: (prompt_id, answer, reward, spans).
Sample = tuple[int, list[int], float, list[list[int]]]


class EngineRollout(VLLMRollout):
    """model: the policy's folder; seed: the run's seed (sampling seeds derive from it); answer_tokens: the
    answers' length."""

    def __init__(self, model: str, seed: int, answer_tokens: int = llm.ANSWER_TOKENS) -> None:
        # the reference's replay: (state, version) to load once every answer has that many tokens
        self._replay: dict[int, tuple[Mapping[str, Any], int]] = {}
        self._tokens = 0
        super().__init__(model, dtype="bfloat16", seed=seed, engine_kwargs=ENGINE_KWARGS)
        self.run_seed = seed
        self.answer_tokens = answer_tokens
        self._kill_after: int | None = None
        self.loaded_at = 0.0

    def sample(self, step: int, shard: Sequence[tuple[int, Sequence[int]]]) -> list[Sample]:
        """Answer and score one shard: ``[(prompt_id, answer, reward, spans)]`` in shard order, through the
        engine steps whose safe points load an in-flight version; ``spans``: ``[version, first, end]`` per run
        of the answer's tokens, as the engine labelled them."""
        self._tokens = 0
        out = self.generate([tokens for _, tokens in shard], max_tokens=self.answer_tokens, temperature=1.0,
                            ignore_eos=True, seeds=[llm.sample_seed(self.run_seed, step, pid) for pid, _ in shard])
        return [(pid, a["token_ids"], llm.reward(a["token_ids"]), [list(s) for s in a["weights_spans"]])
                for (pid, _), a in zip(shard, out, strict=True)]

    def sample_replaying(self, step: int, shard: Sequence[tuple[int, Sequence[int]]],
                         swaps: Mapping[int, tuple[Mapping[str, Any], int]]) -> list[Sample]:
        """:meth:`sample`, loading ``swaps[k]`` (state, version) once every answer has ``k`` tokens: the
        reference's replay of a run's spans (the shard's answers grow one token per engine step, together)."""
        self._replay = dict(swaps)
        try:
            return self.sample(step, shard)
        finally:
            self._replay = {}

    def load_weights(self, state: Mapping[str, Any], version: int) -> None:
        super().load_weights(state, version)
        self.loaded_at = time.time()

    def proof(self) -> dict[str, Any]:
        """The held weights' checksum, the version in effect and when (wall clock) it was loaded."""
        return {"held": self.held_checksum(), "version": self.weights_version, "loaded_at": self.loaded_at}

    def _engine_step(self) -> Any:
        swap = self._replay.pop(self._tokens, None)
        if swap is not None:
            self.load_weights(*swap)
        self._tokens += 1
        return super()._engine_step()

    def kill_during_next_load(self, after: int) -> int:
        """SIGKILL this process once ``after`` tensors of the next load reached vLLM's loader;
        returns this process's pid (what the fault kills)."""
        self._kill_after = after
        return os.getpid()

    def _weights(self, state: Mapping[str, Any]) -> Iterable[tuple[str, Any]]:
        pairs = super()._weights(state)
        if self._kill_after is None:
            return pairs
        after, self._kill_after = self._kill_after, None

        def killing() -> Iterable[tuple[str, Any]]:
            for i, pair in enumerate(pairs):
                if i == after:
                    os.kill(os.getpid(), signal.SIGKILL)
                yield pair

        return killing()
