"""What every part of a worker host may rely on from its shell (:class:`~ftstate.worker.host.WorkerHost`):
the member's identity, the user's worker, the one user lock and the progress counter.

Declared here, apart from the shell, so each part reads (and type-checks) on its own without
importing the host it is mixed into.
"""

from __future__ import annotations

import asyncio
from typing import Any


class HostPart:
    """The shell's attributes and methods the parts use; the shell sets and defines them."""

    member: str
    role: str
    run: str
    user: Any
    backend: str
    bucket_bytes: int
    busy: bool
    progress: int
    weights_version: int
    checksum: str | None

    def _lock(self) -> asyncio.Lock:
        """The user lock: one user call, load or read of the user's weights at a time."""
        raise NotImplementedError

    def _tick(self) -> None:
        """One unit of progress made (a bucket, a call), for the watchdog."""
        raise NotImplementedError

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a user method, its errors marked with the method and the user's frames."""
        raise NotImplementedError
