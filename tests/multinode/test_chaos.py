"""Seeded random fault schedules on the session's 3-node cluster (tests/chaos), the invariants
checked after every step: the CI's fixed seeds. A failing seed prints its schedule and the
command that replays it; ``make soak`` runs seeds for hours.

The heartbeats here (0.5 s interval, 3 s timeout) are shorter than ftstate's defaults only to fit
CI's time: a sync still meets members that are unreachable or hung but not yet declared lost
(a sync fails within a second of a node loss). tests/multinode/test_unreachable.py holds the
schedules that found the defect, with the default heartbeats.
"""

from __future__ import annotations

import pytest

from tests.chaos.runner import ChaosRun
from tests.chaos.schedule import draw

pytestmark = pytest.mark.ray

#: The CI seeds and their number of faults (each a whole run: ~1 min on 2 cores).
SEEDS = (1, 2, 3)
FAULTS = 5


@pytest.mark.parametrize("seed", SEEDS)
async def test_a_seeded_fault_schedule_keeps_every_invariant(restore_nodes, tmp_path, seed) -> None:
    schedule = draw(seed, FAULTS)
    outcome = await ChaosRun(restore_nodes, schedule, tmp_path, heartbeat_interval_s=0.5,
                             heartbeat_timeout_s=3.0).run()
    print(outcome.report())
    assert outcome.ok, outcome.report() + f"\nreplay: python -m tests.chaos --seeds {seed} --faults {FAULTS}"
    assert outcome.injected, "the schedule injected nothing"
