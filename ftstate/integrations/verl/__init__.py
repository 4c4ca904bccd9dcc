"""ftstate inside verl: a checkpoint-engine backend and a manager that verl loads by name.

verl 0.9.1 has two hooks for weight synchronisation, and this package fills both::

    actor_rollout_ref:
      rollout:
        checkpoint_manager_class: ftstate.integrations.verl.FTStateCheckpointEngineManager
        checkpoint_engine:
          backend: ftstate
          custom_backend_module: ftstate.integrations.verl
          engine_kwargs: {ftstate: {init_timeout_s: 120, commit_mode: stream}}

* :class:`FTStateCheckpointEngine` (``engine``), registered as backend ``"ftstate"`` in verl's
  ``CheckpointEngineRegistry`` when this package is imported (verl imports
  ``custom_backend_module`` in every worker that builds an engine): ftstate's transport in
  verl's engine protocol — bounded init naming who never joined, checksummed buckets,
  ``stream``/``staged`` commit.
* :class:`FTStateCheckpointEngineManager` (``manager``): verl's ``CheckpointEngineManager``
  with ftstate's machines around each update — controller-side deadlines on the rebuild and
  the transfer, a dead rollout replica removed and the update completed for the others,
  ``max_failovers``, the audit trail.
* :class:`EngineSettings` (``settings``): the ``engine_kwargs.ftstate`` block, checked.

Importing this package without verl installed raises
:class:`~ftstate.core.errors.IntegrationUnavailable` naming ``pip install 'ftstate[verl]'``
(the ``verl`` extra: verl itself plus uvicorn and fastapi, which ``verl.checkpoint_engine``
imports without declaring them). Nothing else in ftstate imports this package.
"""

from __future__ import annotations

from ftstate.core.errors import IntegrationUnavailable

try:
    import verl.checkpoint_engine  # noqa: F401  (registers verl's own backends first)
except ImportError as exc:
    raise IntegrationUnavailable(framework="verl", extra="verl", cause=str(exc)) from None

from ftstate.integrations.verl.engine import BACKEND, FTStateCheckpointEngine
from ftstate.integrations.verl.manager import FTStateCheckpointEngineManager
from ftstate.integrations.verl.settings import EngineSettings

__all__ = ["BACKEND", "EngineSettings", "FTStateCheckpointEngine", "FTStateCheckpointEngineManager"]
