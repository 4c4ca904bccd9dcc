"""Every kind of audit record, declared once: the writer (:class:`ftstate.core.audit.AuditTrail`)
refuses a kind not declared here, the trail checker reports one, and the views read each kind's
tone and story from here rather than from lists of their own.

Pure data: no Ray, no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

#: How a view shows a record: ``fatal`` and ``fault`` are failures (a run or a member ended),
#: ``warning`` something retried or given up on, ``notice``/``alert`` maintenance that is coming
#: (``alert``: acted on), ``failover`` a member replaced, ``good`` an end that went well,
#: ``start`` a run's first record, ``state`` a transition, ``info`` everything else.
Tone = Literal["fatal", "fault", "warning", "notice", "alert", "failover", "good", "start", "state", "info"]
#: The stories a view can tell from a trail alone (``ftstate audit --failovers``, the
#: maintenance table, the drain bars of the timeline).
Story = Literal["failover", "maintenance", "drain"]


@dataclasses.dataclass(frozen=True, slots=True)
class Kind:
    """One kind of record: its ``event`` name, what it means, and how a view shows it."""

    name: str
    meaning: str
    tone: Tone = "info"
    stories: tuple[Story, ...] = ()


_DECLARED = (
    # written by every state machine and by the audit log itself
    Kind("transition", "a machine changed state (from, to, trigger)", "state"),
    Kind("deadline_expired", "a state's deadline passed before its work ended", "fatal"),
    Kind("budget_spent", "a failover took one unit of the budget", "warning", ("failover",)),
    Kind("budget_exhausted", "the failover budget ran out: the group fails", "fatal", ("failover",)),
    Kind("error", "an actor call or an effect failed without changing the state (yet)", "fault"),
    Kind("run_start", "a run's first record: version, config digest, host", "start"),
    # failover and node loss
    Kind("failover", "a lost member was replaced (lost, replacement, timings)", "failover", ("failover",)),
    Kind("failover_joined", "the replacement joined the group and holds the weights", "info", ("failover",)),
    Kind("node_lost", "every member of a node was lost together", "fault", ("failover",)),
    Kind("node_quarantined", "a node was taken out of placement after repeated losses", "fault", ("failover",)),
    Kind("spare_unavailable", "no spare could be started for a role", "info", ("failover",)),
    Kind("spare_abandoned", "a spare failed while starting or warming and was dropped", "info", ("failover",)),
    Kind("spare_colocated", "a spare had to share a node with a member it covers", "info"),
    Kind("checkpoint_rollback", "the trainer was restored from its last checkpoint", "warning"),
    Kind("trainer_replay", "calls since the last sync were replayed on a new trainer", "info", ("failover",)),
    Kind("trainer_group_formed", "the trainer's ranks formed their group", "info"),
    Kind("trainer_ranks_recovered", "lost trainer ranks were replaced together", "info"),
    Kind("part_restored", "a restored trainer rank reproduced its part of the weights", "info"),
    Kind("ownership_refused", "a rank's claimed parts did not cover the weights exactly once", "fault"),
    Kind("chaos", "the chaos runner (or the demo) killed or hung a process on purpose", "fatal", ("failover",)),
    # retries and give-ups
    Kind("sync_retry", "a sync failed and is retried", "warning", ("failover",)),
    Kind("sync_gave_up", "a sync's retries ran out", "fault", ("failover",)),
    Kind("call_retry", "an actor call failed transiently and is retried", "warning", ("failover",)),
    Kind("transfer_abandoned", "a transfer was cut short because a peer failed", "warning", ("failover",)),
    # groups and transfers
    Kind("group_reform", "the group forms a new version after a change of members", "info"),
    Kind("group_formed", "a group version formed", "info"),
    Kind("group_form_failed", "a group version failed to form", "info"),
    Kind("weights_sent", "the trainer sent a weights version", "info"),
    Kind("weights_loaded", "a member loaded a weights version", "info"),
    Kind("swap_pending", "a weights version is staged at a rollout, waiting for its swap", "info"),
    Kind("swapped", "a rollout swapped to its staged weights between two steps", "info"),
    Kind("shm_fallback", "a same-host transfer fell back to the collective", "info"),
    Kind("node_copy_committed", "a node's shared copy of a version was committed", "info"),
    Kind("node_copy_fallback", "a node's shared copy was not used; its members read otherwise", "info"),
    Kind("node_agent_started", "a node's agent process started", "info"),
    Kind("node_agent_stopped", "a node's agent process stopped", "info"),
    Kind("forged_message", "a message failed its authentication and was dropped", "fault"),
    Kind("oversubscribed", "more workers than CPUs or GPUs were placed on a node", "info"),
    # maintenance and drains
    Kind("maintenance_sources", "where maintenance notices are read from", "info"),
    Kind("maintenance_announced", "the demo's metadata server announced maintenance", "notice", ("maintenance",)),
    Kind("maintenance_notice", "a maintenance notice for a node was read", "alert", ("maintenance",)),
    Kind("maintenance_acknowledged", "a maintenance notice was acknowledged", "info", ("maintenance",)),
    Kind("maintenance_withdrawn", "a maintenance notice was withdrawn", "warning", ("maintenance",)),
    Kind("maintenance_problem", "a notice source could not be read", "warning", ("maintenance",)),
    Kind("maintenance_recovered", "a notice source reads again", "info", ("maintenance",)),
    Kind("drain_started", "a node is being drained ahead of maintenance", "notice", ("drain",)),
    Kind("drain_drained", "a drain moved every member off its node", "good", ("drain",)),
    Kind("drain_failed", "a drain could not move every member", "fault", ("drain",)),
    Kind("drain_cancelled", "a drain was cancelled (its notice withdrawn)", "warning", ("drain",)),
    Kind("drain_reform_failed", "the group could not re-form after a drain", "fault", ("drain",)),
    # the fleet's size
    Kind("scale_add_started", "rollouts are being added", "info"),
    Kind("scale_add_failed", "an addition failed", "warning"),
    Kind("scale_retry", "an addition's step is retried", "warning"),
    Kind("scale_restart", "an addition starts again after a failure", "warning"),
    Kind("rollouts_added", "rollouts were added and serve", "info"),
    Kind("scale_remove_started", "rollouts are being removed", "info"),
    Kind("scale_calls_cut", "calls to removed rollouts were cut", "info"),
    Kind("rollouts_removed", "rollouts were removed", "info"),
    Kind("spares_retired", "spares were retired with a shrink", "info"),
    Kind("replica_removed", "verl's manager removed a replica", "info"),
    # the program that embeds ftstate (a test marks a step of its scenario, say)
    Kind("note", "a mark the embedding program wrote into the trail (``Runtime.audit.record('note', ...)``)"),
    # the demo's own records
    Kind("reward", "the demo's reward for a step", "info"),
    Kind("samples_stamped", "the demo's samples with the weights version that made them", "info"),
)

#: Every declared kind by name.
KINDS: dict[str, Kind] = {k.name: k for k in _DECLARED}
assert len(KINDS) == len(_DECLARED), "a kind is declared twice"


def tone_of(event: str) -> Tone:
    """The tone of ``event`` (``info`` for one not declared, as in an older trail)."""
    kind = KINDS.get(event)
    return kind.tone if kind is not None else "info"


def in_story(story: Story) -> frozenset[str]:
    """The kinds that belong to ``story``."""
    return frozenset(k.name for k in _DECLARED if story in k.stories)


__all__ = ["KINDS", "Kind", "Story", "Tone", "in_story", "tone_of"]
