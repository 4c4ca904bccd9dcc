"""The store as torch's own collective backends see it: every value they write there is tagged.

gloo rendezvouses through the store it is given: each rank writes its listening address under
``{group}/v{N}/gloo/0/{rank}`` and every other rank connects to the address it reads there.
Those values are written by torch, not by ftstate, so before this wrapper they carried no tag,
and a process that reached the store without the run's secret could plant an address of its
own under a rank's key: a rank that read it would open its gloo connection to the planter,
which then sat in the middle of the weights stream (the manifest, seal and votes on it are
tagged, but with ``integrity: xxh3`` the bucket bytes are checked only by unkeyed digests).

:class:`SignedStore` is a ``torch.distributed.Store`` written in Python that torch's backend
is handed instead of the store itself (``ProcessGroupGloo(PrefixStore(prefix,
SignedStore(store, ...)))``, :mod:`ftstate.transport.gloo`). What the backend sets is tagged
for its key, as ftstate's own values are (:func:`ftstate.transport.store.signed`); what it
gets must verify. A value that does not verify was planted: it is recorded as forged (channel
``store``, the key) and treated as absent, as every ftstate value is: the read waits on for the
genuine member's value, which overwrites a value planted before it. A value planted *after*
the genuine one replaced it for good; the wait then ends at the rendezvous deadline
(``init_timeout_s``) with an error naming the key, and the runtime forms a new group version.
So a planter can still deny service (as by deleting keys), but no rank ever connects to an
address that a member of the run did not write. What this does not stop: gloo's listeners take
the first connection that names the right pair, and a listener's address is readable here, so an
outsider can still connect to a member first and take a peer's place (docs/security.md, threat
model: the genuine peer's rendezvous then fails and no transfer runs on that version).

Without a key installed (``authenticate: false``) the wrapper is not used: the backend gets
the store itself, as before.
"""

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
    """``inner`` with every value tagged for its key (see the module docstring). ``deadline``:
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
