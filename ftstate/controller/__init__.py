"""The controller, run in the driver: drives the core's machines from real events. The runtime composes
startup, launcher, formation, sync, routing, calls, watchdog, losses, failover (with its spares and
resync), maintenance and drain, which share one Membership instead of reaching into each other. Only its
Ray adapter (:mod:`ftstate.controller.ray`) names Ray's actor class; neither core nor transport imports it."""
