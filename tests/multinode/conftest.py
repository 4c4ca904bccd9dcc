"""One multi-node Ray cluster (3 raylets on 127.0.0.1) for the whole tests/multinode session.

Run in its own pytest session (``pytest tests/multinode``; ``make test`` does): a driver
joins one Ray cluster only, and tests/integration starts a plain local one. The nodes are
``a`` (the head, where the driver is), ``b`` and ``c``, each with the label
``ftstate-test-node: <name>`` and the custom resource ``node_<name>``. A test that loses a
node (``multinode_cluster.kill("b")``) brings it back with ``multinode_cluster.add("b")``
(a fresh node id), or uses the ``restore_nodes`` fixture, which does so after the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multinode.harness import MultiNode, start_cluster, stop_cluster

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a session that also collected other tests (a bare ``pytest``), leave these out, with
    a note: their cluster cannot share a driver with tests/integration's local one."""
    ours = [i for i in items if HERE in Path(str(i.path)).resolve().parents]
    if not ours or len(ours) == len(items):
        return
    config.hook.pytest_deselected(items=ours)
    items[:] = [i for i in items if i not in ours]
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"tests/multinode: {len(ours)} tests left out of this session; "
                            "run them in their own: pytest tests/multinode (make test does)")


@pytest.fixture(scope="session")
def multinode_cluster():
    mn = start_cluster()
    try:
        yield mn
    finally:
        stop_cluster(mn)


@pytest.fixture
def restore_nodes(multinode_cluster: MultiNode):
    """Brings back, after the test, every node the test lost (same name, label and resource)."""
    names = list(multinode_cluster.nodes)
    yield multinode_cluster
    for name in names:
        if name not in multinode_cluster.alive():
            multinode_cluster.add(name)  # waits for it; not wait_for_nodes(), which would also wait
            # for Ray's health check to declare the lost node dead (~15 s)
