"""What runs inside a worker process: the Ray actor around one user worker and its end of the
weight transport.

:class:`~ftstate.worker.host.WorkerHost` is the actor; it is made of one part per concept:

- :mod:`~ftstate.worker.host`: the shell: identity, heartbeats, the vigil, user calls;
- :mod:`~ftstate.worker.holdings`: what the worker holds (staged, committed, the engine's copy)
  and the proofs of it;
- :mod:`~ftstate.worker.transfers`: group versions and the transfers into and out of it;
- :mod:`~ftstate.worker.ranks`: a trainer rank's part of a sharded state;
- :mod:`~ftstate.worker.chaos`: real faults on request (tests, benchmarks, the demo);
- :mod:`~ftstate.worker.usercode`: the user's errors, marked with their method and frames.

It imports the core and the transport, never the controller: the controller reaches it only
through its actor calls.
"""
