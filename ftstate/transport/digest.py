"""A digest computed where the weights are: ``nh64``, the same bits on CPU, on a GPU and in a fused kernel."""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

#: Name of this function where a digest is labelled (manifest, checksum strings).
NAME = "nh64"

#: Words (32-bit) per L1 chunk: 4 KiB.
CHUNK_WORDS = 1024
CHUNK_BYTES = 4 * CHUNK_WORDS

#: Toeplitz shift of the second pass's L1 key, in words (RFC 4418's 16 bytes).
SHIFT = 4

#: Chunks hashed per torch step (64 MiB of input, ~0.5 GiB of temporaries).
STEP_CHUNKS = 16384


_M32 = 0xFFFFFFFF
_PERSON = b"ftstate-nh64-v1"


class NHKey:
    """The key tables of one seed: ``k1`` (L1), ``k2`` (L2, grown on demand), ``k3`` (finish).

    Tables are int64 tensors holding values below 2**32, cached per device."""

    def __init__(self, seed: bytes) -> None:
        self.seed = seed
        words = hashlib.shake_256(seed + b"/k1").digest(4 * (CHUNK_WORDS + SHIFT))
        self.k1 = torch.frombuffer(bytearray(words), dtype=torch.int32).to(torch.int64) & _M32
        self.k3 = hashlib.blake2b(seed + b"/k3", digest_size=32).digest()
        self._k2 = torch.zeros((0, 8), dtype=torch.int64)
        self._on: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def tables(self, device: torch.device, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k1, k2)`` on ``device``, ``k2`` with at least ``chunks`` rows."""
        key = str(device)
        with self._lock:
            have = self._on.get(key)
            if have is not None and have[1].shape[0] >= chunks:
                return have
            if self._k2.shape[0] < chunks:
                rows = max(chunks, 2 * self._k2.shape[0], 1024)
                # SHAKE's output for a longer length starts with the shorter one: rows never change
                raw = hashlib.shake_256(self.seed + b"/k2").digest(32 * rows)
                self._k2 = (torch.frombuffer(bytearray(raw), dtype=torch.int32).to(torch.int64) & _M32).reshape(rows, 8)
            pair = (self.k1.to(device), self._k2.to(device))
            self._on[key] = pair
            return pair


_public: NHKey | None = None
_keyed: dict[bytes, NHKey] = {}


def public_key() -> NHKey:
    """The key of unkeyed digests: a fixed seed, so values compare across runs and machines."""
    global _public
    if _public is None:
        _public = NHKey(b"ftstate-nh64-public-v1")
    return _public


def keyed(secret: bytes) -> NHKey:
    """The key derived from a run's secret (``security.integrity: keyed``)."""
    seed = hashlib.blake2b(secret, digest_size=32, person=b"ftstate-nh64-key").digest()
    if seed not in _keyed:
        _keyed.clear()  # one run per process: keep one
        _keyed[seed] = NHKey(seed)
    return _keyed[seed]


# -- the torch form --------------------------------------------------------------------------


def _words(x: torch.Tensor) -> torch.Tensor:
    """uint8 bytes (length a multiple of 4) as int64 values of their 32-bit little-endian words."""
    try:
        w = x.view(torch.int32)
    except RuntimeError:  # a view at an offset not divisible by 4: copy it, on its own device
        w = x.clone().view(torch.int32)
    return w.to(torch.int64).bitwise_and_(_M32)


def _l1(w: torch.Tensor, k1: torch.Tensor, offset: int) -> torch.Tensor:
    """L1 of rows of ``w`` (shape ``(c, L)``, L even, masked words) whose first word sits at
    ``offset`` in its chunk: ``(c, 2)`` int64."""
    width = w.shape[1]
    out = []
    for t in range(2):
        a = w + k1[offset + SHIFT * t : offset + SHIFT * t + width]
        a.bitwise_and_(_M32)
        out.append((a[:, 0::2] * a[:, 1::2]).sum(dim=1))
    return torch.stack(out, dim=1)


def _l2(y: torch.Tensor, k2: torch.Tensor) -> torch.Tensor:
    """L2 of L1 pairs ``y`` (``(c, 2)``) with their chunks' key rows ``k2`` (``(c, 8)``): ``(2,)``."""
    h = torch.stack([y[:, 0] & _M32, (y[:, 0] >> 32) & _M32, y[:, 1] & _M32, (y[:, 1] >> 32) & _M32], dim=1)
    out = []
    for u in range(2):
        a = (h + k2[:, 4 * u : 4 * u + 4]).bitwise_and_(_M32)
        out.append((a[:, 0] * a[:, 1] + a[:, 2] * a[:, 3]).sum())
    return torch.stack(out)


def _full_torch(words_u8: torch.Tensor, first: int, k1: torch.Tensor, k2: torch.Tensor) -> torch.Tensor:
    """L2 sum of whole chunks (``words_u8``: a multiple of :data:`CHUNK_BYTES` bytes, its first
    chunk being chunk ``first`` of its tensor)."""
    total = torch.zeros(2, dtype=torch.int64, device=words_u8.device)
    chunks = words_u8.numel() // CHUNK_BYTES
    for c in range(0, chunks, STEP_CHUNKS):
        n = min(STEP_CHUNKS, chunks - c)
        w = _words(words_u8[c * CHUNK_BYTES : (c + n) * CHUNK_BYTES]).reshape(n, CHUNK_WORDS)
        total += _l2(_l1(w, k1, 0), k2[first + c : first + c + n])
    return total


#: Chunks per numpy step on the host: 4 MiB of input, its uint64 temporaries in a few MiB.
HOST_STEP_CHUNKS = 1024


def _full_numpy(words_u8: torch.Tensor, first: int, k1: torch.Tensor, k2: torch.Tensor) -> torch.Tensor:
    """:func:`_full_torch` in numpy's uint64 for host memory: the same bits, faster there."""
    import numpy as np

    m32 = np.uint64(_M32)
    chunks = words_u8.numel() // CHUNK_BYTES
    w32 = words_u8[: chunks * CHUNK_BYTES].numpy().view(np.uint32).reshape(chunks, CHUNK_WORDS)
    key1 = k1.numpy().astype(np.uint64)
    ka = [np.ascontiguousarray(key1[SHIFT * t : SHIFT * t + CHUNK_WORDS : 2]) for t in range(2)]
    kb = [np.ascontiguousarray(key1[SHIFT * t + 1 : SHIFT * t + CHUNK_WORDS : 2]) for t in range(2)]
    z = np.zeros(2, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for c in range(0, chunks, HOST_STEP_CHUNKS):
            blk = w32[c : c + HOST_STEP_CHUNKS]
            even, odd = blk[:, 0::2].astype(np.uint64), blk[:, 1::2].astype(np.uint64)
            ys = []
            for t in range(2):
                a = even + ka[t]
                a &= m32
                b = odd + kb[t]
                b &= m32
                a *= b
                ys.append(a.sum(axis=1, dtype=np.uint64))
            h = (ys[0] & m32, ys[0] >> np.uint64(32), ys[1] & m32, ys[1] >> np.uint64(32))
            rows = k2[first + c : first + c + blk.shape[0]].numpy().astype(np.uint64)
            for u in range(2):
                a = [(h[i] + rows[:, 4 * u + i]) & m32 for i in range(4)]
                z[u] += (a[0] * a[1] + a[2] * a[3]).sum(dtype=np.uint64)
    return torch.from_numpy(z.view(np.int64).copy())


def _full(body: torch.Tensor, first: int, k1: torch.Tensor, k2: torch.Tensor) -> torch.Tensor:
    if body.device.type == "cpu" and body.data_ptr() % 4 == 0:
        return _full_numpy(body, first, k1, k2)
    return _full_torch(body, first, k1, k2)


# -- one tensor, hashed in segments ------------------------------------------------------------


@dataclass
class TensorState:
    """The running digest of one tensor fed in segments at any multiple of 8 bytes, in any order.

    ``full``: the L2 sum of every chunk fed whole (a device tensor, so nothing waits on the
    device); ``partial``: chunk index -> summed L1 of the pieces of chunks fed in parts."""

    key: NHKey
    full: torch.Tensor | None = None
    partial: dict[int, torch.Tensor] = field(default_factory=dict)

    def feed(self, data: torch.Tensor, start: int, *, last: bool = False) -> None:
        """Feed ``data`` (flat uint8, on any device) holding the tensor's bytes from ``start``.
        ``start`` must be a multiple of 8; a length that is not is allowed only at the
        tensor's end (``last``: its last bytes are zero-padded to 8)."""
        n = data.numel()
        if start % 8:
            raise ValueError(f"nh64: a segment must start at a multiple of 8 bytes, not {start}")
        if n % 8 and not last:
            raise ValueError(f"nh64: only the tensor's last segment may end off 8 bytes ({n} bytes at {start})")
        if n == 0:
            return
        device = data.device
        first_chunk = start // CHUNK_BYTES
        k1, k2 = self.key.tables(device, (start + n) // CHUNK_BYTES + 1)
        lo = 0
        head = (CHUNK_BYTES - start % CHUNK_BYTES) % CHUNK_BYTES
        if head:  # the rest of a chunk begun elsewhere
            lo = min(head, n - n % 8)
            if lo:
                self._partial(first_chunk, _words(data[:lo]).reshape(1, -1), k1, (start % CHUNK_BYTES) // 4)
            if lo < head:  # the whole segment is inside that chunk
                self._tail(data, lo, first_chunk, k1, (start + lo) % CHUNK_BYTES // 4)
                return
            first_chunk += 1
        whole = (n - lo) // CHUNK_BYTES * CHUNK_BYTES
        if whole:
            body = data[lo : lo + whole]
            got = _full(body, first_chunk, k1, k2)
            self.full = got if self.full is None else self.full + got
        self._tail(data, lo + whole, first_chunk + whole // CHUNK_BYTES, k1, 0)

    def _tail(self, data: torch.Tensor, lo: int, chunk: int, k1: torch.Tensor, offset: int) -> None:
        rest = data[lo:]
        if rest.numel() == 0:
            return
        if rest.numel() % 8:  # the tensor's last bytes: zero-padded to a word pair (nbytes is bound later)
            pad = torch.zeros(-(-rest.numel() // 8) * 8, dtype=torch.uint8, device=data.device)
            pad[: rest.numel()] = rest
            rest = pad
        self._partial(chunk, _words(rest).reshape(1, -1), k1, offset)

    def _partial(self, chunk: int, w: torch.Tensor, k1: torch.Tensor, offset: int) -> None:
        y = _l1(w, k1, offset)[0]
        have = self.partial.get(chunk)
        self.partial[chunk] = y if have is None else have + y

    def value(self) -> torch.Tensor:
        """``(z_0, z_1)`` of what was fed so far (an int64 device tensor of 2; nothing synchronizes)."""
        out = self.full
        if self.partial:
            chunks = sorted(self.partial)
            ys = torch.stack([self.partial[c] for c in chunks])
            dev = ys.device
            _, k2 = self.key.tables(dev, chunks[-1] + 1)
            idx = torch.tensor(chunks, dtype=torch.long, device=dev)
            part = _l2(ys, k2.index_select(0, idx))
            out = part if out is None else out.to(dev) + part
        if out is None:
            return torch.zeros(2, dtype=torch.int64)
        return out


def finish(z: Iterable[int], nbytes: int, key: NHKey) -> int:
    """The 64-bit digest of ``z`` (a :meth:`TensorState.value`, as ints) for ``nbytes`` bytes."""
    z0, z1 = (int(v) for v in z)
    h = hashlib.blake2b(key=key.k3, digest_size=8, person=_PERSON)
    h.update(struct.pack("<qqQ", z0, z1, nbytes))
    return int.from_bytes(h.digest(), "little")


def values(states: Iterable[TensorState]) -> list[tuple[int, int]]:
    """The ``(z_0, z_1)`` of several states, read back in one transfer of 16 bytes each."""
    vs = [s.value() for s in states]
    if not vs:
        return []
    flat = torch.stack([v.to(vs[0].device) for v in vs]).cpu().tolist()
    return [(a, b) for a, b in flat]


def tensor_digest(t: torch.Tensor, key: NHKey | None = None) -> int:
    """nh64 of one tensor's raw bytes, computed on its own device."""
    key = key or public_key()
    data = t.detach()
    if not data.is_contiguous():
        data = data.contiguous()
    data = data.reshape(-1).view(torch.uint8)
    s = TensorState(key)
    s.feed(data, 0, last=True)
    return finish(s.value().cpu().tolist(), data.numel(), key)


def bytes_digest(data: torch.Tensor, key: NHKey | None = None) -> int:
    """nh64 of a flat uint8 buffer (the digest's throughput alone, in the benchmark)."""
    return tensor_digest(data, key)


__all__ = [
    "CHUNK_BYTES",
    "CHUNK_WORDS",
    "NAME",
    "NHKey",
    "TensorState",
    "bytes_digest",
    "finish",
    "keyed",
    "public_key",
    "tensor_digest",
    "values",
]
