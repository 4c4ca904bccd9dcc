"""The node copy: one full-size shared-memory copy of a weights version per node, verified in place."""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import struct
import types
from typing import TYPE_CHECKING

from ftstate.core.errors import ChecksumMismatch, ManifestError
from ftstate.transport.shm import (
    HEADER_BYTES,
    PREFIX,
    SHM_DIR,
    create_mapped,
    list_segments,
    parse_name,
    safe_group,
    unlink_names,
)

if TYPE_CHECKING:
    import torch

    from ftstate.transport.manifest import Manifest
    from ftstate.transport.sync import CommittedWeights, Receiver

_MAGIC = 0x6674736e6f646531  # "ftsnode1"
# magic, group version, owner pid, writer pid, weights version, manifest bytes, data bytes
_FIXED = struct.Struct("<QQQQQQQ")

_generations = itertools.count(1)


def copy_name(group: str, group_version: int, owner: int, generation: int) -> str:
    """The name of a node copy of ``group`` at ``group_version``, owned by process ``owner``."""
    return f"{PREFIX}{safe_group(group)}-v{group_version}-p{owner}-g{generation}-n0"


def is_copy(name: str) -> bool:
    fields = parse_name(name)
    return fields is not None and fields["kind"] == "node"


def copies_of(owner: int) -> list[str]:
    """The node copies in ``/dev/shm`` owned by process ``owner``."""
    return [n for n in list_segments() if is_copy(n) and parse_name(n)["pid"] == owner]  # type: ignore[index]


def segment_bytes(name: str) -> int:
    """The size of node copy ``name`` in ``/dev/shm`` (header page, manifest, data); 0 when gone."""
    try:
        return os.stat(SHM_DIR / name).st_size
    except OSError:
        return 0


def _data_offset(manifest_bytes: int) -> int:
    return -(-(_FIXED.size + manifest_bytes) // HEADER_BYTES) * HEADER_BYTES


def _named(name: str, *, group: str, owner: int, group_version: int | None = None) -> dict:
    """The fields of node copy ``name``, checked against what the caller was told."""
    fields = parse_name(name)
    if fields is None or fields["kind"] != "node" or fields["group"] != safe_group(group) \
            or fields["pid"] != owner or (group_version is not None and fields["version"] != group_version):
        raise ManifestError(f"node copy {name!r} is not one of group {group!r} v{group_version} owned by "
                            f"pid {owner}", field="node_copy")
    return fields


def _read_header(buf: mmap.mmap, name: str, size: int, *, version: int, owner: int,
                 writer: int | None) -> tuple[int, int, int, int, int, int]:
    """A node copy's header fields (as in ``_FIXED``), checked against its name."""
    magic, gv, own, wpid, wv, mlen, dlen = _FIXED.unpack_from(buf, 0)
    problem = None
    if magic != _MAGIC:
        problem = f"bad magic {magic:#x}"
    elif gv != version or own != owner:
        problem = f"its header says group version {gv} and owner {own}, its name v{version} and {owner}"
    elif writer is not None and wpid != writer:
        problem = f"written by pid {wpid}, not the sender's {writer}"
    elif _data_offset(mlen) + dlen > size:
        problem = f"its manifest ({mlen} bytes) and data ({dlen} bytes) exceed its size {size}"
    if problem is not None:
        raise ManifestError(f"node copy {name!r}: {problem}", field="node_copy")
    return gv, own, wpid, wv, mlen, dlen


class NodeCopy:
    """One mapping of a node copy: :attr:`data` is a uint8 tensor over its flat layout."""

    def __init__(self, name: str, mm: mmap.mmap, *, group_version: int, owner: int, writer: int,
                 weights_version: int, manifest: bytes, data_bytes: int) -> None:
        import torch  # here: the agent that lists and unlinks copies needs no torch

        self.name = name
        self.group_version = group_version
        self.owner = owner
        self.writer = writer
        self.weights_version = weights_version
        self.manifest = manifest
        self.data_bytes = data_bytes
        #: this mapping's last use was a rewrite of the writer's spare (:meth:`reuse`), not a new file
        self.recycled = False
        self._mm: mmap.mmap | None = mm
        self.inode = (0, 0)  # (device, inode) of the file it maps, for a reader's mapping cache
        self.data: torch.Tensor = torch.frombuffer(mm, dtype=torch.uint8, offset=_data_offset(len(manifest)),
                                                   count=data_bytes) if data_bytes else torch.empty(0, dtype=torch.uint8)

    @classmethod
    def create(cls, group: str, *, group_version: int, owner: int, weights_version: int, manifest: bytes,
               data_bytes: int) -> NodeCopy:
        """A new node copy, reserved at once so a full ``/dev/shm`` raises
        SharedMemoryUnavailable here instead of a SIGBUS mid-bucket."""
        name = copy_name(group, group_version, owner, next(_generations))
        mm = create_mapped(name, _data_offset(len(manifest)) + data_bytes, populate=True)
        _FIXED.pack_into(mm, 0, _MAGIC, group_version, owner, os.getpid(), weights_version, len(manifest), data_bytes)
        mm[_FIXED.size : _FIXED.size + len(manifest)] = manifest
        return cls(name, mm, group_version=group_version, owner=owner, writer=os.getpid(),
                   weights_version=weights_version, manifest=manifest, data_bytes=data_bytes)

    @property
    def mapped(self) -> bool:
        """Whether this process still maps the copy (:meth:`close` unmaps it)."""
        return self._mm is not None

    def reuse(self, group: str, *, group_version: int, weights_version: int, manifest: bytes,
              data_bytes: int) -> bool:
        """Rewrite the writer's spare as the next copy (renamed, header and manifest rewritten),
        so the transfer allocates and faults nothing; False when the layout does not fit."""
        if self._mm is None or data_bytes != self.data_bytes or _data_offset(len(manifest)) != _data_offset(
                len(self.manifest)):
            return False
        name = copy_name(group, group_version, self.owner, next(_generations))
        try:
            os.rename(SHM_DIR / self.name, SHM_DIR / name)
        except OSError:  # unlinked meanwhile (the agent settled): not ours to write any more
            return False
        _FIXED.pack_into(self._mm, 0, _MAGIC, group_version, self.owner, os.getpid(), weights_version,
                         len(manifest), data_bytes)
        self._mm[_FIXED.size : _FIXED.size + len(manifest)] = manifest
        self.name, self.group_version, self.weights_version, self.manifest = name, group_version, weights_version, manifest
        self.recycled = True
        return True

    @classmethod
    def attach(cls, name: str, *, group: str, owner: int, group_version: int | None = None,
               writer: int | None = None, cache: bool = False) -> NodeCopy:
        """Map an existing node copy privately once its name and header match what the caller
        was told; raises ManifestError (field ``node_copy``) naming what disagrees or that it is gone.
        ``cache``: keep the mapping for the file's next use (:data:`_READ_MAPS`)."""
        fields = _named(name, group=group, owner=owner, group_version=group_version)
        try:
            fd = os.open(SHM_DIR / name, os.O_RDONLY)
        except OSError as exc:
            raise ManifestError(f"node copy {name!r} cannot be opened: {os.strerror(exc.errno or 0)} (unlinked: "
                                "its sync failed, or a later version replaced it)", field="node_copy") from exc
        try:
            st = os.fstat(fd)
            size, inode = st.st_size, (st.st_dev, st.st_ino)
            if size < HEADER_BYTES:
                raise ManifestError(f"node copy {name!r} is {size} bytes, shorter than its header", field="node_copy")
            cached = _READ_MAPS.get(inode) if cache else None
            mm = cached if cached is not None and len(cached) == size else \
                mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        try:
            gv, own, wpid, wv, mlen, dlen = _read_header(mm, name, size, version=fields["version"], owner=owner,
                                                         writer=writer)
        except ManifestError:
            _READ_MAPS.pop(inode, None)
            if mm is not cached:
                mm.close()
            raise
        manifest = bytes(mm[_FIXED.size : _FIXED.size + mlen])
        if cache:
            _READ_MAPS[inode] = mm
        node = cls(name, mm, group_version=gv, owner=own, writer=wpid, weights_version=wv, manifest=manifest,
                   data_bytes=dlen)
        node.inode = inode
        return node

    def check_holds(self, manifest: Manifest) -> None:
        """That this copy was made for ``manifest`` (its weights version and its whole layout)."""
        if self.weights_version != manifest.weights_version or self.data_bytes < manifest.total_bytes:
            raise ManifestError(
                f"node copy {self.name!r} holds weights version {self.weights_version} in {self.data_bytes} bytes, "
                f"expected version {manifest.weights_version} in {manifest.total_bytes}", field="node_copy")

    def unlink(self) -> None:
        unlink_names([self.name])

    def close(self) -> None:
        """Drop this object's hold on the mapping (tensors made from :attr:`data` keep it)."""
        import torch

        self._mm = None
        self.data = torch.empty(0, dtype=torch.uint8)


#: A reader's mappings of node copies, by (device, inode): a recycled copy is the same file
#: under a new name, so its pages are not faulted in again at every sync.
_READ_MAPS: dict[tuple[int, int], mmap.mmap] = {}


def forget_mappings() -> None:
    """Drop cached mappings of node copies no longer named in ``/dev/shm``; tensors still
    viewing one keep it mapped until they go."""
    named = set()
    for n in list_segments():
        if is_copy(n):
            with contextlib.suppress(OSError):
                st = os.stat(SHM_DIR / n)
                named.add((st.st_dev, st.st_ino))
    for inode in [i for i in _READ_MAPS if i not in named]:
        del _READ_MAPS[inode]


def tensors_of(flat: torch.Tensor, manifest: Manifest) -> dict[str, torch.Tensor]:
    """The manifest's tensors as views into ``flat`` (its whole layout)."""
    from ftstate.transport.checksum import torch_dtype

    return {e.name: flat[e.offset : e.offset + e.nbytes].view(torch_dtype(e.dtype)).view(e.shape)
            for e in manifest.tensors}


def adopt(receiver: Receiver, name: str, *, group: str, owner: int, weights_version: int,
          checksum: str) -> CommittedWeights:
    """A newcomer: map the committed node copy ``name``, hash it in place, and commit it only if
    it is ``weights_version`` with ``checksum``. Raises ManifestError (gone or another version)
    or ChecksumMismatch; either way ``receiver`` keeps what it held."""
    node = NodeCopy.attach(name, group=group, owner=owner)
    try:
        return _commit_proven(receiver, name, node.manifest, node.data, group=group, group_version=node.group_version,
                              weights_version=weights_version, checksum=checksum, mapped=True)
    finally:
        node.close()


def _commit_proven(receiver: Receiver, name: str, manifest_bytes: bytes, flat: torch.Tensor, *, group: str,
                   group_version: int, weights_version: int, checksum: str, mapped: bool) -> CommittedWeights:
    """Commit ``flat`` (mapped in place, or a private buffer) into ``receiver`` only if it
    hashes to ``checksum``; else raise and keep what ``receiver`` held."""
    from ftstate.transport.checksum import state_checksum_like
    from ftstate.transport.manifest import decode_manifest
    from ftstate.transport.sync import CommittedWeights

    manifest = decode_manifest(manifest_bytes, group=group, group_version=group_version)
    if manifest.weights_version != weights_version:
        raise ManifestError(f"node copy {name!r} holds weights version {manifest.weights_version}, expected "
                            f"{weights_version}", field="node_copy")
    if flat.numel() < manifest.total_bytes:
        raise ManifestError(f"node copy {name!r} holds {flat.numel()} bytes of data, its manifest lays out "
                            f"{manifest.total_bytes}", field="node_copy")
    tensors = tensors_of(flat, manifest)
    held = state_checksum_like(tensors, checksum)  # with the function the version was proved with
    if held != checksum:
        raise ChecksumMismatch(f"node copy {name!r} of weights version {weights_version} hashes to {held}, "
                               f"expected the committed {checksum}; kept what this member held")
    new = CommittedWeights(
        tensors=types.MappingProxyType(tensors), weights_version=weights_version, state_checksum=held, group=group,
        group_version=manifest.group_version, nbytes=manifest.payload_bytes, _flat=flat, _entries=manifest.tensors,
        _windows=manifest.buckets, _node=name if mapped else None)
    receiver._committed = new
    receiver._spare = None  # the node copy (or the buffer it came in) is its staging: nothing beside it
    return new


#: One served copy's handshake: the one-time token (hex) the newcomer sends first, then the
#: copy's size the agent answers with, before the bytes of the whole segment.
_TOKEN_BYTES = 32
_SIZE = struct.Struct("<Q")
_SLICE = 64 << 20  # bytes sent per socket.sendfile call (the deadline is checked between them)


def serve(name: str, *, host: str, timeout_s: float) -> dict[str, object]:
    """Serve node copy ``name`` once, point to point: one connection on ``host`` within
    ``timeout_s`` that opens with the returned one-time token gets the whole segment by
    ``sendfile`` (no torch in the agent). Opened now, so a later unlink does not cut it short.
    Raises ManifestError when the copy is gone."""
    import secrets
    import socket
    import threading
    import time

    try:
        file = open(SHM_DIR / name, "rb")  # noqa: SIM115 - closed by the sending thread
    except OSError as exc:
        raise ManifestError(f"node copy {name!r} cannot be served: {os.strerror(exc.errno or 0)} (unlinked: a "
                            "later version replaced it)", field="node_copy") from exc
    size = os.fstat(file.fileno()).st_size
    token = secrets.token_hex(_TOKEN_BYTES // 2)
    listener = socket.create_server((host, 0))
    deadline = time.monotonic() + timeout_s

    def send() -> None:
        try:
            listener.settimeout(timeout_s)
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                got = _recv_exact(conn, _TOKEN_BYTES)
                if not secrets.compare_digest(got, token.encode()):
                    return  # not the newcomer it was served for: it gets nothing
                conn.sendall(_SIZE.pack(size))
                # socket.sendfile, not os.sendfile: a socket with a timeout is non-blocking
                # underneath (os.sendfile would stop at the first full send buffer); in slices so
                # the whole send, not each wait, is bounded by the deadline
                for offset in range(0, size, _SLICE):
                    conn.settimeout(max(deadline - time.monotonic(), 0.001))
                    conn.sendfile(file, offset, min(_SLICE, size - offset))
        except OSError:
            return  # the newcomer went or timed out: it says so itself (fetch raises)
        finally:
            listener.close()
            file.close()

    threading.Thread(target=send, name=f"ftstate-serve-{name}", daemon=True).start()
    return {"host": host, "port": listener.getsockname()[1], "token": token, "nbytes": size}


def fetch(receiver: Receiver, served: dict, *, name: str, group: str, owner: int, weights_version: int,
          checksum: str, timeout_s: float) -> CommittedWeights:
    """Receive node copy ``name`` from the agent that served it into the receiver's staging
    (a prewarmed spare's pages are already touched), then commit as :func:`adopt` does.
    Raises SyncTimeout past ``timeout_s``, TransportError, ManifestError or ChecksumMismatch;
    ``receiver`` then keeps what it held."""
    import socket
    import time

    import torch

    from ftstate.core.errors import SyncTimeout, TransportError
    from ftstate.transport.checksum import host_bytes

    fields = _named(name, group=group, owner=owner)
    expected = int(served["nbytes"])
    deadline = time.monotonic() + timeout_s
    what = f"point-to-point resync from node copy {name!r} at {served['host']}:{served['port']}"

    def recv_into(conn: socket.socket, view: memoryview) -> None:
        got = 0
        while got < len(view):
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
            n = conn.recv_into(view[got:])
            if n == 0:
                raise TransportError(f"{what}: the connection ended after {got} of {len(view)} bytes")
            got += n

    staging: tuple[torch.Tensor, int] | None = None
    try:
        with socket.create_connection((str(served["host"]), int(served["port"])), timeout=timeout_s) as conn:
            conn.sendall(str(served["token"]).encode())
            (size,) = _SIZE.unpack(_recv_exact(conn, _SIZE.size))
            if size != expected or size < HEADER_BYTES:
                raise ManifestError(f"{what}: the agent sends {size} bytes, it announced {expected}",
                                    field="node_copy")
            head = bytearray(_FIXED.size)
            recv_into(conn, memoryview(head))
            gv, _own, _wpid, _wv, mlen, dlen = _read_header(head, name, size, version=fields["version"], owner=owner,
                                                             writer=None)
            rest = bytearray(_data_offset(mlen) - _FIXED.size)  # the manifest and the header page's padding
            recv_into(conn, memoryview(rest))
            manifest = bytes(rest[:mlen])
            flat = torch.empty(0, dtype=torch.uint8)
            if dlen:  # the staging's own bytes, written in place by the socket
                staging = receiver.staging(dlen, torch.device("cpu"))
                flat = staging[0][:dlen]
                recv_into(conn, host_bytes(flat))
            if trailing := size - _data_offset(mlen) - dlen:
                recv_into(conn, memoryview(bytearray(trailing)))
        return _commit_proven(receiver, name, manifest, flat, group=group, group_version=gv,
                              weights_version=weights_version, checksum=checksum, mapped=False)
    except BaseException as exc:
        if staging is not None:  # whatever landed there is not committed: the buffer stays the receiver's spare
            receiver._spare = staging
        if isinstance(exc, TimeoutError):
            raise SyncTimeout(what, key="sync_timeout_s", seconds=timeout_s) from exc
        if isinstance(exc, OSError):
            raise TransportError(f"{what}: {exc}") from exc
        raise


def _recv_exact(conn: object, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = conn.recv(n - len(out))  # type: ignore[attr-defined]
        if not chunk:
            raise ConnectionError(f"the peer closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


__all__ = ["NodeCopy", "adopt", "copies_of", "copy_name", "fetch", "forget_mappings", "is_copy", "segment_bytes", "serve", "tensors_of", "unlink_names"]
