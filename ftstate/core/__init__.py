"""The pure core, importable in any process: specs, machines, deadlines, budgets, liveness, config, errors,
the audit trail and its checker, diagrams and the user base classes. Nothing here imports Ray, torch, sockets
or the layers above (``tests/unit/test_layout.py`` holds it)."""
