"""Multi-sender transfer: every owning trainer rank sends its part straight to every rollout."""

from __future__ import annotations

import concurrent.futures
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ftstate.core.errors import CommunicatorAborted, StateDictError
from ftstate.core.ownership import Ownership, Piece, Shard, piece_key
from ftstate.transport.base import Communicator
from ftstate.transport.checksum import dtype_name, state_checksum
from ftstate.transport.sync import CommittedWeights, OnProgress, Receiver, Sender
from ftstate.transport.validate import check_state_dict


def split_state(state: Any, *, rank: int, member: str, device_type: str | None,
                backend: str = "") -> tuple[dict[str, torch.Tensor], list[Piece]]:
    """A rank's ``state_dict()`` (values: tensors or :class:`Shard`) as its part (key -> tensor)
    and the pieces the controller checks. An empty mapping is a rank that owns nothing."""
    if not isinstance(state, Mapping):
        raise StateDictError(member, None, type(state).__name__, "a Mapping[str, torch.Tensor | ftstate.Shard]")
    flat: dict[str, Any] = {}
    shapes: dict[str, tuple[str, int | None, int, int]] = {}
    for name, value in state.items():
        if isinstance(value, Shard):
            key = piece_key(name, value.dim, value.index)
            flat[key] = value.tensor
            shapes[key] = (name, value.dim, value.index, value.count)
        else:
            flat[name] = value
            shapes[name] = (name, None, 0, 1)
    part = check_state_dict(flat, device_type=device_type, member=member, backend=backend, allow_empty=True)
    pieces = [Piece(name, rank, dtype_name(t.dtype), tuple(t.shape), dim, index, count)
              for key, t in part.items() for name, dim, index, count in [shapes[key]]]
    return part, pieces


class _Parallel:
    """The communicator as one of several concurrent routes sees it: its ``abort`` only
    abandons (no teardown under the other routes' waits, which then end at once with
    CommunicatorAborted); :func:`_run_all` tears the communicator down once, when every
    route has ended."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm
        self.reason: str | None = None

    def abort(self, reason: str) -> None:
        self.reason = self.reason or reason
        self._comm.abandon(reason)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)


def _run_all(fns: Sequence[Callable[[Any], Any]], comm: Communicator) -> list[Any]:
    """Run ``fns(comm)`` in threads, one route each; when one fails the others are abandoned,
    the communicator is aborted once all ended, and the first failure that is not the
    abandonment's echo is raised."""
    if len(fns) == 1:
        return [fns[0](comm)]
    shared = _Parallel(comm)
    with concurrent.futures.ThreadPoolExecutor(len(fns), thread_name_prefix="ftstate-shard") as pool:
        futures = [pool.submit(fn, shared) for fn in fns]
        errors: list[BaseException] = []
        for fut in concurrent.futures.as_completed(futures):
            exc = fut.exception()
            if exc is not None:
                if not errors:
                    comm.abandon(f"a parallel route failed: {type(exc).__name__}")
                errors.append(exc)
    if errors or shared.reason is not None:
        comm.abort(shared.reason or "a parallel route failed")
    if errors:
        causes = [e for e in errors if not isinstance(e, CommunicatorAborted)]
        raise (causes or errors)[0]
    return [f.result() for f in futures]


def send_part(senders: dict[int, Sender], comm: Communicator, peers: Sequence[int], part: Mapping[str, torch.Tensor],
              *, weights_version: int, timeout_s: float, bucket_size: int,
              progress: OnProgress | None = None) -> dict[str, Any]:
    """Send ``part`` to every rank in ``peers`` at once (one Sender per peer, kept in
    ``senders`` between syncs). Returns the part's checksum, bytes per peer and who rejected it."""
    for p in peers:
        if p not in senders:
            senders[p] = Sender(bucket_size=bucket_size)
    reports = _run_all([lambda c, p=p: senders[p].send_to(c, p, part, weights_version=weights_version,
                                                           timeout_s=timeout_s, progress=progress)
                        for p in peers], comm)
    rejected = {r: why for rep in reports for r, why in rep.rejected.items()}
    return {"checksum": reports[0].state_checksum if reports else None,
            "nbytes": reports[0].nbytes if reports else 0, "rejected": rejected}


def receive_parts(receivers: dict[int, Receiver], comm: Communicator, ownership: Ownership, *,
                  timeout_s: float, progress: OnProgress | None = None) -> CommittedWeights:
    """Receive every owning rank's part at once and assemble the full state, staged for the
    caller's commit. Raises what a :class:`Receiver` raises."""
    senders = ownership.senders()
    for r in senders:
        if r not in receivers:
            receivers[r] = Receiver()
    parts = _run_all([lambda c, r=r: receivers[r].receive_from(c, r, timeout_s=timeout_s, progress=progress)
                      for r in senders], comm)
    by_rank = dict(zip(senders, parts, strict=True))
    versions = {p.weights_version for p in parts}
    if len(versions) != 1:
        from ftstate.core.errors import ManifestError

        raise ManifestError(f"rank {comm.rank}: the trainer ranks sent different weights versions "
                            f"{sorted(versions)}", field="weights_version")
    full = assemble(ownership, {r: p.tensors for r, p in by_rank.items()})
    return CommittedWeights(
        tensors=types.MappingProxyType(full),
        weights_version=versions.pop(),
        state_checksum=state_checksum(full),
        group=comm.group,
        group_version=comm.version,
        nbytes=sum(t.numel() * t.element_size() for t in full.values()),
    )


def assemble(ownership: Ownership, parts: Mapping[int, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The full tensors, in ownership order, from each rank's part; a whole tensor is not
    copied, a sliced one is joined with one copy. Checks each slice against the ownership."""
    from ftstate.core.errors import ManifestError

    full: dict[str, torch.Tensor] = {}
    for t in ownership.tensors:
        pieces = []
        for p in t.parts:
            key = piece_key(t.name, t.dim, p.index)
            got = parts.get(p.rank, {}).get(key)
            if got is None:
                raise ManifestError(f"tensor {t.name!r}: rank {p.rank} did not send {key!r}", field="tensors")
            pieces.append(got)
        joined = pieces[0] if t.dim is None else torch.cat(pieces, dim=t.dim)
        if tuple(joined.shape) != t.shape or dtype_name(joined.dtype) != t.dtype:
            raise ManifestError(f"tensor {t.name!r}: assembled {dtype_name(joined.dtype)}{list(joined.shape)}, "
                                f"expected {t.dtype}{list(t.shape)}", field="tensors")
        full[t.name] = joined
    return full


def part_of(ownership: Ownership, full: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """What ``rank`` owned of the full state ``full`` (a rollout's committed version), keyed as
    the rank sent it (:func:`~ftstate.core.ownership.piece_key`): a whole tensor as is, a slice
    cut out along its dim (contiguous: a dim-k slice is a strided view). The recovery of a
    replaced trainer rank: only its part travels, never the whole state."""
    from ftstate.core.errors import ManifestError

    part: dict[str, torch.Tensor] = {}
    for t in ownership.tensors:
        tensor = full.get(t.name)
        if tensor is None or tuple(tensor.shape) != t.shape:
            have = "nothing" if tensor is None else list(tensor.shape)
            raise ManifestError(f"tensor {t.name!r}: this rollout holds {have}, the committed ownership says "
                                f"{list(t.shape)}", field="tensors")
        for p in t.parts:
            if p.rank != rank:
                continue
            part[piece_key(t.name, t.dim, p.index)] = (
                tensor if t.dim is None else tensor.narrow(t.dim, p.start, p.length).contiguous())
    return part


def part_form(ownership: Ownership, part: Mapping[str, torch.Tensor], rank: int) -> dict[str, Any]:
    """``part`` (keyed as it travels) in the form ``rank``'s ``state_dict()`` returned it:
    ``{name: tensor}`` for a whole tensor, ``{name: Shard(slice, dim, index, count)}`` for a
    slice; what a replaced rank's ``load_state_dict`` is given."""
    out: dict[str, Any] = {}
    for t in ownership.tensors:
        for p in t.parts:
            if p.rank != rank:
                continue
            tensor = part[piece_key(t.name, t.dim, p.index)]
            out[t.name] = tensor if t.dim is None else Shard(tensor, t.dim, p.index, len(t.parts))
    return out


__all__ = ["assemble", "part_form", "part_of", "receive_parts", "send_part", "split_state"]
