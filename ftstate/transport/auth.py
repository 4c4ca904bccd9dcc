"""The run's secret and the message authentication codes of ftstate's control plane."""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("ftstate.security")

#: Bytes of one tag (128 bits: a forgery succeeds with probability 2**-128 per try).
TAG_BYTES = 16

#: Bytes of a run's secret.
SECRET_BYTES = 32

#: Forged messages remembered until the controller collects them (the oldest go first).
MAX_FORGED_KEPT = 256

_PERSON = b"ftstate-mac-v1"


@dataclass(frozen=True)
class RunKey:
    """The secret of one run, and the run it belongs to (bound into every tag)."""

    run: str
    secret: bytes

    def __repr__(self) -> str:  # never print the secret
        return f"RunKey(run={self.run!r})"


_key: RunKey | None = None
_installs = 0  # how many times a key was installed or removed in this process (see installs())
_forged: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_FORGED_KEPT)
_lock = threading.Lock()


def new_secret() -> bytes:
    """A fresh secret for a run (``secrets.token_bytes``)."""
    return secrets.token_bytes(SECRET_BYTES)


def install(run: str, secret: bytes) -> None:
    """Make ``secret`` this process's key for ``run`` (a member's constructor, the controller's start)."""
    global _key, _installs
    if not isinstance(secret, bytes) or len(secret) < 16:
        raise ValueError("the run's secret must be at least 16 bytes")
    _key = RunKey(run, secret)
    _installs += 1


def uninstall() -> None:
    """Forget the key (the run closed)."""
    global _key, _installs
    _key = None
    _installs += 1


def installs() -> int:
    """A number that changes whenever a key is installed or removed: what this process
    remembers about one run (e.g. the highest group version it saw) is keyed by it, so a
    later run in the same process, even one reusing a run name, starts afresh."""
    return _installs


def current() -> RunKey | None:
    return _key


def enabled() -> bool:
    return _key is not None


def tag(channel: str, group: str, version: int, sender: int | str, payload: bytes, *,
        key: RunKey | None = None) -> bytes:
    """The tag of ``payload`` sent by ``sender`` on ``channel`` in version ``version`` of ``group``."""
    k = key or _key
    if k is None:
        raise RuntimeError("no run key installed")
    h = hashlib.blake2b(key=k.secret, digest_size=TAG_BYTES, person=_PERSON)
    # length-prefixed context, so no two different contexts hash alike
    for part in (k.run, channel, group, str(version), str(sender)):
        b = part.encode()
        h.update(len(b).to_bytes(4, "little") + b)
    h.update(payload)
    return h.digest()


def sign(channel: str, group: str, version: int, sender: int | str, payload: bytes) -> bytes:
    """``payload`` followed by its tag (unchanged when no key is installed)."""
    if _key is None:
        return payload
    return payload + tag(channel, group, version, sender, payload)


def verify(channel: str, group: str, version: int, sender: int | str, data: bytes, *,
           record_as: str | None = None, record: bool = True, **fields: Any) -> bytes | None:
    """The payload of ``data`` (what :func:`sign` made) when its tag verifies for ``sender``,
    else None, and the forgery is recorded (as channel ``record_as``, default ``channel``,
    with ``fields``; not when ``record`` is false: one already recorded, read again). No key
    installed: ``data`` as it is."""
    if _key is None:
        return data
    problem = None
    if len(data) < TAG_BYTES:
        problem = "shorter than a tag"
    else:
        payload, got = data[:-TAG_BYTES], data[-TAG_BYTES:]
        if not hmac.compare_digest(got, tag(channel, group, version, sender, payload)):
            problem = "tag does not verify"
    if problem is not None:
        if record:
            record_forged(record_as or channel, sender, group=group, version=version, problem=problem, **fields)
        return None
    return payload


def record_forged(channel: str, claimed: int | str, **fields: Any) -> None:
    """Remember (and log) a message that did not authenticate, for the audit trail."""
    entry = {"channel": channel, "claimed_sender": str(claimed)[:80], "t": time.time(),
             **{k: (v if isinstance(v, (int, float, bool)) or v is None else str(v)[:200]) for k, v in fields.items()}}
    with _lock:
        _forged.append(entry)
    log.warning("forged_message", extra=entry)


def drain_forged() -> list[dict[str, Any]]:
    """The forged messages recorded since the last call (and forget them)."""
    with _lock:
        out = list(_forged)
        _forged.clear()
    return out


__all__ = [
    "MAX_FORGED_KEPT",
    "SECRET_BYTES",
    "TAG_BYTES",
    "RunKey",
    "current",
    "drain_forged",
    "enabled",
    "install",
    "installs",
    "new_secret",
    "record_forged",
    "sign",
    "tag",
    "uninstall",
    "verify",
]
