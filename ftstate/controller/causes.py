"""Which of several failures is the cause: a sync's or a group formation's members fail
together, and the caller is told one error, the one that explains the others.

A member that died explains its peers' broken connections; a member's own error (a bug in
user code, a missing library) explains the sender's "connection reset"; among transport
errors the first to arrive is the cause and the rest its echoes.
"""

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
    """``failures`` ordered cause first (see the module docstring). ``order``: the members
    in the order their failures arrived; among transport errors the first one is the cause
    (the others were abandoned because of it, or saw its broken connection)."""
    arrival = {name: i for i, name in enumerate(order)}
    return dict(sorted(failures.items(),
                       key=lambda kv: (_rank_of_cause(kv[1]), arrival.get(kv[0], len(arrival)))))
