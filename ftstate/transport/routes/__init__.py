"""The routes of a transfer: how the bytes of its buckets travel, one module per route.

:mod:`~ftstate.transport.routes.base` declares the interface (:class:`SendRoute`,
:class:`ReceiveRoute`) that the one transfer loop of :mod:`ftstate.transport.sync` drives.
The routes: :mod:`~ftstate.transport.routes.broadcast` (a collective operation per bucket: the
plain :meth:`~ftstate.transport.sync.Sender.broadcast`), and those of a same-host transfer
(:mod:`ftstate.transport.samehost`): :mod:`~ftstate.transport.routes.collective` (chunks point
to point), :mod:`~ftstate.transport.routes.slots` (shared-memory or device slots),
:mod:`~ftstate.transport.routes.nodecopy` (one node copy verified in place) and
:mod:`~ftstate.transport.routes.relay` (one copy per remote node). Their shared pieces:
:mod:`~ftstate.transport.routes.copying` (copy and hash a piece at a time) and
:mod:`~ftstate.transport.routes.signalling` (the per-bucket signals of a slot).
"""

from ftstate.transport.routes.base import Plan, ReceiveRoute, SendRoute, Transfer

__all__ = ["Plan", "ReceiveRoute", "SendRoute", "Transfer"]
