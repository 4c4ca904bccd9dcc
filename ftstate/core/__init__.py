"""The pure core: what the machines are and what they decide, with no I/O of their own.

Machine specs loaded from ``machines/*.yaml`` and validated (:mod:`~ftstate.core.spec`);
machines built from them that carry a deadline per state and spend budgets
(:mod:`~ftstate.core.machine`, :mod:`~ftstate.core.deadline`, :mod:`~ftstate.core.budget`);
the liveness rules that turn heartbeats into events (:mod:`~ftstate.core.liveness`); the
run's configuration (:mod:`~ftstate.core.config`); the error tree
(:mod:`~ftstate.core.errors`); the audit trail and its checker (:mod:`~ftstate.core.audit`,
:mod:`~ftstate.core.audit_check`); state diagrams (:mod:`~ftstate.core.diagram`); and the
base classes users subclass (:mod:`~ftstate.core.worker`).

Nothing here imports Ray, torch, a socket library or anything above it in the package
(the transport, the controller, the CLI): every transition is testable in a plain process
with an injected clock. ``tests/unit/test_layout.py`` fails if that stops being true.
"""
