"""The controller: the Ray side of a run, driving the core's machines from real events.

:mod:`~ftstate.controller.runtime` is what a trainer loop embeds (``await rt.sync()``); it
composes the parts below, which share one :class:`~ftstate.controller.membership.Membership`
(who holds which rank, in which state, with which versions) instead of reaching into each
other: :mod:`~ftstate.controller.sync` (one weight sync, two-phase commit),
:mod:`~ftstate.controller.failover` (replacing a lost member), :mod:`~ftstate.controller.watchdog`
(heartbeats into liveness events), :mod:`~ftstate.controller.chaos` (fault injection),
:mod:`~ftstate.controller.calls` (every actor call, and deaths as events),
:mod:`~ftstate.controller.host` (the actor that hosts a user worker),
:mod:`~ftstate.controller.placement` and :mod:`~ftstate.controller.cluster` (where actors run).
It imports the core and the transport; neither imports it.
"""
