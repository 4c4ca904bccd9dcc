"""Checksums of weights: per tensor, per bucket, and for a whole state."""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import torch
import xxhash

from ftstate.transport.buckets import Bucket

if TYPE_CHECKING:
    from ftstate.transport.digest import NHKey


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name for a dtype without the ``torch.`` prefix (``float32``, ``bfloat16``…)."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on its own device (a view when contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


_copied = 0
_copied_lock = threading.Lock()


def host_bytes(t: torch.Tensor, *, weights: bool = True) -> memoryview:
    """A buffer over the bytes of a uint8 tensor, copied to host memory first if needed (and
    then, unless they are not weights -- a manifest, a seal --, counted: :func:`host_copied_bytes`)."""
    global _copied
    if weights and (t.device.type != "cpu" or t.device.type in DIGEST_DEVICES):  # the latter: a test's stand-in
        with _copied_lock:
            _copied += t.numel()
        t = t.cpu()
    return memoryview(t.numpy()).cast("B")


def host_copied_bytes() -> int:
    """Bytes this process copied from a device to the host to hash or read them (a counter)."""
    return _copied


#: Device types whose buffers are hashed where they are (nh64), not on the host. Tests of the
#: device paths on a CPU add ``cpu`` (a stand-in for a GPU's memory).
DIGEST_DEVICES: set[str] = {"cuda"}


def function_for(tensors: Iterable[torch.Tensor]) -> str:
    """The checksum function of a transfer or a proof over ``tensors``: ``nh64`` when any of
    them is on a device in :data:`DIGEST_DEVICES`, else ``xxh3``."""
    from ftstate.transport import digest

    return digest.NAME if any(t.device.type in DIGEST_DEVICES for t in tensors) else "xxh3"


def nh_key() -> NHKey:
    """nh64's key in this process: the run's (``integrity: keyed``) or the public one."""
    from ftstate.transport import auth, digest

    if INTEGRITY == "keyed":
        key = auth.current()
        if key is not None:
            return digest.keyed(key.secret)
    return digest.public_key()


def tensor_checksum(t: torch.Tensor, function: str = "xxh3") -> int:
    """The tensor's raw bytes' checksum: xxh3_64 on the host, or nh64 on its own device."""
    if function != "xxh3":
        from ftstate.transport import digest

        return digest.tensor_digest(t, nh_key())
    return xxhash.xxh3_64_intdigest(host_bytes(byte_view(t)))


def combine(items: Iterable[tuple[str, str, Sequence[int], int]]) -> int:
    """The whole-state checksum from ``(name, dtype, shape, tensor_checksum)`` items."""
    rows = sorted([name, dtype, [int(d) for d in shape], int(h)] for name, dtype, shape, h in items)
    return xxhash.xxh3_64_intdigest(msgpack.packb(rows, use_bin_type=True))


def format_checksum(value: int, function: str = "xxh3") -> str:
    """A whole-state checksum as text: 16 hex digits, prefixed with the function unless xxh3."""
    return f"{value:016x}" if function == "xxh3" else f"{function}:{value:016x}"


def function_of(checksum: str) -> str:
    """The function a whole-state checksum (:func:`format_checksum`) was computed with."""
    head, sep, _ = checksum.partition(":")
    return head if sep else "xxh3"


def state_checksum(tensors: Mapping[str, torch.Tensor], function: str = "xxh3") -> str:
    """Whole-state checksum: deterministic over names, dtypes, shapes and bytes (16 hex digits;
    ``nh64``: computed on the tensors' own devices, ``nh64:`` and 16 hex digits)."""
    return format_checksum(
        combine((name, dtype_name(t.dtype), tuple(t.shape), tensor_checksum(t, function))
                for name, t in tensors.items()), function)


def state_checksum_like(tensors: Mapping[str, torch.Tensor], expected: str) -> str:
    """:func:`state_checksum` with the function ``expected`` was computed with."""
    return state_checksum(tensors, function_of(expected))


#: ``security.integrity`` of this process: ``xxh3`` (checksums) or ``keyed`` (bucket digests
#: keyed with the run's secret; see :func:`use_integrity`).
INTEGRITY = "xxh3"
_bucket_key: bytes | None = None


def use_integrity(mode: str) -> None:
    """Set ``security.integrity``. ``keyed``: bucket digests are keyed BLAKE3 from the run's
    secret (auth must be installed), so injected bytes cannot match; other checksums stay xxh3."""
    global INTEGRITY, _bucket_key
    if mode not in ("xxh3", "keyed"):
        raise ValueError(f"security.integrity must be 'xxh3' or 'keyed', got {mode!r}")
    if mode == "keyed":
        from ftstate.transport import auth

        key = auth.current()
        if key is None:
            raise ValueError("security.integrity 'keyed' needs the run's secret (security.authenticate)")
        _bucket_key = hashlib.blake2b(key.secret, digest_size=32, person=b"ftstate-bucket").digest()
    else:
        _bucket_key = None
    INTEGRITY = mode


class StreamHasher:
    """Per-tensor streaming hashers for one transfer of ``count`` tensors (and, with
    ``integrity: keyed``, one keyed hasher for the bucket being fed).
    """

    __slots__ = ("_bucket", "_fed", "_hashers", "_key", "_nh", "_nh_key", "_sealed_sums", "_sizes", "function")

    def __init__(self, count: int, *, receiving: bool = False, function: str = "xxh3",
                 sizes: Sequence[int] | None = None) -> None:
        self.function = function
        self._nh = None
        if function != "xxh3":
            from ftstate.transport import digest

            if function != digest.NAME:
                raise ValueError(f"unknown checksum function {function!r}")
            self._nh_key = nh_key()
            self._nh = [digest.TensorState(self._nh_key) for _ in range(count)]
            # each tensor's byte count when known (a transfer's manifest), so a feed knows the
            # tensor's last segment; else the highest end fed so far
            self._sizes = list(sizes) if sizes is not None else None
            self._fed = [0] * count
            self._key, self._sealed_sums, self._hashers, self._bucket = None, False, [], None
            return
        self._key = _bucket_key
        self._sealed_sums = receiving and self._key is not None
        self._hashers = [] if self._sealed_sums else [xxhash.xxh3_64() for _ in range(count)]
        self._bucket: Any = None

    def feed(self, tensor: int, data: memoryview) -> None:
        if self._nh is not None:  # host bytes of an nh64 transfer: in order, from where the tensor's last ended
            self.feed_at(tensor, self._fed[tensor], torch.frombuffer(data, dtype=torch.uint8) if len(data)
                         else torch.empty(0, dtype=torch.uint8))
            return
        if not self._sealed_sums:
            self._hashers[tensor].update(data)
        if self._key is not None:
            if self._bucket is None:
                import blake3

                self._bucket = blake3.blake3(key=self._key)
            self._bucket.update(data)

    def feed_at(self, tensor: int, start: int, data: torch.Tensor, *, last: bool | None = None) -> None:
        """Feed ``data`` (flat uint8), the bytes of ``tensor`` from ``start``; ``last``: they end
        the tensor (only then may their length be off 8 bytes)."""
        if self._nh is None:
            self.feed(tensor, host_bytes(data))
            return
        end = start + data.numel()
        if last is None:
            last = self._sizes is None or end == self._sizes[tensor]
        self._nh[tensor].feed(data, start, last=last)
        self._fed[tensor] = max(self._fed[tensor], end)

    def bucket_digest(self, bucket: Bucket) -> int:
        """The bucket's checksum; call once its segments have all been fed (a bucket's
        segments are fed before the next bucket's, on every path)."""
        if self._nh is not None:
            from ftstate.transport import digest

            zs = digest.values(self._nh[s.tensor] for s in bucket.segments)
            words = [w for s, z in zip(bucket.segments, zs, strict=True) for w in (s.tensor, s.start, s.length, *z)]
            h = hashlib.blake2b(key=self._nh_key.k3, digest_size=8, person=b"ftstate-nh64-bk")
            h.update(struct.pack(f"<QQ{len(words)}q", bucket.start, bucket.stop, *words))
            return int.from_bytes(h.digest(), "little")
        if self._key is None:
            words: list[int] = []
            for s in bucket.segments:
                words += (s.tensor, s.start, s.length, self._hashers[s.tensor].intdigest())
            header = struct.pack(f"<QQ{len(words)}Q", bucket.start, bucket.stop, *words)
            return xxhash.xxh3_64_intdigest(header)
        import blake3

        # keyed: the bytes and their positions only (the same bytes elsewhere do not match); the
        # per-tensor xxh3 state is left out, so a receiver that keeps none computes the same digest
        words = [w for s in bucket.segments for w in (s.tensor, s.start, s.length)]
        h, self._bucket = self._bucket or blake3.blake3(key=self._key), None
        h.update(struct.pack(f"<QQ{len(words)}Q", bucket.start, bucket.stop, *words))
        return int.from_bytes(h.digest(8), "little")

    def tensor_digests(self, sealed: Sequence[int] | None = None) -> list[int]:
        """Every tensor's digest; a keyed receiver hashed none and returns ``sealed``, valid only
        once every bucket's keyed digest matched."""
        if self._nh is not None:
            from ftstate.transport import digest

            zs = digest.values(self._nh)
            return [digest.finish(z, n, self._nh_key) for z, n in zip(zs, self._fed, strict=True)]
        if not self._sealed_sums:
            return [h.intdigest() for h in self._hashers]
        if sealed is None:
            raise ValueError("a keyed receiver keeps no per-tensor digests: pass the seal's")
        return list(sealed)


__all__ = [
    "DIGEST_DEVICES",
    "StreamHasher",
    "byte_view",
    "combine",
    "dtype_name",
    "format_checksum",
    "function_for",
    "function_of",
    "host_bytes",
    "host_copied_bytes",
    "state_checksum",
    "state_checksum_like",
    "tensor_checksum",
    "torch_dtype",
    "use_integrity",
]
