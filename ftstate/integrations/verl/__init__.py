"""ftstate inside verl 0.9.1: :class:`FTStateCheckpointEngine` (registered as checkpoint-engine backend
``"ftstate"`` on import, in every verl worker that builds an engine), :class:`FTStateCheckpointEngineManager`
(the driver's manager) and :class:`EngineSettings` (the ``engine_kwargs.ftstate`` block); configuration in
docs/integration.md ("verl").

Without verl installed, importing raises :class:`~ftstate.core.errors.IntegrationUnavailable` naming ``pip
install 'ftstate[verl]'`` (the extra adds uvicorn and fastapi, which verl imports undeclared)."""

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
