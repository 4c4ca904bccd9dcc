"""Which of several failures is the cause, for the controller's sync and formation: a death explains its
peers' broken connections, a member's own error the sender's "connection reset", and among transport errors
the first to arrive is the cause and the rest its echoes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ftstate.core.errors import MemberLost, TransportError


def _rank_of_cause(exc: BaseException) -> int:
    if isinstance(exc, MemberLost):
        return 0  # a death explains everything its peers saw
    if not isinstance(exc, TransportError):
        return 1  # a member's own error (user code, a missing library): the real cause
    return 2  # a transport error: the first to fail is the cause, the rest its echoes


def root_cause(failures: Mapping[str, BaseException], order: Sequence[str] = ()) -> dict[str, BaseException]:
    """``failures`` ordered cause first; ``order``: the members in the order their failures arrived."""
    arrival = {name: i for i, name in enumerate(order)}
    return dict(sorted(failures.items(),
                       key=lambda kv: (_rank_of_cause(kv[1]), arrival.get(kv[0], len(arrival)))))
