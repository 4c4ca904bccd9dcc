"""Bucket-ready and bucket-released signals between a writer and its same-host readers, over pyzmq."""

from __future__ import annotations

from typing import Any

import msgpack
import zmq

from ftstate.core.errors import ManifestError, PeerLost, TransportError
from ftstate.transport import auth
from ftstate.transport.manifest import short

#: The only address the channel binds or connects to.
LOOPBACK = "tcp://127.0.0.1"


#: Largest signal frame accepted (``zmq.MAXMSGSIZE`` on every socket: a peer that sends more
#: is disconnected by zmq before the frame is ever buffered); real signals are ~100 bytes.
MAX_SIGNAL_BYTES = 4096

#: Ranks an identity may name (the offer's own cap).
MAX_RANK = 1 << 16


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
    """One end of the signal channel of one transfer."""

    def __init__(self, sock: zmq.Socket, endpoint: str, *, router: bool, group: str, version: int, rank: int,
                 writer: int | None = None) -> None:
        self._sock = sock
        self.endpoint = endpoint
        self._router = router
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self.group = group
        self.version = version
        self.rank = rank
        self.writer = writer
        self._seq = 0
        self._seen: dict[int, int] = {}  # sender rank -> last sequence number accepted
        self._ident_of: dict[int, bytes] = {}  # router: rank -> its connection's identity
        self._rank_at: dict[bytes, int] = {}

    @property
    def _channel(self) -> str:
        return f"signal {self.endpoint}"  # the transfer's own endpoint: nothing of another verifies

    @classmethod
    def bind(cls, *, group: str = "", version: int = 0, rank: int = 0) -> Channel:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_SIGNAL_BYTES)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        port = sock.bind_to_random_port(LOOPBACK)
        return cls(sock, f"{LOOPBACK}:{port}", router=True, group=group, version=version, rank=rank)

    @classmethod
    def connect(cls, endpoint: str, rank: int, *, group: str = "", version: int = 0, writer: int = 0) -> Channel:
        if not endpoint.startswith(LOOPBACK + ":"):
            raise ManifestError(f"bucket signal endpoint {short(endpoint)} is not on {LOOPBACK}", field="endpoint")
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_SIGNAL_BYTES)
        sock.connect(endpoint)
        return cls(sock, endpoint, router=False, group=group, version=version, rank=rank, writer=writer)

    def send(self, msg: dict[str, Any], to: int | None = None) -> None:
        """Send ``msg`` without blocking: TransportError for a full queue or a reader not yet
        heard from, PeerLost for one whose connection is gone."""
        self._seq += 1
        body = {**msg, "rank": self.rank, "seq": self._seq, **({"to": to} if to is not None else {})}
        frame = auth.sign(self._channel, self.group, self.version, self.rank, msgpack.packb(body, use_bin_type=True))
        who = f" to rank {to}" if to is not None else ""
        try:
            if self._router:
                assert to is not None
                ident = self._ident_of.get(to)
                if ident is None:
                    raise TransportError(f"bucket signal {msg.get('kind')!r}{who}: rank {to} has not said hello")
                self._sock.send_multipart([ident, frame], flags=zmq.NOBLOCK)
            else:
                self._sock.send(frame, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if self._router and exc.errno == zmq.EHOSTUNREACH:
                # ROUTER_MANDATORY: the reader said hello, and its connection is gone since (its
                # process died, mid-transfer): the peer is lost, as a dead peer's pid says elsewhere
                raise PeerLost(f"bucket signal {msg.get('kind')!r}{who} could not be sent: rank {to}'s "
                               f"connection is gone ({exc})", group=self.group, group_version=self.version,
                               rank=self.rank, op=f"bucket signal {msg.get('kind')!r}", peer=to) from exc
            raise TransportError(f"bucket signal {msg.get('kind')!r}{who} could not be sent: {exc}") from exc

    def recv(self, timeout_s: float) -> dict[str, Any] | None:
        """The next message within ``timeout_s`` seconds, or None (also when what arrived was
        dropped as forged). The message carries its sender's rank as ``from``."""
        if not self._poller.poll(max(0, int(timeout_s * 1000))):
            return None
        frames = self._sock.recv_multipart()
        ident = frames[0] if self._router else b""
        expected = 2 if self._router else 1
        if len(frames) != expected:
            return self._refuse(f"{len(frames) - expected + 1} frames, expected one", ident)
        frame = frames[-1]
        if auth.enabled():
            if len(frame) <= auth.TAG_BYTES:
                return self._refuse("shorter than a tag", ident)
            body = frame[: -auth.TAG_BYTES]
        else:
            body = frame
        try:
            msg = _decode(body)
        except ManifestError as exc:
            return self._refuse(str(exc), ident)
        claimed = msg.get("rank")
        if isinstance(claimed, bool) or not isinstance(claimed, int) or not 0 <= claimed < MAX_RANK:
            return self._refuse(f"no sender rank ({short(claimed)})", ident)
        if not self._router and claimed != self.writer:
            return self._refuse(f"claims rank {claimed}, the writer is rank {self.writer}", ident, claimed)
        if auth.verify(self._channel, self.group, self.version, claimed, frame, record_as="signal",
                       endpoint=self.endpoint) is None:
            return None  # recorded by auth
        seq = msg.get("seq")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq <= self._seen.get(claimed, 0):
            return self._refuse(f"sequence number {short(seq)} is not above {self._seen.get(claimed, 0)} "
                                "(a replay)", ident, claimed)
        if self._router:
            known = self._rank_at.get(ident)
            if msg["kind"] == "hello" and known is None:
                if claimed in self._ident_of:
                    return self._refuse(f"a second connection says hello as rank {claimed}", ident, claimed)
                self._ident_of[claimed], self._rank_at[ident] = ident, claimed
            elif known != claimed:
                return self._refuse(f"{msg['kind']!r} claiming rank {claimed} from a connection that said hello "
                                    f"as {known}", ident, claimed)
        self._seen[claimed] = seq
        msg["from"] = claimed
        return msg

    def _refuse(self, problem: str, ident: bytes, claimed: int | str | None = None) -> None:
        """A message that cannot be from a member of the plan: dropped and recorded when the run
        authenticates, a typed error when it does not (then no outsider is told apart anyway)."""
        who = claimed if claimed is not None else f"connection {short(ident)}"
        if auth.enabled():
            auth.record_forged("signal", who, group=self.group, version=self.version, problem=problem[:200])
            return None
        raise ManifestError(f"malformed bucket signal from {who}: {problem}", field="signal", peer=str(who))

    def close(self) -> None:
        self._sock.close(linger=0)


__all__ = ["LOOPBACK", "MAX_SIGNAL_BYTES", "Channel"]
