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
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence

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


class StreamHasher:
    """Per-tensor streaming hashers for one transfer of ``count`` tensors."""

    __slots__ = ("_hashers",)

    def __init__(self, count: int) -> None:
        self._hashers = [xxhash.xxh3_64() for _ in range(count)]

    def feed(self, tensor: int, data: memoryview) -> None:
        self._hashers[tensor].update(data)

    def bucket_digest(self, bucket: Bucket) -> int:
        """The bucket's checksum; call once its segments have all been fed."""
        words: list[int] = []
        for s in bucket.segments:
            words += (s.tensor, s.start, s.length, self._hashers[s.tensor].intdigest())
        return xxhash.xxh3_64_intdigest(struct.pack(f"<QQ{len(words)}Q", bucket.start, bucket.stop, *words))

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
]
