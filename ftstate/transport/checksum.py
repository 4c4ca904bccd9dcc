"""Checksums of weights: per tensor, per bucket, and for a whole state.

Everything is xxh3_64 over raw bytes (a tensor of any dtype, bfloat16 included, is hashed
as its bytes viewed as uint8), so two states are equal exactly when their checksums are.

* :func:`tensor_checksum` — xxh3_64 of one tensor's bytes.
* :func:`state_checksum` — the whole-state checksum the runtime and the tests use to
  prove "this rollout holds exactly the trainer's weights": xxh3_64 of the msgpack of
  ``[name, dtype, shape, tensor_checksum]`` for every tensor, sorted by name. It depends
  on names, dtypes, shapes and bytes, and on nothing else (not the order of the mapping,
  not the bucket size, not the device). Returned as 16 lowercase hex digits.
* :class:`StreamHasher` — what a transfer uses: one streaming xxh3 per tensor, fed
  segment by segment as buckets are packed (sender) or arrive (receiver). A bucket's
  checksum is the hash of its segments' positions and of the intermediate digests of
  their tensors' hashers after the bucket, so each byte is hashed once per side and
  the final per-tensor digests give the whole-state checksum without a second pass.
  With ``security.integrity: keyed`` (:func:`use_integrity`) a bucket's checksum is instead
  BLAKE3, keyed with the run's secret, over the bucket's bytes and positions, and a receiver
  then hashes each byte once (keyed only; the per-tensor checksums come from the verified seal).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgpack
import torch
import xxhash

from ftstate.transport.buckets import Bucket


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


def host_bytes(t: torch.Tensor) -> memoryview:
    """A buffer over the bytes of a uint8 tensor, copied to host memory first if needed."""
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.numpy()).cast("B")


def tensor_checksum(t: torch.Tensor) -> int:
    """xxh3_64 of the tensor's raw bytes."""
    return xxhash.xxh3_64_intdigest(host_bytes(byte_view(t)))


def combine(items: Iterable[tuple[str, str, Sequence[int], int]]) -> int:
    """The whole-state checksum from ``(name, dtype, shape, tensor_checksum)`` items."""
    rows = sorted([name, dtype, [int(d) for d in shape], int(h)] for name, dtype, shape, h in items)
    return xxhash.xxh3_64_intdigest(msgpack.packb(rows, use_bin_type=True))


def format_checksum(value: int) -> str:
    return f"{value:016x}"


def state_checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """Whole-state checksum: deterministic over names, dtypes, shapes and bytes (16 hex digits)."""
    return format_checksum(
        combine((name, dtype_name(t.dtype), tuple(t.shape), tensor_checksum(t)) for name, t in tensors.items())
    )


#: ``security.integrity`` of this process: ``xxh3`` (checksums) or ``keyed`` (bucket digests
#: keyed with the run's secret; see :func:`use_integrity`).
INTEGRITY = "xxh3"
_bucket_key: bytes | None = None


def use_integrity(mode: str) -> None:
    """Set this process's ``security.integrity``. ``keyed``: every bucket's digest is BLAKE3 in
    keyed mode over the bucket's bytes, with a key derived from the run's secret
    (:mod:`ftstate.transport.auth`, which must be installed), so bytes injected into gloo or a
    shared-memory slot by anyone without the secret cannot match their digest. The per-tensor
    and whole-state checksums stay xxh3 either way: they are what members compare with each
    other (held weights, the audit trail), and the keyed bucket digests already cover every byte."""
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

    ``receiving``: the hasher of a member that verifies what arrives. With ``integrity: keyed``
    it keeps no per-tensor xxh3 hashes, so a receiver makes one pass over the bytes, not two.
    That is sound because its every bucket's keyed digest, over the bucket's bytes and
    positions, is compared with the sealed one before anything commits, and a match proves
    that the bytes are the ones the sender hashed its per-tensor checksums from; so the seal's
    per-tensor checksums are this member's too (:meth:`tensor_digests`). A sender, and every
    hasher with xxh3 digests, keeps them (they are what the seal carries)."""

    __slots__ = ("_bucket", "_hashers", "_key", "_sealed_sums")

    def __init__(self, count: int, *, receiving: bool = False) -> None:
        self._key = _bucket_key
        self._sealed_sums = receiving and self._key is not None
        self._hashers = [] if self._sealed_sums else [xxhash.xxh3_64() for _ in range(count)]
        self._bucket: Any = None

    def feed(self, tensor: int, data: memoryview) -> None:
        if not self._sealed_sums:
            self._hashers[tensor].update(data)
        if self._key is not None:
            if self._bucket is None:
                import blake3

                self._bucket = blake3.blake3(key=self._key)
            self._bucket.update(data)

    def bucket_digest(self, bucket: Bucket) -> int:
        """The bucket's checksum; call once its segments have all been fed (a bucket's
        segments are fed before the next bucket's, on every path)."""
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
        """Every tensor's xxh3 digest. A keyed receiver (see the class) hashed none: it returns
        ``sealed``, the seal's, which it may only use once every bucket's keyed digest matched
        the seal's (``_verify`` checks the buckets first, and a mismatch commits nothing)."""
        if not self._sealed_sums:
            return [h.intdigest() for h in self._hashers]
        if sealed is None:
            raise ValueError("a keyed receiver keeps no per-tensor digests: pass the seal's")
        return list(sealed)


__all__ = [
    "StreamHasher",
    "byte_view",
    "combine",
    "dtype_name",
    "format_checksum",
    "host_bytes",
    "state_checksum",
    "tensor_checksum",
    "torch_dtype",
    "use_integrity",
]
