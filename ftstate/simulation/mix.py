"""Failure mixes (what fails, how often, with what effect on a job: ``member``, ``node``, ``hang``,
``maintenance`` or ``poison``) and the seeded Poisson schedules drawn from them, per GPU-day. The default is
Llama 3's published mix (docs/simulation.md, "The default mix: Llama 3"); no published mix has poisoned nodes,
so ``--poisoned-nodes`` adds them."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping

from ftstate.core.errors import ConfigError

EFFECTS = ("member", "node", "hang", "maintenance", "poison")


@dataclasses.dataclass(frozen=True)
class FailureMix:
    """A named mix: interruptions by cause (cause → (count, effect)) over ``gpu_days``, with ``source``."""

    name: str
    causes: Mapping[str, tuple[int, str]]
    gpu_days: float
    source: str

    def __post_init__(self) -> None:
        for cause, (count, effect) in self.causes.items():
            if effect not in EFFECTS:
                raise ConfigError(f"mix.{cause}", f"effect {effect!r}: expected one of {', '.join(EFFECTS)}")
            if not isinstance(count, int) or count < 0:
                raise ConfigError(f"mix.{cause}", f"count {count!r}: expected an integer >= 0")

    @property
    def total(self) -> int:
        return sum(c for c, _ in self.causes.values())

    @property
    def per_gpu_day(self) -> float:
        """Interruptions per GPU-day, all causes."""
        return self.total / self.gpu_days


LLAMA3 = FailureMix(
    name="llama3",
    causes={
        "faulty GPU": (148, "member"),
        "GPU HBM3 memory": (72, "member"),
        "software bug": (54, "member"),
        "network switch/cable": (35, "node"),
        "host maintenance": (32, "maintenance"),
        "GPU SRAM memory": (19, "member"),
        "GPU system processor": (17, "member"),
        "NIC": (7, "node"),
        "NCCL watchdog timeout": (7, "hang"),
        "silent data corruption": (6, "member"),
        "GPU thermal interface and sensor": (6, "member"),
        "SSD": (3, "node"),
        "power supply": (3, "node"),
        "server chassis": (2, "node"),
        "IO expansion board": (2, "node"),
        "dependency": (2, "member"),
        "CPU": (2, "node"),
        "system memory": (2, "node"),
    },
    gpu_days=54 * 16384,
    source="Dubey et al., The Llama 3 Herd of Models, arXiv:2407.21783 (2024), Table 5: 419 unexpected "
           "interruptions in 54 days on 16,384 H100 GPUs",
)

#: The mixes ``ftstate simulate --mix`` knows, by name.
MIXES = {LLAMA3.name: LLAMA3}


def get_mix(name: str) -> FailureMix:
    try:
        return MIXES[name]
    except KeyError:
        raise ConfigError("mix", f"{name!r}: expected one of {', '.join(sorted(MIXES))}") from None


@dataclasses.dataclass(frozen=True)
class Failure:
    """One failure at ``at`` seconds: ``cause``, ``effect``, and ``pick`` in [0, 1) choosing whom it hits."""

    at: float
    cause: str
    effect: str
    pick: float


def draw_schedule(mix: FailureMix, *, gpus: float, seconds: float, seed: int) -> list[Failure]:
    """A seeded Poisson schedule of failures of ``mix`` on a job of ``gpus`` GPUs over ``seconds``."""
    if gpus <= 0 or seconds < 0:
        raise ConfigError("gpus" if gpus <= 0 else "seconds", "expected a positive number")
    rng = random.Random(seed)
    rate = mix.per_gpu_day * gpus / 86400.0  # failures per second
    causes = list(mix.causes)
    weights = [mix.causes[c][0] for c in causes]
    out: list[Failure] = []
    t = 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= seconds:
            break
        cause = rng.choices(causes, weights)[0]
        out.append(Failure(at=t, cause=cause, effect=mix.causes[cause][1], pick=rng.random()))
    return out


#: The cause a poisoned node is recorded under.
POISON_CAUSE = "poisoned node (crash loop)"


def add_poisoned_nodes(schedule: list[Failure], count: int, *, seconds: float, seed: int) -> list[Failure]:
    """``schedule`` with ``count`` poisoned nodes (effect ``poison``) at seeded uniform times."""
    rng = random.Random(f"poison-{seed}")
    extra = [Failure(at=rng.uniform(0.0, seconds), cause=POISON_CAUSE, effect="poison", pick=rng.random())
             for _ in range(count)]
    return sorted([*schedule, *extra], key=lambda f: f.at)


__all__ = ["EFFECTS", "LLAMA3", "MIXES", "POISON_CAUSE", "Failure", "FailureMix", "add_poisoned_nodes", "draw_schedule", "get_mix"]
