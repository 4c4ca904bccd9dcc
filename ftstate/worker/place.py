"""Where a worker process runs: its node's address and Ray node id, the address its transport
binds, and the size of a node copy read on its node.
"""

from __future__ import annotations

import socket

from ftstate.core.protocol import NodeCopySize


def where() -> tuple[str, str | None]:
    """This process's node address and Ray node id (outside Ray: the host name, no id)."""
    try:
        import ray

        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray (unit use): the host name will do
        return socket.gethostname(), None


def device_host(store_host: str) -> str:
    node, node_id = where()
    return node if node_id is not None else store_host  # outside Ray: where the store is


def node_copy_size(name: str | None, *, recycled: bool) -> NodeCopySize | None:
    """For the records: the bytes of node copy ``name`` (read on its node: the controller may run
    on another) and whether it was the writer's spare rewritten."""
    if not name:
        return None
    from ftstate.transport import nodecopy

    return NodeCopySize(nbytes=nodecopy.segment_bytes(name), recycled=recycled)
