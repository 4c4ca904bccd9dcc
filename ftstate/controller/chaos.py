"""Chaos, from the controller: real faults on a running runtime (SIGKILL, SIGSTOP, a corrupted bucket), now or
after some progress so they land mid-transfer; each is a ``chaos`` audit record."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

from ftstate.controller.membership import Member, Membership
from ftstate.core.audit import AuditTrail
from ftstate.core.errors import UsageError
from ftstate.core.protocol import ChaosCorrupt, ChaosHang, ChaosKill


class Chaos:
    """Fault injection on a running runtime. A worker is named by role and index (``("rollout", 1)``; trainer
    rank 1 is ``("trainer", 1)``) or by member name; ``after_progress`` delays a kill until that many more
    units of progress, landing it mid-transfer."""

    def __init__(self, membership: Membership, audit: AuditTrail) -> None:
        self.membership = membership
        self.audit = audit
        #: (loop time, member, fault) of every injected fault.
        self.injected: list[tuple[float, str, str]] = []
        #: pids stopped by :meth:`hang`, released by :meth:`release` (and at close).
        self.hung: list[int | None] = []

    def _member(self, role: str, rank: int | None) -> Member:
        if rank is None:
            return self.membership.get(role)
        live = self.membership.live(role)
        by_name = {m.name: m for m in live}
        name = f"{role}-{rank}"
        if name in by_name:
            return by_name[name]
        if rank < len(live):
            return live[rank]
        raise UsageError(f"chaos: no live {role} with index {rank}; live: {', '.join(by_name) or 'none'}")

    def _note(self, m: Member, fault: str) -> None:
        self.injected.append((asyncio.get_running_loop().time(), m.name, fault))
        self.audit.record("chaos", member=m.name, fault=fault, pid=m.pid)

    async def kill(self, role: str, rank: int | None = None, *, after_progress: int | None = None) -> str:
        """SIGKILL the worker's process (now, or after ``after_progress`` more units of progress)."""
        m = self._member(role, rank)
        if after_progress is not None:
            await m.handle.chaos_kill.remote(ChaosKill(after_progress))
            self._note(m, f"kill after {after_progress} progress")
        else:
            self._note(m, "kill")
            if m.pid and m.node in ("127.0.0.1", "localhost"):
                os.kill(m.pid, signal.SIGKILL)
            else:
                m.handle.chaos_kill.remote(ChaosKill())
        return m.name

    async def hang(self, role: str, rank: int | None = None, *, after_progress: int | None = None) -> str:
        """Stop the worker's process (SIGSTOP): alive, no progress, no answers (now, or after
        ``after_progress``)."""
        m = self._member(role, rank)
        if after_progress is not None:
            await m.handle.chaos_hang.remote(ChaosHang(after_progress))
            self._note(m, f"hang after {after_progress} progress")
        else:
            self._note(m, "hang")
            m.handle.chaos_hang.remote(ChaosHang())
        self.hung.append(m.pid)
        return m.name

    def release(self) -> None:
        """SIGKILL every process this chaos hung (their actors are dead to the run already)."""
        for pid in self.hung:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                with contextlib.suppress(ProcessLookupError, TypeError):
                    os.kill(pid, sig)
        self.hung.clear()

    async def corrupt(self, role: str, rank: int | None = None) -> str:
        """Flip one byte of the next bucket the worker receives."""
        m = self._member(role, rank)
        self._note(m, "corrupt")
        await m.handle.chaos_corrupt_next_bucket.remote(ChaosCorrupt())
        return m.name
