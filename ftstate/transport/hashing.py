"""Hashing one side of a transfer, and comparing what a receiver hashed with the seal."""

from __future__ import annotations

import queue
import threading

import torch

from ftstate.core.errors import TransportError
from ftstate.transport.buckets import Bucket
from ftstate.transport.checksum import StreamHasher, combine, host_bytes
from ftstate.transport.manifest import Manifest, Seal


def hasher_for(manifest: Manifest, *, receiving: bool = False) -> StreamHasher:
    """The hasher of one side of the transfer ``manifest`` announces, with its function."""
    return StreamHasher(len(manifest.tensors), receiving=receiving, function=manifest.digest,
                        sizes=[e.nbytes for e in manifest.tensors])


def feed_bucket(hasher: StreamHasher, bucket: Bucket, data: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
    """Feed the bucket's bytes ``[lo, hi)`` (offsets in it; ``data`` holds them at those offsets)
    to their tensors' hashers: through the host for xxh3, where they are for nh64."""
    hi = bucket.nbytes if hi is None else hi
    mv = host_bytes(data[lo:hi]) if hasher.function == "xxh3" else None
    for s in bucket.segments:
        a, z = max(lo, s.bucket_offset), min(hi, s.bucket_offset + s.length)
        if a >= z:
            continue
        if mv is not None:
            hasher.feed(s.tensor, mv[a - lo : z - lo])
        else:  # nh64: each piece at its place in its tensor, on the device that holds it
            hasher.feed_at(s.tensor, s.start + a - s.bucket_offset, data[a:z])


class Hashing:
    """Hashes the buckets of one transfer in a helper thread, in bucket order."""

    def __init__(self, manifest: Manifest, *, receiving: bool = False) -> None:
        self.hasher = hasher_for(manifest, receiving=receiving)
        self.digests: list[int] = []
        self._queue: queue.SimpleQueue[tuple[Bucket, torch.Tensor] | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="ftstate-hash", daemon=True)
        self._thread.start()

    def submit(self, bucket: Bucket, data: torch.Tensor) -> None:
        self._queue.put((bucket, data))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            bucket, data = item
            try:
                if not self._stopped:
                    feed_bucket(self.hasher, bucket, data)
                    digest = self.hasher.bucket_digest(bucket)
            except BaseException as exc:  # noqa: BLE001 - handed to the transfer thread by wait_for/finish
                self._error = exc
                self._stopped = True
            with self._done:
                if not self._stopped:
                    self.digests.append(digest)
                self._done.notify_all()

    def wait_for(self, index: int) -> None:
        """Block until bucket ``index`` has been hashed (its buffer may then be reused)."""
        with self._done:
            self._done.wait_for(lambda: len(self.digests) > index or self._stopped)
        self._raise()

    def finish(self) -> list[int]:
        """Every bucket's checksum, once all submitted buckets are hashed."""
        self._queue.put(None)
        self._thread.join()
        self._raise()
        return self.digests

    def cancel(self) -> None:
        """Stop hashing (the transfer failed); the thread exits after its current bucket."""
        self._stopped = True
        self._queue.put(None)

    def _raise(self) -> None:
        if self._error is not None:
            raise TransportError(f"hashing a bucket failed: {self._error}") from self._error


def own_state_checksum(manifest: Manifest, tensor_sums: list[int]) -> int:
    """The whole-state checksum of what this member received, from its per-tensor digests (its
    own; with ``integrity: keyed`` the seal's, proven by its keyed bucket digests)."""
    return combine((e.name, e.dtype, e.shape, h) for e, h in zip(manifest.tensors, tensor_sums, strict=True))


def verify(manifest: Manifest, seal: Seal, digests: list[int], tensor_sums: list[int], state: int) -> str | None:
    """None when everything matches, else what did not (first failing bucket first). ``state``:
    the receiver's own whole-state checksum of ``tensor_sums``."""
    n = manifest.num_buckets
    for k, (got, want) in enumerate(zip(digests, seal.bucket_checksums, strict=True)):
        if got != want:
            return f"bucket {k + 1}/{n} does not match its checksum (expected {want:016x}, got {got:016x})"
    for e, got, want in zip(manifest.tensors, tensor_sums, seal.tensor_checksums, strict=True):
        if got != want:
            return f"tensor {e.name!r} does not match its checksum (expected {want:016x}, got {got:016x})"
    if state != seal.state_checksum:
        return (
            f"whole-state checksum does not match (expected {seal.state_checksum:016x}, got {state:016x})"
        )
    return None


__all__ = ["Hashing", "feed_bucket", "hasher_for", "own_state_checksum", "verify"]
