"""What a user of a plain install does first: run from outside the checkout by
``tests/install/check_plain_install.sh``, in a fresh virtual environment holding only
``torch==2.13.0`` and the ftstate wheel with its declared dependencies (no extras).

``python plain_install_smoke.py names``  imports ``ftstate`` and gets every name of ``ftstate.__all__``.
``python plain_install_smoke.py sync``   runs a real :class:`ftstate.Runtime` on a local Ray cluster,
    fault tolerance off and then on: two syncs each, and after each one every serving rollout
    holds exactly the trainer's weights (``ftstate.transport.state_checksum``).

Exits non-zero with one line naming what failed. The worker classes live in this script's
``__main__``, which Ray's cloudpickle ships to the workers by value, as a user's script would.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import torch

import ftstate
from ftstate.transport import state_checksum

#: The whole Runtime run of one mode, start to close (the script's caller bounds it too).
RUN_LIMIT_S = 150.0


def check_not_from_checkout() -> None:
    """The ftstate imported here is the installed wheel, not the checkout."""
    where = Path(ftstate.__file__).resolve()
    checkout = os.environ.get("FTSTATE_CHECKOUT")
    if checkout and where.is_relative_to(Path(checkout).resolve()):
        sys.exit(f"ftstate was imported from the checkout ({where}), not from the installed wheel")
    if "site-packages" not in where.parts:
        sys.exit(f"ftstate was imported from {where}, not from a site-packages folder")


def check_names() -> None:
    missing = []
    for name in ftstate.__all__:
        try:
            getattr(ftstate, name)
        except Exception as exc:  # noqa: BLE001 - every failing name is reported, then the script fails
            missing.append(f"{name} ({type(exc).__name__}: {exc})")
    if missing:
        sys.exit(f"ftstate.__all__ names that cannot be got: {', '.join(missing)}")
    print(f"{len(ftstate.__all__)} public names of ftstate {ftstate.__version__} imported from {ftstate.__file__}")


# -- a real sync ---------------------------------------------------------------------------

class SmokeTrainer(ftstate.TrainerWorker):
    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.state = {
            "layer.weight": torch.randn(8, 4, generator=g),
            "layer.bias": torch.randn(8, generator=g),
            "head.weight": torch.randn(2, 8, generator=g).to(torch.bfloat16),
            "step": torch.zeros(1, dtype=torch.int64),
        }

    def state_dict(self):
        return self.state

    def load_state_dict(self, state) -> None:
        self.state = {k: v.clone() for k, v in state.items()}

    def train_step(self) -> None:
        with torch.no_grad():
            for t in self.state.values():
                t.add_(1)

    def checksum(self) -> str:
        return state_checksum(self.state)


class SmokeRollout(ftstate.RolloutWorker):
    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.version = 0

    def load_weights(self, state, version: int) -> None:
        self.state = {k: v.clone() for k, v in state.items()}
        self.version = version

    def held(self) -> tuple[int, str]:
        return self.version, state_checksum(self.state)


def smoke_config(fault_tolerance: bool) -> ftstate.RuntimeConfig:
    return ftstate.RuntimeConfig.from_dict(
        {
            "rollout_workers": 2,
            "bucket_size_mb": 1,
            "init_timeout_s": 90,
            "sync_timeout_s": 30,
            "failover_timeout_s": 30,
            "heartbeat_interval_s": 0.5,
            "heartbeat_timeout_s": 10,
            "fault_tolerance": {"enable": fault_tolerance, "mode": "cold", "max_failovers": 1},
        },
        environ={},
    )


async def run_sync(fault_tolerance: bool) -> str:
    cfg = smoke_config(fault_tolerance)
    async with ftstate.Runtime(cfg, trainer=SmokeTrainer, rollout=SmokeRollout, trainer_kwargs={"seed": 7}) as rt:
        versions = []
        for step in range(2):
            if step:
                await rt.trainer("train_step")
            report = await rt.sync()
            expected = await rt.trainer("checksum")
            held = await rt.rollout("held")
            if report.checksum != expected:
                raise AssertionError(f"sync {step + 1}: report checksum {report.checksum} != trainer's {expected}")
            if len(held) != cfg.rollout_workers or report.failovers:
                raise AssertionError(f"sync {step + 1}: {len(held)} rollouts served, {report.failovers} failovers")
            for version, checksum in held:
                if (version, checksum) != (report.weights_version, expected):
                    raise AssertionError(
                        f"sync {step + 1}: a rollout holds version {version} ({checksum}), "
                        f"expected {report.weights_version} ({expected})"
                    )
            versions.append(report.weights_version)
        if versions != [1, 2]:
            raise AssertionError(f"weights versions {versions}, expected [1, 2]")
        return f"{len(held)} rollouts hold versions {versions}, last checksum {expected}"


async def check_sync() -> None:
    from ftstate.controller.ray import cluster

    started = cluster.connect(None, num_cpus=2)  # one local cluster for both runs
    try:
        for ft in (False, True):
            t0 = time.monotonic()
            try:
                what = await asyncio.wait_for(run_sync(ft), RUN_LIMIT_S)
            except TimeoutError:
                sys.exit(f"sync with fault_tolerance.enable={ft}: no result within {RUN_LIMIT_S:.0f}s")
            print(f"sync with fault_tolerance.enable={ft}: {what} ({time.monotonic() - t0:.1f}s)")
    finally:
        if started:
            cluster.shutdown()


def main(argv: list[str]) -> None:
    check_not_from_checkout()
    if argv == ["names"]:
        check_names()
    elif argv == ["sync"]:
        asyncio.run(check_sync())
    else:
        sys.exit(f"usage: {Path(__file__).name} names|sync")


if __name__ == "__main__":
    main(sys.argv[1:])
