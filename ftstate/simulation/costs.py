"""What each modelled step of a simulated member costs, in seconds of virtual time.

The defaults are this project's own measurements on 2 CPU cores (DESIGN.md, "Facts measured",
and ``docs/benchmarks.md``); every one can be given on the command line of ``ftstate
simulate`` or to :class:`Costs` directly. Where a figure depends on the weights' size it is a
rate (bytes per second), applied to :attr:`Costs.weights_bytes`.
"""

from __future__ import annotations

import dataclasses

from ftstate.core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Costs:
    """Modelled costs (seconds unless named otherwise).

    call_s: one actor round trip (Ray: ~3 ms). death_detect_s: from a process's death to the
    failure of its pending calls (Ray: 15-20 ms after a SIGKILL). start_s: a new worker
    process up and its class built (the new actor importing torch: 2.3-2.6 s, 3.0 s with its
    first answer). group_form_s: a new group version formed once every rank joined (gloo:
    0.02-0.03 s). bandwidth_Bps: a weights transfer's rate (gloo broadcast of 256 MB at world
    2: ~2 GB/s); a broadcast takes ``weights_bytes / bandwidth_Bps`` plus ``hop_s`` per
    doubling of the group and ``receiver_s`` per receiver (a transfer's fixed cost whatever its
    size, per receiver: the sender's buckets, manifest and checksums for each, each receiver's
    proof, on CPUs they share; 0 by default, where the bytes dominate; the agreement test fits
    it to a real run of tiny weights, where it is all there is). load_Bps: a rollout's ``load_weights`` of the staged version
    (memory copy). weights_bytes: the model's weights. train_step_s: one trainer step (a user
    call between syncs). bucket_bytes: the transport's bucket (its progress counter moves
    once a bucket). unreachable_s: a call to an actor on a lost node fails as unreachable after this
(Ray: 1-2 s with ``ActorUnavailableError``; the calls already pending stay pending); node_dead_s:
when Ray declares the lost node dead and its actors' calls fail as dead (its health check:
~15 s). jitter: each answer's time is stretched by a seeded draw in
    ``[0, jitter)`` of itself (answers of many members trickle in, as real ones do).
    """

    call_s: float = 0.003
    death_detect_s: float = 0.015
    start_s: float = 3.0
    group_form_s: float = 0.025
    bandwidth_Bps: float = 2e9
    hop_s: float = 0.001
    receiver_s: float = 0.0
    load_Bps: float = 10e9
    weights_bytes: int = 256 * 2**20
    train_step_s: float = 10.0
    bucket_bytes: int = 64 * 2**20
    jitter: float = 0.5
    unreachable_s: float = 1.5
    node_dead_s: float = 15.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"costs.{field.name}", f"{value!r}: expected a number >= 0")
        for name in ("bandwidth_Bps", "load_Bps", "weights_bytes", "bucket_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"costs.{name}", f"{getattr(self, name)!r}: expected a number > 0")

    def transfer_s(self, world: int = 2) -> float:
        """One transfer of the weights to a group of ``world`` ranks (point to point: 2)."""
        return (self.receiver_s * (max(world, 2) - 1) + self.weights_bytes / self.bandwidth_Bps
                + self.hop_s * max(1, (max(world, 2) - 1).bit_length()))

    def load_s(self) -> float:
        return self.weights_bytes / self.load_Bps

    def bucket_s(self) -> float:
        """The time one bucket of a transfer takes (how often a busy member's progress moves)."""
        return max(1e-6, min(self.bucket_bytes, self.weights_bytes) / self.bandwidth_Bps)


__all__ = ["Costs"]
