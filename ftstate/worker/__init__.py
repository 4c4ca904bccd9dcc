"""What runs inside a worker process: :class:`~ftstate.worker.host.WorkerHost`, the actor around one user
worker, made of one part per concept (host, holdings, transfers, ranks, chaos, usercode). Imports the core and
the transport, never the controller."""
