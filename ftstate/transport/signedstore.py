"""The store as torch's own collective backends see it: every value they write there is tagged."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from ftstate.core.errors import RendezvousTimeout
from ftstate.transport.store import opened, signed

#: How often a read of a planted value looks again for the genuine member's value, seconds
#: (the wait as a whole is bounded by the rendezvous deadline the wrapper is made with).
PLANTED_POLL_S = 0.01


class SignedStore(dist.Store):
    """``inner`` with every value tagged for its key (see docs/concepts.md). ``deadline``:
    the ``time.monotonic()`` by which the rendezvous must be done (``init_timeout_s`` from the
    join); a read of a planted value waits for the genuine one until then. ``what``: the
    rendezvous, for the error (``group 'weights' version 3, rank 1``). ``init_timeout_s``: the
    setting behind ``deadline``, named in the error."""

    def __init__(self, inner: dist.Store, *, deadline: float, what: str, init_timeout_s: float) -> None:
        super().__init__()
        self._inner = inner
        self._deadline = deadline
        self._what = what
        self._init_timeout_s = init_timeout_s

    def set(self, key: str, value: bytes | str) -> None:
        self._inner.set(key, signed(key, _bytes(value)))

    def get(self, key: str) -> bytes:
        seen: set[bytes] = set()
        while True:
            raw = _bytes(self._inner.get(key))
            payload = opened(key, raw, record=raw not in seen)  # each planted value recorded once
            if payload is not None:
                return payload
            seen.add(raw)
            if time.monotonic() >= self._deadline:
                raise RendezvousTimeout(
                    f"{self._what}: the value under store key {key!r} was planted by a process outside the run "
                    f"(its tag does not verify; recorded as forged_message) and no member's value replaced it",
                    key="init_timeout_s", seconds=self._init_timeout_s, missing=[f"store key {key}"])
            time.sleep(PLANTED_POLL_S)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        want = _bytes(expected)
        got = _bytes(self._inner.compare_set(key, signed(key, want) if want else b"", signed(key, _bytes(desired))))
        return opened(key, got) or b""

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        for k, v in zip(keys, values, strict=True):
            self.set(k, v)

    # what carries no value of its own: passed through
    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(list(keys))
        else:
            self._inner.wait(list(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return self._inner.check(list(keys))

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)


def _bytes(value: object) -> bytes:
    """What torch hands a Python store (``bytes``, ``str`` or a list of ints) as bytes."""
    if isinstance(value, str):
        return value.encode()
    return bytes(value)  # type: ignore[arg-type]


__all__ = ["PLANTED_POLL_S", "SignedStore"]
