"""The controller: the Ray side of a run, driving the core's machines from real events.

:mod:`~ftstate.controller.runtime` is what a trainer loop embeds (``await rt.sync()``); it
composes the parts below, which share one :class:`~ftstate.controller.membership.Membership`
(who holds which rank, in which state, with which versions) instead of reaching into each
other:

- :mod:`~ftstate.controller.launcher` starts and kills worker actors (:mod:`ftstate.worker`)
  through the cluster's backend (:mod:`~ftstate.controller.backend`; Ray's is the adapter in
  :mod:`ftstate.controller.ray`: placement groups per role, spares off the nodes they cover);
- :mod:`~ftstate.controller.formation` forms numbered group versions on the rendezvous store;
- :mod:`~ftstate.controller.sync` runs one weight sync (two-phase commit);
- :mod:`~ftstate.controller.routing` sends user calls only to workers serving the current
  weights;
- :mod:`~ftstate.controller.calls` is every actor call (deaths become events);
  :mod:`~ftstate.controller.watchdog` turns heartbeats into liveness events;
- :mod:`~ftstate.controller.startup` checks what the runtime is given and forms the first
  group version; :mod:`~ftstate.controller.losses` decides what a member's loss does (fail
  the run, or recover it);
- :mod:`~ftstate.controller.failover` replaces lost members (a lost node's in one round),
  promoting spares from :mod:`~ftstate.controller.spares` (the standby pool) and bringing each
  newcomer to the current weights with :mod:`~ftstate.controller.resync`;
- :mod:`~ftstate.controller.maintenance` watches for maintenance and preemption notices,
  :mod:`~ftstate.controller.notices` turns them into drains, and
  :mod:`~ftstate.controller.drain` moves a node's members off it before it goes;
- :mod:`~ftstate.controller.chaos` injects real faults (tests, benchmarks, the demo).

It imports the core and the transport; neither imports it. Only its Ray adapter names the
worker's actor class; everything else reaches a worker through its calls.
"""
