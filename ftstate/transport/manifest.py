"""The manifest of one weight transfer: what is coming, in which group version, and its checksums."""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from ftstate.core.errors import ManifestError, StaleGroupVersion
from ftstate.core.text import short_repr
from ftstate.transport.buckets import DTYPE_ITEMSIZE, MIN_BUCKET_SIZE, TensorEntry

#: Version of the wire format; bumped on any incompatible change of either message
#: (2: the transfer id).
WIRE_FORMAT = 2

#: Upper bound on an encoded manifest or seal (a sanity bound against garbage lengths).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

_U64 = (1 << 64) - 1

#: Caps a receiver applies before it trusts a manifest (far above any real model, far below
#: what would make validation or the staging allocation itself the attack).
MAX_NDIM = 64
MAX_TENSORS = 1 << 20
MAX_BUCKETS = 1 << 22
MAX_NAME_CHARS = 4096
#: Bytes one transfer may announce (16 TiB): the receiver allocates this much staging.
MAX_TOTAL_BYTES = 1 << 44
#: Largest bucket accepted (64 GiB; ``bucket_size_mb`` is far below it in practice).
MAX_BUCKET_SIZE = 1 << 36

def short(value: Any) -> str:
    """A bounded repr of a value taken from the wire, for error messages."""
    return short_repr(value, width=60)


@dataclass(frozen=True)
class Manifest:
    """What a transfer will carry. ``buckets`` are ``(start, stop)`` windows of the stream."""

    group: str
    group_version: int
    weights_version: int
    bucket_size: int
    total_bytes: int
    tensors: tuple[TensorEntry, ...]
    buckets: tuple[tuple[int, int], ...]
    #: The transfer's id (:func:`new_transfer_id`; 0 where nothing is sent, e.g. in tests).
    transfer: int = 0
    #: The checksum function every member computes over the bytes it holds: ``xxh3`` (the
    #: sender's buffers are in host memory) or ``nh64`` (on a GPU; :mod:`ftstate.transport.digest`).
    digest: str = "xxh3"

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data (the stream minus alignment padding)."""
        return sum(e.nbytes for e in self.tensors)


@dataclass(frozen=True)
class Seal:
    """The checksums of a transfer (xxh3_64, as unsigned 64-bit integers)."""

    group: str
    group_version: int
    weights_version: int
    bucket_checksums: tuple[int, ...]
    tensor_checksums: tuple[int, ...]
    state_checksum: int
    #: The id of the transfer it closes (its manifest's).
    transfer: int = 0


def new_transfer_id() -> int:
    """A fresh transfer id: 64 random bits, so no two transfers of a run share one."""
    return secrets.randbits(64)


# -- encoding ------------------------------------------------------------------------


def encode_manifest(m: Manifest) -> bytes:
    return msgpack.packb(
        {
            "kind": "manifest",
            "format": WIRE_FORMAT,
            "group": m.group,
            "group_version": m.group_version,
            "weights_version": m.weights_version,
            "bucket_size": m.bucket_size,
            "total_bytes": m.total_bytes,
            "tensors": [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in m.tensors],
            "buckets": [[s, e] for s, e in m.buckets],
            "transfer": m.transfer,
            # only when not xxh3: a host transfer's manifest stays the bytes it was
            **({"digest": m.digest} if m.digest != "xxh3" else {}),
        },
        use_bin_type=True,
    )


#: The checksum functions a manifest may name.
DIGESTS = ("xxh3", "nh64")


def encode_seal(s: Seal) -> bytes:
    return msgpack.packb(
        {
            "kind": "seal",
            "format": WIRE_FORMAT,
            "group": s.group,
            "group_version": s.group_version,
            "weights_version": s.weights_version,
            "bucket_checksums": list(s.bucket_checksums),
            "tensor_checksums": list(s.tensor_checksums),
            "state_checksum": s.state_checksum,
            "transfer": s.transfer,
        },
        use_bin_type=True,
    )


# -- decoding and validation ---------------------------------------------------------


def _fail(field: str, problem: str) -> ManifestError:
    return ManifestError(f"malformed manifest: field {field!r}: {problem}", field=field)


def _load(data: bytes | bytearray | memoryview, kind: str) -> Mapping[str, Any]:
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ManifestError(f"malformed {kind}: not valid msgpack ({short(str(exc))})") from exc
    if not isinstance(obj, dict):
        raise ManifestError(f"malformed {kind}: expected a map at the top level, got {type(obj).__name__}")
    if obj.get("kind") != kind:
        raise _fail("kind", f"expected {kind!r}, got {short(obj.get('kind'))}")
    if obj.get("format") != WIRE_FORMAT:
        raise _fail("format", f"wire format {short(obj.get('format'))} is not supported (this side speaks {WIRE_FORMAT})")
    return obj


def _int(obj: Mapping[str, Any], field: str, *, lo: int = 0, hi: int = _U64) -> int:
    if field not in obj:
        raise _fail(field, "missing")
    value = obj[field]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(field, f"expected an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise _fail(field, f"must be in [{lo}, {hi}], got {short(value)}")
    return value


def _list(obj: Mapping[str, Any], field: str, cap: int | None = None) -> list[Any]:
    if field not in obj:
        raise _fail(field, "missing")
    value = obj[field]
    if not isinstance(value, list):
        raise _fail(field, f"expected a list, got {type(value).__name__}")
    if cap is not None and len(value) > cap:
        raise _fail(field, f"{len(value)} items, more than the {cap} accepted")
    return value


def _shape_nbytes(dtype: str, shape: list[Any], where: str, name: str) -> int:
    """The byte count of ``shape`` (already checked: at most MAX_NDIM non-negative ints), multiplied
    out with a bail-out past MAX_TOTAL_BYTES so no product grows without bound."""
    n = DTYPE_ITEMSIZE[dtype]
    if 0 in shape:
        return 0
    for d in shape:
        n *= d
        if n > MAX_TOTAL_BYTES:
            raise _fail(f"{where}.shape", f"tensor {short(name)}: more than MAX_TOTAL_BYTES ({MAX_TOTAL_BYTES}) bytes")
    return n


def _fence(obj: Mapping[str, Any], group: str | None, group_version: int | None) -> tuple[str, int]:
    g = obj.get("group")
    if not isinstance(g, str) or not g or len(g) > MAX_NAME_CHARS:
        raise _fail("group", f"expected a non-empty string, got {short(g)}")
    gv = _int(obj, "group_version")
    if group is not None and g != group:
        raise _fail("group", f"message is for group {short(g)}, this member is in group {group!r}")
    if group_version is not None:
        if gv < group_version:
            raise StaleGroupVersion(g, got=gv, current=group_version)
        if gv > group_version:
            raise _fail(
                "group_version",
                f"message is for version {gv} but this member is in version {group_version} of group {g!r}",
            )
    return g, gv


def decode_manifest(
    data: bytes | bytearray | memoryview, *, group: str | None = None, group_version: int | None = None
) -> Manifest:
    """Parse and validate a manifest: StaleGroupVersion when older than ``group_version``,
    ManifestError naming the field for any other inconsistency."""
    obj = _load(data, "manifest")
    g, gv = _fence(obj, group, group_version)
    weights_version = _int(obj, "weights_version")
    bucket_size = _int(obj, "bucket_size", lo=MIN_BUCKET_SIZE, hi=MAX_BUCKET_SIZE)
    total = _int(obj, "total_bytes", hi=MAX_TOTAL_BYTES)

    entries: list[TensorEntry] = []
    names: set[str] = set()
    for i, raw in enumerate(_list(obj, "tensors", MAX_TENSORS)):
        where = f"tensors[{i}]"
        if not isinstance(raw, list) or len(raw) != 5:
            raise _fail(where, f"expected [name, dtype, shape, offset, nbytes], got {short(raw)}")
        name, dtype, shape, offset, nbytes = raw
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
            raise _fail(f"{where}.name", f"expected a non-empty string of at most {MAX_NAME_CHARS} characters, "
                                         f"got {short(name)}")
        if name in names:
            raise _fail(f"{where}.name", f"duplicate tensor name {short(name)}")
        names.add(name)
        if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE:
            raise _fail(f"{where}.dtype", f"tensor {short(name)}: unknown dtype {short(dtype)}")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM \
                or any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= MAX_TOTAL_BYTES for d in shape):
            raise _fail(f"{where}.shape", f"tensor {short(name)}: expected a list of at most {MAX_NDIM} integers "
                                          f"in [0, {MAX_TOTAL_BYTES}], got {short(shape)}")
        for f, v in (("offset", offset), ("nbytes", nbytes)):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOTAL_BYTES:
                raise _fail(f"{where}.{f}", f"tensor {short(name)}: expected an integer in [0, {MAX_TOTAL_BYTES}], "
                                            f"got {short(v)}")
        expected = _shape_nbytes(dtype, shape, where, name)
        if nbytes != expected:
            raise _fail(
                f"{where}.nbytes",
                f"tensor {short(name)}: {nbytes} does not match dtype {dtype} and shape {short(shape)} "
                f"({expected} bytes)",
            )
        if offset % DTYPE_ITEMSIZE[dtype]:
            raise _fail(f"{where}.offset", f"tensor {short(name)}: {offset} is not aligned to the {dtype} itemsize")
        if offset + nbytes > total:
            raise _fail(f"{where}.offset", f"tensor {short(name)}: ends at {offset + nbytes}, past total_bytes {total}")
        entries.append(TensorEntry(name, dtype, tuple(shape), offset, nbytes))

    spans = sorted((e.offset, e.end, e.name) for e in entries if e.nbytes)
    for (_, end_a, name_a), (start_b, _, name_b) in itertools.pairwise(spans):
        if start_b < end_a:
            raise _fail("tensors", f"tensors {short(name_a)} and {short(name_b)} overlap")
    # the stream ends where its last tensor ends (the senders' plan_layout): no slack for a
    # receiver to allocate and never fill
    end = max((e.end for e in entries if e.nbytes), default=0)
    if total != end:
        raise _fail("total_bytes", f"{total}, but the tensors end at byte {end}")

    windows: list[tuple[int, int]] = []
    prev = 0
    for k, raw in enumerate(_list(obj, "buckets", MAX_BUCKETS)):
        where = f"buckets[{k}]"
        if (
            not isinstance(raw, list)
            or len(raw) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in raw)
        ):
            raise _fail(where, f"expected [start, stop] integers, got {short(raw)}")
        start, stop = raw
        if not prev <= start < stop <= total:
            raise _fail(where, f"window [{short(start)}, {short(stop)}) is empty, out of order or past total_bytes "
                               f"{total}")
        if stop - start > bucket_size:
            raise _fail(where, f"window of {stop - start} bytes is larger than bucket_size {bucket_size}")
        windows.append((start, stop))
        prev = stop
    # every tensor byte must lie in some window, otherwise the receiver would commit garbage
    k = 0
    for start, end, name in spans:
        pos = start
        while pos < end:
            while k < len(windows) and windows[k][1] <= pos:
                k += 1
            if k == len(windows) or windows[k][0] > pos:
                raise _fail("buckets", f"byte {pos} of tensor {short(name)} is in no bucket")
            pos = windows[k][1]
    digest = obj.get("digest", "xxh3")
    if digest not in DIGESTS:
        raise _fail("digest", f"checksum function {short(digest)} is not one of {DIGESTS}")
    return Manifest(g, gv, weights_version, bucket_size, total, tuple(entries), tuple(windows),
                    _int(obj, "transfer"), digest)


def decode_seal(data: bytes | bytearray | memoryview, manifest: Manifest) -> Seal:
    """Parse and validate the seal that closes the transfer announced by ``manifest``."""
    obj = _load(data, "seal")
    g, gv = _fence(obj, manifest.group, manifest.group_version)
    weights_version = _int(obj, "weights_version")
    if weights_version != manifest.weights_version:
        raise _fail(
            "weights_version",
            f"seal is for weights version {weights_version}, manifest announced {manifest.weights_version}",
        )
    transfer = _int(obj, "transfer")
    if transfer != manifest.transfer:
        raise _fail("transfer", f"seal closes transfer {transfer:016x}, the manifest announced transfer "
                                f"{manifest.transfer:016x}: a seal of another transfer (played back?)")
    buckets = _checksums(obj, "bucket_checksums", manifest.num_buckets)
    tensors = _checksums(obj, "tensor_checksums", len(manifest.tensors))
    state = _int(obj, "state_checksum")
    return Seal(g, gv, weights_version, buckets, tensors, state, transfer)


def _checksums(obj: Mapping[str, Any], field: str, count: int) -> tuple[int, ...]:
    values = _list(obj, field, MAX_BUCKETS)
    if len(values) != count:
        raise _fail(field, f"expected {count} checksums, got {len(values)}")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _U64:
            raise _fail(f"{field}[{i}]", f"expected an unsigned 64-bit integer, got {short(v)}")
    return tuple(values)


def manifest_for(
    group: str,
    group_version: int,
    weights_version: int,
    bucket_size: int,
    entries: Sequence[TensorEntry],
    buckets: Sequence[tuple[int, int]],
    total_bytes: int,
) -> Manifest:
    """A manifest from a plan (see :func:`~ftstate.transport.buckets.plan_layout`)."""
    return Manifest(group, group_version, weights_version, bucket_size, total_bytes, tuple(entries), tuple(buckets))


__all__ = [
    "DIGESTS",
    "MAX_BUCKETS",
    "MAX_BUCKET_SIZE",
    "MAX_MESSAGE_BYTES",
    "MAX_NAME_CHARS",
    "MAX_NDIM",
    "MAX_TENSORS",
    "MAX_TOTAL_BYTES",
    "WIRE_FORMAT",
    "Manifest",
    "Seal",
    "decode_manifest",
    "decode_seal",
    "encode_manifest",
    "encode_seal",
    "manifest_for",
    "new_transfer_id",
    "short",
]
