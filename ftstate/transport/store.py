"""The controller's key-value store and the versioned rendezvous built on it."""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgpack

from ftstate.core.errors import ManifestError, RendezvousTimeout, StaleGroupVersion, TransportError
from ftstate.transport import auth
from ftstate.transport.manifest import short

if TYPE_CHECKING:
    from torch.distributed import Store


@dataclass(frozen=True)
class StoreAddress:
    """Where members reach the controller's store."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, value: StoreAddress | str | tuple[str, int]) -> StoreAddress:
        if isinstance(value, StoreAddress):
            return value
        if isinstance(value, tuple):
            return cls(str(value[0]), int(value[1]))
        host, sep, port = str(value).rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"store address must be 'host:port', got {value!r}")
        return cls(host, int(port))


#: Compare-and-sets spent at most replacing a value planted by someone outside the run.
MAX_CAS_TRIES = 16

#: Versions a jump of ``current_version`` releases at most (the controller raises it one or a
#: few at a time; a larger jump has nobody waiting in the versions it skips).
MAX_RELEASED = 64

#: Value written into the ``joined`` keys of ranks that never arrived in a superseded
#: version, which wakes the members waiting there (see :func:`raise_current_version`).
FENCED = b"fenced"


#: Bounds on what a store value may hold (anyone who reached the store could have planted it).
MAX_VERSION = (1 << 63) - 1
MAX_WORLD_SIZE = 1 << 16
MAX_VALUE_BYTES = 64 * 1024


def _malformed(key: str, raw: object, expected: str) -> ManifestError:
    return ManifestError(f"store value {key!r}: expected {expected}, got {short(raw)}", field=key,
                         peer=f"store key {key}")


def parse_int(key: str, raw: bytes, *, hi: int = MAX_VERSION) -> int:
    """A decimal integer in [0, ``hi``] read from the store; anything else: ManifestError naming the key."""
    if not isinstance(raw, (bytes, bytearray)) or not 0 < len(raw) <= 20 or not bytes(raw).isdigit():
        raise _malformed(key, raw, f"a decimal integer in [0, {hi}]")
    value = int(raw)
    if value > hi:
        raise _malformed(key, raw, f"a decimal integer in [0, {hi}]")
    return value


def parse_registration(key: str, raw: bytes) -> dict[str, object]:
    """A ``joined`` value (msgpack: pid, host, t), checked; anything else: ManifestError naming the key."""
    if len(raw) > MAX_VALUE_BYTES:
        raise _malformed(key, raw[:40], f"at most {MAX_VALUE_BYTES} bytes")
    try:
        value = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:
        raise _malformed(key, raw[:40], "a msgpack map") from exc
    if not isinstance(value, dict):
        raise _malformed(key, value, "a msgpack map")
    return value


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def check_group_name(group: str) -> None:
    if not isinstance(group, str) or not group or "/" in group:
        raise ValueError(f"group name must be a non-empty string without '/', got {group!r}")


def version_prefix(group: str, version: int) -> str:
    return f"{group}/v{version}"


def _current_key(group: str) -> str:
    return f"{group}/current_version"


class StoreServer:
    """The run's TCPStore, hosted by the controller; members connect as clients."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, timeout_s: float = 30.0) -> None:
        from torch.distributed import TCPStore

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(1024)
            bound_port = sock.getsockname()[1]
        except BaseException:
            sock.close()
            raise
        self.address = StoreAddress(host, bound_port)
        # TCPStore takes ownership of the descriptor (it closes it when destroyed).
        fd = sock.detach()
        try:
            self._store: Store | None = TCPStore(
                host,
                bound_port,
                is_master=True,
                wait_for_workers=False,
                timeout=_delta(timeout_s),
                master_listen_fd=fd,
                use_libuv=True,
            )
        except BaseException:
            os.close(fd)
            raise

    @property
    def store(self) -> Store:
        if self._store is None:
            raise TransportError(f"store server {self.address} is closed")
        return self._store

    def fence(self, group: str, version: int) -> int:
        """Publish ``version`` as current (never lowering it), fencing every older one; returns the current one."""
        return raise_current_version(self.store, group, version)

    def current_version(self, group: str) -> int | None:
        """The group's current version, or ``None`` if no version was formed yet."""
        return read_current_version(self.store, group)

    def arrived(self, group: str, version: int) -> list[int]:
        """Ranks that registered for version ``version`` of ``group`` so far."""
        return roster(self.store, group, version)

    def wait_joined(self, group: str, version: int, world_size: int, timeout_s: float) -> None:
        """Return once all ``world_size`` ranks registered, else RendezvousTimeout naming the
        missing ones after ``timeout_s`` (``init_timeout_s``)."""
        wait_for_ranks(self.store, group, version, world_size, timeout_s, member="controller")

    def close(self) -> None:
        self._store = None

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect_store(address: StoreAddress | str | tuple[str, int], timeout_s: float) -> Store:
    """A client of the controller's store. ``timeout_s`` bounds the connection and is the
    default bound of the client's later operations."""
    from torch.distributed import DistError, TCPStore

    addr = StoreAddress.parse(address)
    try:
        # A plain connect first: a store that is gone fails here at once, instead of after
        # TCPStore's retries with backoff (several times ``timeout_s``).
        socket.create_connection((addr.host, addr.port), timeout=max(timeout_s, 0.001)).close()
        return TCPStore(addr.host, addr.port, is_master=False, timeout=_delta(timeout_s), use_libuv=True)
    except (DistError, RuntimeError, OSError) as exc:
        raise RendezvousTimeout(
            f"connecting to the controller's store at {addr}",
            key="init_timeout_s",
            seconds=timeout_s,
            missing=[f"store {addr}"],
        ) from exc


def signed(key: str, payload: bytes) -> bytes:
    """What ftstate writes under ``key``: the payload, tagged for the key when the run
    authenticates (:mod:`ftstate.transport.auth`; the key names the group, version and rank)."""
    return auth.sign(f"store {key}", "", 0, "run", payload)


def opened(key: str, raw: bytes, *, record: bool = True) -> bytes | None:
    """The payload of a value read under ``key``, or None when its tag does not verify (a value
    planted by someone outside the run: recorded as forged unless ``record`` is false, e.g. a
    value already recorded, then treated as absent)."""
    return auth.verify(f"store {key}", "", 0, "run", raw, record_as="store", record=record, key=key)


def _version_of(key: str, raw: bytes) -> int | None:
    payload = opened(key, raw)
    return None if payload is None else parse_int(key, payload)


# The highest current version seen per (run, store, group): it only rises, so a lower one is a
# replay its tag cannot reveal.
_HIGHEST: dict[tuple[int, str, str, int, str], int] = {}
_HIGHEST_LOCK = threading.Lock()


def _seen(store: Store, group: str) -> tuple[int, str, str, int, str] | None:
    key = auth.current()
    if key is None:
        return None  # unauthenticated: nothing here tells a member's write from an outsider's
    return (auth.installs(), key.run, str(getattr(store, "host", "")), int(getattr(store, "port", 0) or 0), group)


def _not_rolled_back(store: Store, group: str, key: str, value: int | None) -> int | None:
    """``value`` read under ``key``, or the highest this process saw when ``value`` is lower
    (recorded as a replayed store value)."""
    where = _seen(store, group)
    if where is None or value is None:
        return value
    with _HIGHEST_LOCK:
        highest = _HIGHEST.get(where, 0)
        if value >= highest:
            _HIGHEST[where] = value
            return value
    auth.record_forged("store", "run", key=key, problem=f"replayed: version {value} is below version {highest}, "
                       "already seen current here")
    return highest


def read_current_version(store: Store, group: str) -> int | None:
    """The group's current version; None when unset or forged. A value below one already seen
    is a replay: recorded, and the higher one returned so the fence holds."""
    key = _current_key(group)
    if not store.check([key]):
        return None
    return _not_rolled_back(store, group, key, _version_of(key, store.get(key)))


def raise_current_version(store: Store, group: str, version: int) -> int:
    """Atomically raise the group's current version to ``version``; returns the result
    (greater than ``version`` when the group already moved on). A forged value there is
    replaced (at most :data:`MAX_CAS_TRIES` compare-and-sets, else TransportError)."""
    check_group_name(group)
    key = _current_key(group)
    want = signed(key, str(version).encode())
    current = store.compare_set(key, "", want)
    before = None
    tries = 0
    while current != want:
        value = _not_rolled_back(store, group, key, _version_of(key, current))
        if value is not None and value >= version:
            return value
        if value is not None:
            before = value
        tries += 1
        if tries > MAX_CAS_TRIES:
            raise TransportError(f"store key {key!r}: could not raise it to {version} in {MAX_CAS_TRIES} "
                                 "compare-and-sets (someone keeps rewriting it)")
        current = store.compare_set(key, current, want)
    _not_rolled_back(store, group, key, version)
    if before is not None and before < version:
        # only the versions just superseded (a jump of more than MAX_RELEASED releases the last ones only)
        for superseded in range(max(before, version - MAX_RELEASED), version):
            _release_waiters(store, group, superseded)
    return version


def _release_waiters(store: Store, group: str, version: int) -> None:
    """Mark every rank that never arrived in a superseded version FENCED, so its waiters find
    it stale now instead of waiting out init_timeout_s."""
    prefix = version_prefix(group, version)
    size_key = f"{prefix}/world_size"
    if not store.check([size_key]):
        return  # nobody registered in that version: nobody waits
    payload = opened(size_key, store.get(size_key))
    if payload is None:
        return  # planted: no member registered a size there
    for rank in range(parse_int(size_key, payload, hi=MAX_WORLD_SIZE)):
        key = f"{prefix}/joined/{rank}"
        store.compare_set(key, "", signed(key, FENCED))


def roster(store: Store, group: str, version: int) -> list[int]:
    """Ranks that registered for the version (entries not written by a member: recorded, left out)."""
    key = f"{version_prefix(group, version)}/roster"
    if not store.check([key]):
        return []
    raw = store.get(key)
    entries = raw.split(b",")
    if len(entries) > 4 * MAX_WORLD_SIZE + 1:
        raise _malformed(key, raw[:40], f"at most {MAX_WORLD_SIZE} ranks")
    ranks = set()
    for entry in filter(None, entries):
        rank, _, mac = entry.partition(b":")
        if auth.enabled():
            try:
                tag = bytes.fromhex(mac.decode("ascii"))
            except (UnicodeDecodeError, ValueError):
                tag = b""
            if auth.verify(f"store {key}", "", 0, "run", rank + tag, record_as="store", key=key) is None:
                continue  # recorded
        ranks.add(parse_int(key, rank, hi=MAX_WORLD_SIZE))
    return sorted(ranks)


def _roster_entry(key: str, rank: int) -> str:
    if not auth.enabled():
        return f"{rank},"
    payload = str(rank).encode()
    return f"{rank}:{auth.tag(f'store {key}', '', 0, 'run', payload).hex()},"


def _forged_joined(store: Store, keys: list[str]) -> list[str]:
    """The ``joined`` keys among ``keys`` whose value no member wrote (recorded as forged)."""
    if not auth.enabled():
        return []
    return [k for k in keys if store.check([k]) and opened(k, store.get(k)) is None]


def wait_for_ranks(
    store: Store, group: str, version: int, world_size: int, timeout_s: float, *, member: str
) -> None:
    """Wait up to ``timeout_s`` for every rank to register, else raise RendezvousTimeout naming
    who arrived; StaleGroupVersion at once when the version is superseded meanwhile."""
    from torch.distributed import DistError

    prefix = version_prefix(group, version)
    keys = [f"{prefix}/joined/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store.wait(keys, _delta(deadline - time.monotonic()))
        except (DistError, RuntimeError) as exc:
            last: Exception | None = exc
        else:
            last = None
        # a registration planted by someone outside the run does not count: remove it and wait
        # on (the genuine rank can then register), within the same timeout
        forged = _forged_joined(store, keys) if last is None else []
        if not forged or time.monotonic() >= deadline:
            break
        for k in forged:
            store.delete_key(k)
    # Woken because every rank arrived, or because the version was superseded and its
    # missing ranks were marked FENCED: only the current version may go on.
    current = read_current_version(store, group)
    if current is not None and current > version:
        raise StaleGroupVersion(group, got=version, current=current, peer=member)
    if last is None:
        return
    arrived = [r for r, k in enumerate(keys) if store.check([k])]
    missing = [r for r in range(world_size) if r not in arrived]
    if not missing:  # everyone arrived just as the wait gave up
        return
    raise RendezvousTimeout(
        f"rendezvous of group {group!r} version {version}",
        key="init_timeout_s",
        seconds=timeout_s,
        member=member,
        group_version=version,
        missing=[f"rank {r}" for r in missing],
        arrived=[f"rank {r}" for r in arrived],
    ) from last


def join_version(
    store: Store, group: str, version: int, rank: int, world_size: int, timeout_s: float
) -> None:
    """Register ``rank`` for ``version`` and wait up to ``timeout_s`` for the others. Raises
    StaleGroupVersion, TransportError (rank already held) or RendezvousTimeout."""
    check_group_name(group)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    current = raise_current_version(store, group, version)
    if current > version:
        raise StaleGroupVersion(group, got=version, current=current, peer=f"rank {rank}")
    prefix = version_prefix(group, version)
    size_key = f"{prefix}/world_size"
    size = signed(size_key, str(world_size).encode())
    agreed = store.compare_set(size_key, "", size)
    for _ in range(MAX_CAS_TRIES):
        if agreed == size or opened(size_key, agreed) is not None:
            break
        agreed = store.compare_set(size_key, agreed, size)  # planted by an outsider (recorded): replaced
    if agreed != size:
        shown = opened(size_key, agreed) or b"?"
        raise TransportError(
            f"rank {rank} of group {group!r} version {version}: field 'world_size': {world_size}, but the "
            f"members already registered agreed on {shown[:24].decode(errors='replace')}"
        )
    key = f"{prefix}/joined/{rank}"
    me = signed(key, msgpack.packb({"pid": os.getpid(), "host": socket.gethostname(), "t": time.time()}))
    fenced = signed(key, FENCED)
    held = store.compare_set(key, "", me)
    for _ in range(MAX_CAS_TRIES):
        if held in (me, fenced) or opened(key, held) is not None:
            break
        held = store.compare_set(key, held, me)  # an identity squat by an outsider (recorded): taken back
    if held == fenced:
        raise StaleGroupVersion(group, got=version, current=read_current_version(store, group) or version,
                                peer=f"rank {rank}")
    if held != me:
        payload = opened(key, held)
        other = parse_registration(key, payload) if payload else {}
        raise TransportError(
            f"rank {rank} of group {group!r} version {version} is already held by pid "
            f"{short(other.get('pid', '?'))} on {short(other.get('host', '?'))}"
        )
    store.append(f"{prefix}/roster", _roster_entry(f"{prefix}/roster", rank))
    # Superseded between the first check and the world size being published? Then nobody
    # will mark this version's missing ranks: stop here instead of waiting them out.
    current = read_current_version(store, group)
    if current is not None and current > version:
        raise StaleGroupVersion(group, got=version, current=current, peer=f"rank {rank}")
    wait_for_ranks(store, group, version, world_size, timeout_s, member=f"rank {rank}")


__all__ = [
    "StoreAddress",
    "StoreServer",
    "check_group_name",
    "connect_store",
    "join_version",
    "opened",
    "parse_int",
    "parse_registration",
    "raise_current_version",
    "read_current_version",
    "roster",
    "signed",
    "version_prefix",
    "wait_for_ranks",
]
