"""Chaos nobody scripted: seeded random fault schedules against a live run on a multi-node
cluster, the run's invariants checked after every step, failing schedules shrunk and replayed.

``schedule`` (pure: drawing, JSON, shrinking), ``runner`` (a schedule on a real
``ray.cluster_utils`` cluster, with the invariants), ``__main__`` (``python -m tests.chaos``:
seeds, replay, shrink, soak). The fixed CI seeds run in ``tests/multinode/test_chaos.py``.
"""
