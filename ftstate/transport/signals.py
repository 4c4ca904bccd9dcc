"""Bucket-ready and bucket-released signals between a writer and its same-host readers, over pyzmq.

The writer is the sender, or a remote node's relay writing for its node peers
(:mod:`ftstate.transport.samehost`); "sender" below means either.

The sender binds one ``ROUTER`` socket on ``tcp://127.0.0.1`` (a random port, named in the
transfer's offer; loopback only: the readers are on the same host by construction) and every
same-host reader connects one ``DEALER`` whose identity is its rank. ROUTER/DEALER, not
PUB/SUB: PUB/SUB drops what is sent right after ``connect()`` (DESIGN.md), and the sender
must know each reader is there, so a reader's first message is ``hello`` and the sender
sends nothing to a reader before it has heard it (``ROUTER_MANDATORY`` turns a message to
an unknown reader into an error instead of a silent drop).

Messages are msgpack maps (never pickle) with a ``kind``: ``hello`` (reader → sender: rank,
pid), ``ready`` (sender → reader: bucket index, slot), ``released`` (reader → sender:
bucket index), ``failed`` (either way: the transfer is over, with a reason). A socket is
made for one transfer and closed after it (``LINGER`` 0: nothing outlives the transfer).

:meth:`Channel.recv` waits at most the time it is given; the caller slices its waits so it
can look at abandonment, at its peer's pid and at the transfer's deadline between slices.
"""

from __future__ import annotations

from typing import Any

import msgpack
import zmq

from ftstate.core.errors import ManifestError, TransportError
from ftstate.transport.manifest import short

#: The only address the channel binds or connects to.
LOOPBACK = "tcp://127.0.0.1"


#: Largest signal frame accepted (``zmq.MAXMSGSIZE`` on every socket: a peer that sends more
#: is disconnected by zmq before the frame is ever buffered); real signals are ~100 bytes.
MAX_SIGNAL_BYTES = 4096

#: Ranks an identity may name (the offer's own cap).
MAX_RANK = 1 << 16


def _identity(rank: int) -> bytes:
    return b"r%d" % rank


def _rank_of(ident: bytes) -> int | None:
    """The rank a DEALER's identity names (``r<rank>``), or None when it names none."""
    digits = ident[1:]
    if ident[:1] != b"r" or not digits.isdigit() or len(digits) > 6 or (len(digits) > 1 and digits[:1] == b"0"):
        return None
    rank = int(digits)
    return rank if rank < MAX_RANK else None


def _decode(frame: bytes) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:
        raise ManifestError(f"malformed bucket signal: {short(str(exc))}", field="signal") from exc
    if not isinstance(msg, dict) or not isinstance(msg.get("kind"), str):
        raise ManifestError(f"malformed bucket signal: expected a map with a 'kind', got {short(msg)}",
                            field="signal")
    return msg


class Channel:
    """One end of the signal channel of one transfer.

    :meth:`bind` (the sender's ROUTER) or :meth:`connect` (a reader's DEALER, as ``rank``).
    """

    def __init__(self, sock: zmq.Socket, endpoint: str, *, router: bool) -> None:
        self._sock = sock
        self.endpoint = endpoint
        self._router = router
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)

    @classmethod
    def bind(cls) -> Channel:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_SIGNAL_BYTES)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        port = sock.bind_to_random_port(LOOPBACK)
        return cls(sock, f"{LOOPBACK}:{port}", router=True)

    @classmethod
    def connect(cls, endpoint: str, rank: int) -> Channel:
        if not endpoint.startswith(LOOPBACK + ":"):
            raise ManifestError(f"bucket signal endpoint {endpoint!r} is not on {LOOPBACK}", field="endpoint")
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_SIGNAL_BYTES)
        sock.setsockopt(zmq.IDENTITY, _identity(rank))
        sock.connect(endpoint)
        return cls(sock, endpoint, router=False)

    def send(self, msg: dict[str, Any], to: int | None = None) -> None:
        """Send ``msg`` (to reader ``to`` from the sender's side). Never blocks: a full
        queue or a reader gone raises :class:`~ftstate.core.errors.TransportError`."""
        frame = msgpack.packb(msg, use_bin_type=True)
        try:
            if self._router:
                assert to is not None
                self._sock.send_multipart([_identity(to), frame], flags=zmq.NOBLOCK)
            else:
                self._sock.send(frame, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            who = f" to rank {to}" if to is not None else ""
            raise TransportError(f"bucket signal {msg.get('kind')!r}{who} could not be sent: {exc}") from exc

    def recv(self, timeout_s: float) -> dict[str, Any] | None:
        """The next message within ``timeout_s`` seconds, or None. On the sender's side the
        message carries the reader's rank as ``from``."""
        if not self._poller.poll(max(0, int(timeout_s * 1000))):
            return None
        frames = self._sock.recv_multipart()
        if self._router:
            if len(frames) != 2:
                raise ManifestError(f"malformed bucket signal: {len(frames) - 1} frames from {short(frames[0])}, "
                                    "expected one", field="signal", peer=short(frames[0]))
            ident, frame = frames
            rank = _rank_of(ident)
            if rank is None:
                raise ManifestError(f"bucket signal from an unknown peer {short(ident)}", field="signal",
                                    peer=short(ident))
            msg = _decode(frame)
            msg["from"] = rank
            return msg
        if len(frames) != 1:
            raise ManifestError(f"malformed bucket signal: {len(frames)} frames, expected one", field="signal")
        return _decode(frames[0])

    def close(self) -> None:
        self._sock.close(linger=0)


__all__ = ["LOOPBACK", "MAX_SIGNAL_BYTES", "Channel"]
