"""The controller's Ray adapter: the one place the controller meets Ray.

- :mod:`~ftstate.controller.ray.backend`: :class:`~ftstate.controller.ray.backend.RayBackend`,
  the :class:`~ftstate.controller.backend.ClusterBackend` that starts worker hosts
  (:mod:`ftstate.worker`) as Ray actors, calls them and reports their deaths, with each node's
  liveness agent;
- :mod:`~ftstate.controller.ray.cluster`: joining or starting the Ray cluster;
- :mod:`~ftstate.controller.ray.placement`: placement groups as resource pools.
"""
