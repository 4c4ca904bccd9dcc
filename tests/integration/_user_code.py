"""User worker classes that fail in their own code, the way a new user's first program does
(imported by the Ray worker processes; the tests check that errors name this file)."""

from __future__ import annotations

import os

from tests.integration.workers import TinyRollout, TinyTrainer


class TrainerThatCannotOpenItsModel(TinyTrainer):
    """Its constructor raises (the file it loads is not there), with a coloured message as a
    library's logger might make it."""

    def __init__(self, path: str = "/data/model.pt") -> None:
        raise RuntimeError(f"cannot open {path} \x1b[31m(no such file)\x1b[0m")


class RolloutThatFailsToLoad(TinyRollout):
    """``load_weights`` raises from version ``fail_from`` on, in every process."""

    def __init__(self, fail_from: int = 2) -> None:
        super().__init__()
        self.fail_from = fail_from

    def load_weights(self, state, version: int) -> None:
        if version >= self.fail_from:
            raise ValueError(f"shape mismatch in my engine at version {version}")
        super().load_weights(state, version)


class RolloutWhoseSparesCannotStart(TinyRollout):
    """Constructs normally until ``marker`` exists, then raises: a replacement that can never
    be built (its engine refuses to start)."""

    def __init__(self, marker: str) -> None:
        if os.path.exists(marker):
            raise OSError(f"engine refused to start: device busy ({os.path.basename(marker)})")
        super().__init__()


class TrainerWhoseStateDictRaises(TinyTrainer):
    def state_dict(self):
        raise KeyError("optimizer.param_groups")


class RolloutCountingShards(TinyRollout):
    """``generate_all`` answers a shard and remembers every shard size it was called with;
    ``boom`` raises in every rollout."""

    def __init__(self) -> None:
        super().__init__()
        self.shards: list[int] = []

    def generate_all(self, prompts: list[str]) -> list[str]:
        self.shards.append(len(prompts))
        return [p.upper() for p in prompts]

    def shard_sizes(self) -> list[int]:
        return list(self.shards)

    def boom(self) -> None:
        raise RuntimeError(f"engine crashed in pid {os.getpid()}")

    def generate_one_short(self, prompts: list[str]) -> list[str]:
        """Answers one result fewer than it was given prompts (a bug rt.rollout_map must name)."""
        return [p.upper() for p in prompts][:-1]


class TrainerThatCannotTakeWeightsBack(TinyTrainer):
    """``load_state_dict`` raises in every process (its model renamed a parameter): every
    replacement, rebuilt from a rollout, fails the same way."""

    def load_state_dict(self, state) -> None:
        raise RuntimeError("cannot load: parameter 'layer.weight' was renamed to 'layer.w'")


class RolloutWhoseNewcomersCannotLoad(TinyRollout):
    """``load_weights`` raises in a process constructed while ``marker`` exists: a replacement
    whose engine rejects the current weights at its resync."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self._refuses = os.path.exists(marker)

    def load_weights(self, state, version: int) -> None:
        if self._refuses:
            raise ValueError(f"engine rejects weights version {version}: dtype bfloat16 expected")
        super().load_weights(state, version)
