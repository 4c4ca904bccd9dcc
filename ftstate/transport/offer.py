"""The offer: what a writer tells its readers after the manifest, and how each receiver gets the buckets."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgpack

from ftstate.core.errors import ManifestError, StaleGroupVersion
from ftstate.transport.manifest import MAX_BUCKET_SIZE, WIRE_FORMAT, short
from ftstate.transport.nodecopy import is_copy

#: Tags of the buckets sent point to point to collective ranks (the peer stream's messages
#: use small sequence numbers, so the two never meet): the n-th chunk of the transfer is
#: tagged ``NET_TAG + n``.
NET_TAG = 1 << 20


@dataclass(frozen=True)
class Offer:
    """What the sender tells every receiver after the manifest: how each one gets the buckets."""

    group: str
    group_version: int
    pid: int
    endpoint: str
    segments: tuple[str, ...]
    fresh: bool
    shm: tuple[int, ...]
    collective: tuple[int, ...]
    fallback: str | None = None
    #: ``(relay rank, its peers' ranks)``: the relay gets the buckets over the collective and
    #: writes them into its own node's shared memory for its peers (see :mod:`ftstate.transport.routes.relay`).
    relays: tuple[tuple[int, tuple[int, ...]], ...] = ()
    #: ``shared_memory: require``: a relay that cannot make its segments fails the transfer.
    require: bool = False
    #: The bytes of one point-to-point message to a collective rank: each bucket goes as
    #: ``ceil(nbytes / chunk)`` messages, tagged :data:`NET_TAG` + their index in the transfer.
    chunk: int = 0
    #: One handle per slot when the slots' data is in device memory (:mod:`~ftstate.transport.cudaipc`;
    #: ``segments`` are then their headers only); empty for slots in ``/dev/shm``.
    handles: tuple[bytes, ...] = ()
    #: ``staging: node``: the node copy the readers in ``shm`` verify in place (no slots, no
    #: private staging; :mod:`ftstate.transport.nodecopy`), and the pid of its owner.
    node_copy: str = ""
    owner: int = 0
    #: the writer keeps the previous copy as the next one's (``node_copy_spare``): a reader
    #: keeps its mapping of each file for the next time it is used
    recycled: bool = False


def encode_offer(o: Offer) -> bytes:
    return msgpack.packb(
        {"kind": "offer", "format": WIRE_FORMAT, "group": o.group, "group_version": o.group_version,
         "pid": o.pid, "endpoint": o.endpoint, "segments": list(o.segments), "fresh": o.fresh,
         "shm": list(o.shm), "collective": list(o.collective), "fallback": o.fallback,
         "relays": [[r, list(peers)] for r, peers in o.relays], "require": o.require, "chunk": o.chunk,
         "handles": list(o.handles), "node_copy": o.node_copy, "owner": o.owner,
         "recycled": o.recycled},
        use_bin_type=True,
    )


#: Caps on an offer's fields (a hostile or broken peer must not make its decoding the problem).
MAX_RANK = 1 << 16
MAX_PID = 1 << 22  # Linux's PID_MAX_LIMIT
MAX_HANDLE_BYTES = 4096
_ENDPOINT = re.compile(r"tcp://127\.0\.0\.1:([0-9]{1,5})")


def decode_offer(payload: bytes, *, group: str, group_version: int) -> Offer:
    """Validate an offer; :class:`ManifestError` naming the field, :class:`StaleGroupVersion`."""
    try:
        d = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:
        raise ManifestError(f"malformed offer: not msgpack: {short(str(exc))}") from exc
    if not isinstance(d, dict) or d.get("kind") != "offer":
        raise ManifestError("malformed offer: field 'kind': expected 'offer'", field="kind")

    def bad(name: str, value: Any, expected: str) -> ManifestError:
        return ManifestError(f"malformed offer: field {name!r}: expected {expected}, got {short(value)}", field=name)

    def need(name: str, kind: type | tuple[type, ...]) -> Any:
        value = d.get(name)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise bad(name, value, getattr(kind, "__name__", str(kind)))
        return value

    def ranks(name: str, items: Any, cap: int = MAX_RANK) -> tuple[int, ...]:
        if not isinstance(items, list) or len(items) > cap \
                or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_RANK for x in items):
            raise bad(name, items, f"a list of at most {cap} ranks in [0, {MAX_RANK})")
        return tuple(items)

    if need("format", int) != WIRE_FORMAT:
        raise bad("format", d["format"], str(WIRE_FORMAT))
    if need("group", str) != group:
        raise bad("group", d["group"], repr(group))
    gv = need("group_version", int)
    if gv < group_version:
        raise StaleGroupVersion(group, got=gv, current=group_version, peer="the sender's offer")
    if gv > group_version:
        raise ManifestError(f"malformed offer: field 'group_version': {short(gv)} is newer than {group_version}",
                            field="group_version")
    pid = need("pid", int)
    if not 1 <= pid <= MAX_PID:
        raise bad("pid", pid, f"a pid in [1, {MAX_PID}]")
    endpoint = need("endpoint", str)
    match = _ENDPOINT.fullmatch(endpoint)
    if endpoint and (match is None or not 0 < int(match.group(1)) < 65536):
        raise bad("endpoint", endpoint, "'' or tcp://127.0.0.1:<port>")
    segments = need("segments", list)
    if len(segments) > 2 or not all(isinstance(x, str) and 0 < len(x) <= 255 for x in segments):
        raise bad("segments", segments, "at most two segment names")
    shm_ranks = ranks("shm", d.get("shm"))
    collective = ranks("collective", d.get("collective"))
    fallback = d.get("fallback")
    if fallback is not None and not (isinstance(fallback, str) and len(fallback) <= 4096):
        raise bad("fallback", fallback, "null or a reason")
    chunk = need("chunk", int)
    if not 0 <= chunk <= MAX_BUCKET_SIZE:
        raise bad("chunk", chunk, f"a number of bytes in [0, {MAX_BUCKET_SIZE}]")
    relays = []
    raw_relays = need("relays", list)
    if len(raw_relays) > MAX_RANK:
        raise bad("relays", raw_relays, f"at most {MAX_RANK} relays")
    for item in raw_relays:
        if not (isinstance(item, list) and len(item) == 2):
            raise bad("relays", item, "[relay rank, [peer ranks]]")
        relays.append((ranks("relays", [item[0]], 1)[0], ranks("relays", item[1])))
    handles = need("handles", list)
    if not all(isinstance(h, bytes) and len(h) <= MAX_HANDLE_BYTES for h in handles) \
            or len(handles) not in (0, len(segments)):
        raise ManifestError(f"malformed offer: field 'handles': expected none or one handle (bytes) per segment "
                            f"({len(segments)}), got {short(handles)}", field="handles")
    node_copy = need("node_copy", str)
    owner = need("owner", int)
    if node_copy and (not is_copy(node_copy) or not 1 <= owner <= MAX_PID or segments):
        raise bad("node_copy", node_copy, f"'' or a node copy's name, with its owner's pid in [1, {MAX_PID}] "
                                          "and no slots")
    return Offer(group, gv, pid, endpoint, tuple(segments), need("fresh", bool),
                 shm_ranks, collective, fallback, tuple(relays), need("require", bool), chunk,
                 tuple(handles), node_copy, owner, need("recycled", bool))


__all__ = ["MAX_HANDLE_BYTES", "MAX_PID", "MAX_RANK", "NET_TAG", "Offer", "decode_offer", "encode_offer"]
