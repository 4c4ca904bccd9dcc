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
  BLAKE3, keyed with the run's secret, over the bucket's bytes and positions.
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
    ``integrity: keyed``, one keyed hasher for the bucket being fed)."""

    __slots__ = ("_bucket", "_hashers", "_key")

    def __init__(self, count: int) -> None:
        self._hashers = [xxhash.xxh3_64() for _ in range(count)]
        self._key = _bucket_key
        self._bucket: Any = None

    def feed(self, tensor: int, data: memoryview) -> None:
        self._hashers[tensor].update(data)
        if self._key is not None:
            if self._bucket is None:
                import blake3

                self._bucket = blake3.blake3(key=self._key)
            self._bucket.update(data)

    def bucket_digest(self, bucket: Bucket) -> int:
        """The bucket's checksum; call once its segments have all been fed (a bucket's
        segments are fed before the next bucket's, on every path)."""
        words: list[int] = []
        for s in bucket.segments:
            words += (s.tensor, s.start, s.length, self._hashers[s.tensor].intdigest())
        header = struct.pack(f"<QQ{len(words)}Q", bucket.start, bucket.stop, *words)
        if self._key is None:
            return xxhash.xxh3_64_intdigest(header)
        import blake3

        h, self._bucket = self._bucket or blake3.blake3(key=self._key), None
        h.update(header)  # the positions too: the same bytes elsewhere do not match
        return int.from_bytes(h.digest(8), "little")

    def tensor_digests(self) -> list[int]:
        return [h.intdigest() for h in self._hashers]


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
