"""What each modelled step of a simulated member costs, in seconds of virtual time; defaults are this
project's measurements (docs/simulation.md, "The modelled costs' defaults"), each settable from ``ftstate
simulate``. Size-dependent costs are rates applied to :attr:`Costs.weights_bytes`."""

from __future__ import annotations

import dataclasses

from ftstate.core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Costs:
    """Modelled costs, in seconds unless named otherwise: ``call_s`` (a round trip), ``death_detect_s``,
    ``start_s``, ``group_form_s``; ``bandwidth_Bps`` and ``load_Bps`` (bytes/s) with ``hop_s`` per doubling of
    the group and ``receiver_s`` per receiver; ``weights_bytes``, ``bucket_bytes``; ``train_step_s``;
    ``unreachable_s`` and ``node_dead_s`` for a lost node's calls; ``jitter`` stretches each answer by a
    seeded fraction in ``[0, jitter)``."""

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
