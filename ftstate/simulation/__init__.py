"""The simulation: the real controller against simulated members, in virtual time.

The controller reaches its cluster through one interface
(:class:`~ftstate.controller.backend.ClusterBackend`); this package implements it with
members that answer after modelled delays, on nodes that can be lost, so that the very code
that drives Ray actors drives 10,000 simulated ones on one core, in seconds:

- :mod:`~ftstate.simulation.clock`: an event loop whose clock jumps to the next timer
  instead of sleeping (virtual time: deterministic, as fast as the controller's own CPU);
- :mod:`~ftstate.simulation.costs`: what each modelled step costs (from this project's own
  measurements, ``docs/benchmarks.md``);
- :mod:`~ftstate.simulation.members`: a simulated worker host (the calls the controller makes
  of a :class:`~ftstate.worker.host.WorkerHost`, answered after their modelled cost), and a
  node's simulated watcher and liveness agent;
- :mod:`~ftstate.simulation.collectives`: the collectives members take part in and the
  rendezvous store they wait in;
- :mod:`~ftstate.simulation.agentcalls`: a node agent's batch of member calls, the stream the
  controller reads;
- :mod:`~ftstate.simulation.cluster`: the simulated cluster (nodes, pools, the rendezvous
  store, faults: deaths, hangs, node losses);
- :mod:`~ftstate.simulation.mix`: failure mixes (the Llama 3 table) and the schedules drawn from them;
- :mod:`~ftstate.simulation.scenario`: a run of the real :class:`~ftstate.controller.runtime.Runtime`
  on the simulated cluster, with a fault schedule;
- :mod:`~ftstate.simulation.goodput`: the fraction of time a job makes progress, ftstate
  against restart-from-checkpoint (``ftstate simulate``).

It imports the core and the controller, never Ray or torch.
"""
