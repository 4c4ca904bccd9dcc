"""The simulation: the real controller against simulated members in virtual time, in one process, through the
same ClusterBackend interface as Ray (clock, costs, members, collectives, agentcalls, cluster, failure mixes,
scenarios, goodput). Imports the core and the controller, never Ray or torch."""
