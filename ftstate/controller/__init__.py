"""The controller, run in the driver: drives the core's machines from real events. The runtime composes
launcher, formation, sync, routing, calls, watchdog, failover, maintenance and drain, which share one
Membership instead of reaching into each other. Only its Ray adapter (:mod:`ftstate.controller.ray`) names
Ray's actor class; neither core nor transport imports it."""
