"""The runtime's configuration: every knob, its default, its bounds and what it means.

Each field is declared once, here, with its documentation and its constraints in the
field's metadata; validation, ``ftstate config`` (the commented default) and
docs/configuration.md are all generated from these declarations, so they cannot drift (the
generic walker that builds, checks and describes them is :mod:`ftstate.core.configfields`).
Pure data: it runs in every process that holds a config (the driver, the CLI, each worker).

``RuntimeConfig.from_dict`` / ``from_yaml`` reject unknown keys, wrong types, out-of-range
values and impossible combinations with a :class:`~ftstate.core.errors.ConfigError` whose
message starts with the field's dotted path, e.g.
``fault_tolerance.max_failovers: must be >= 0, got -1``.

Config files are read as untrusted input: at most :data:`MAX_CONFIG_BYTES`, YAML aliases
refused (``&a`` / ``*a`` would let a few hundred bytes expand to gigabytes), nesting at most
:data:`MAX_CONFIG_DEPTH` deep, numbers finite, and every value an error quotes is shortened
with :mod:`reprlib`, so a hostile file gets a one-line ConfigError, never a MemoryError.

The one environment override is ``FTSTATE_INIT_TIMEOUT_S`` for ``init_timeout_s`` (the
value operators most often need to raise on a slow cluster without editing a file); it
wins over the file, like torchft's ``TORCHFT_*`` overrides.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from ftstate.core.configfields import (
    MAX_CONFIG_BYTES,
    MAX_CONFIG_DEPTH,
    build,
    config_field,
    convert,
    hint_of,
    load_yaml,
    walk_fields,
)
from ftstate.core.configfields import describe as describe_fields
from ftstate.core.configfields import sections as section_docs
from ftstate.core.errors import ConfigError
from ftstate.core.text import short_repr

#: The maintenance-notice sources ``fault_tolerance.maintenance_sources`` may name.
MAINTENANCE_SOURCES = ("gce", "aws", "azure", "ray", "file")
#: The sources that poll an HTTP metadata endpoint (``fault_tolerance.maintenance_endpoints``).
METADATA_SOURCES = ("gce", "aws", "azure")


@dataclasses.dataclass(frozen=True)
class FaultToleranceConfig:
    """The ``fault_tolerance`` block; field names follow verl's so its users find them."""

    enable: bool = config_field(
        False,
        "Replace lost workers instead of failing the run. Off: the first loss fails fast "
        "with a typed error naming the dead member.",
    )
    mode: Literal["standby", "cold"] = config_field(
        "standby",
        "standby: keep prewarmed spare actors and promote one on a loss; cold: start a "
        "fresh actor on demand (slower: the new process must import torch and build the model).",
    )
    standby_resource_pool: str = config_field(
        "standby", "Name of the Ray resource pool (placement group) the spare actors are placed in."
    )
    standby_workers: int = config_field(
        1, "Prewarmed spares kept per role in standby mode: the losses of a role covered at spare speed "
        "within one refill window (a promoted spare is replaced at once, but the new one takes seconds to warm: "
        "a further loss meanwhile waits for it, or starts a fresh actor). Rollout spares follow the fleet: "
        "as rt.add_rollouts / remove_rollouts change it, standby_workers spares per rollout_workers rollouts "
        "(rounded up, at least one) are kept, started or retired at each change.", ge=0)
    trainer_ranks_per_spare: int = config_field(
        8,
        "Standby mode with several trainer ranks: standby_workers trainer spares per this many "
        "ranks (rounded up), so the ranks of one node lost at once find warm spares.",
        ge=1,
    )
    detect_node_maintenance: bool = config_field(
        False,
        "Watch for maintenance and preemption notices (maintenance_sources: the cloud's metadata "
        "server on each node that hosts members, Ray's draining nodes, an operator's notice file) "
        "and drain a node's members before it goes: replacements elsewhere get the current weights "
        "first, then the members are retired. A drain spends nothing of max_failovers.",
    )
    maintenance_check_interval: float = config_field(
        5.0, "Seconds between two polls of the maintenance notice.", gt=0
    )
    maintenance_sources: list[str] = config_field(  # noqa: RUF009
        ["auto"],
        "Which maintenance watchers run: any of gce, aws, azure (the node's cloud metadata service), "
        "ray (nodes Ray is draining: ray drain-node, the autoscaler, KubeRay on SIGTERM) and file "
        "(maintenance_file), or [auto] (also written auto or []): ray, plus the cloud the node turns "
        "out to be on (read from its DMI identity, without a network request), plus any source given "
        "an endpoint in maintenance_endpoints or its provider's environment variable, plus file when "
        "maintenance_file is set. Off any cloud, auto records that once and stays quiet.",
        choices=(*MAINTENANCE_SOURCES, "auto"),
    )
    maintenance_endpoints: dict[str, str] = config_field(  # noqa: RUF009
        {},
        "Metadata endpoint per cloud source (gce, aws, azure), e.g. {gce: 'http://10.0.0.2:8080'}. "
        "Without one, a watcher takes the provider's environment variable on its node "
        "(GCE_METADATA_HOST, AWS_EC2_METADATA_SERVICE_ENDPOINT), else the provider's address "
        "(metadata.google.internal, 169.254.169.254).",
        keys=METADATA_SOURCES,
    )
    maintenance_file: str | None = config_field(
        None,
        "Path of a file an operator or a scheduler writes a notice to, as JSON: {kind, deadline "
        "(epoch seconds or RFC 3339), node}; no file is no notice. Required by the file source.",
    )
    maintenance_request_timeout_s: float = config_field(
        2.0,
        "Bound of every metadata request (connect, send, answer), end to end; a request past it is "
        "a warning in the audit trail, never a notice. One poll makes at most a few requests and "
        "stops at the first that finds the server unreachable or silent.",
        gt=0,
    )
    reverse_weight_sync: bool = config_field(
        False,
        "Recover a lost trainer's weights from a rollout that holds the last committed "
        "version (checksum-proven) instead of from a checkpoint directory.",
    )
    max_failovers: int | None = config_field(
        None,
        "Failovers (members replaced; a node lost whole is one) the whole run may spend; the next "
        "loss after that fails the run with FailoverBudgetExhausted. None: no total, only the "
        "window's limits below (a run of weeks loses GPUs steadily). Set, it also bounds how often "
        "one user call cut short by a loss is made again (else max_failovers_per_window does).",
        ge=0,
    )
    failover_window_s: float = config_field(
        3600.0,
        "The sliding window the limits below count over: a failure older than this no longer "
        "counts against max_failovers_per_window, max_slot_failovers or max_node_failures.",
        gt=0,
    )
    max_failovers_per_window: int = config_field(
        20,
        "Failovers the run may spend inside any failover_window_s; one more fails the run with "
        "FailoverBudgetExhausted (failures come faster than replacements can heal them).",
        ge=0,
    )
    max_slot_failovers: int = config_field(
        3,
        "Times one member slot (a role and rank) may be replaced inside failover_window_s; one "
        "more fails the run with CrashLoop naming the slot and its class (every replacement dies).",
        ge=1,
    )
    max_node_failures: int = config_field(
        3,
        "Members (spares too) a node may lose inside failover_window_s before it is quarantined: "
        "nothing is placed there again and its remaining members are drained off it.",
        ge=1,
    )
    optimizer_state: Literal["reset", "checkpoint"] = config_field(
        "reset",
        "What a trainer rebuilt from a rollout does about optimizer state, which no rollout holds: "
        "reset it (reset_optimizer()) or load it from checkpoint_dir (load_optimizer_checkpoint(path)); "
        "the weights still come from the rollout.",
    )
    checkpoint_dir: str | None = config_field(
        None,
        "Checkpoint folder a replaced trainer loads from: weights and optimizer "
        "(load_checkpoint(path)) when reverse_weight_sync is false, the optimizer only "
        "(load_optimizer_checkpoint(path)) when optimizer_state is 'checkpoint'.",
    )
    allow_lossy_recovery: bool = config_field(
        False,
        "Let reverse_weight_sync rebuild a trainer whose state_dict() is a lossy view of its master "
        "weights (TrainerWorker.lossy_state_dict, e.g. bf16 copies of fp32 masters). Off: refused "
        "with LossyRecoveryRefused.",
    )
    allow_checkpoint_rollback: bool = config_field(
        False,
        "Let a trainer rebuilt from checkpoint_dir be admitted when the checkpoint's weights (the "
        "checksum of its state_dict() after load_checkpoint) are not the current weights version: an "
        "older committed version, or none. The run then goes on from the checkpoint, and the trainer "
        "calls since the last sync are not replayed (a checkpoint_rollback record says so). Off: "
        "refused with StaleCheckpointRefused, never a silent rollback.",
    )
    resync_retries: int = config_field(
        3,
        "Times a failover makes the point-to-point transfer to a newcomer again after it failed "
        "without a death (a corrupted bucket, a dropped connection), or forms the group version "
        "again after a survivor that could not be reached answered again; past that the failover "
        "fails with that error.",
        ge=0,
    )
    spare_start_attempts: int = config_field(
        3,
        "Spares of one role that may die in a row before ever getting warm (a constructor or a "
        "node that keeps failing) before no more are started for that role (spare_unavailable "
        "in the trail); a later loss then starts a fresh actor or shrinks the group.",
        ge=1,
    )
    min_rollout_workers: int = config_field(
        1,
        "With no replacement possible, the group carries on degraded while at least this "
        "many rollouts serve; below it the run fails.",
        ge=1,
    )

    @property
    def call_retries(self) -> int:
        """How often one user call cut short by a loss is made again: ``max_failovers`` when set,
        else ``max_failovers_per_window`` (more tries than the window allows cannot all heal)."""
        return self.max_failovers if self.max_failovers is not None else self.max_failovers_per_window


Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


@dataclasses.dataclass(frozen=True)
class RolePlacement:
    """Where one role's workers go: a Ray placement group per role (one bundle per worker)."""

    strategy: Strategy = config_field(  # noqa: RUF009
        "SPREAD",
        "Ray placement-group strategy for the role's bundles. SPREAD puts them on as many nodes as "
        "have room (and packs them on one node when that is all there is); PACK keeps them together; "
        "the STRICT_ forms fail the start (within init_timeout_s) rather than bend.",
    )
    resources: dict[str, float] = config_field(  # noqa: RUF009
        {},
        "Custom Ray resources each worker of the role asks for besides worker_cpus/worker_gpus, "
        "e.g. {rollout_node: 1} to keep rollouts on nodes started with that resource.",
    )
    labels: dict[str, str] = config_field(  # noqa: RUF009
        {},
        "Ray node labels each worker's node must carry (a bundle label selector, Ray's syntax: "
        "value, !value, in(a,b), !in(a,b)), e.g. {ftstate-pool: rollout}.",
    )


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    """The ``placement`` block: per role, where its workers may run. Spares (standby) are also
    kept off the nodes of the members they cover whenever the cluster allows."""

    trainer: RolePlacement = config_field(RolePlacement, "The trainer's placement.")  # noqa: RUF009
    rollout: RolePlacement = config_field(RolePlacement, "The rollouts' placement.")  # noqa: RUF009
    standby: RolePlacement = config_field(  # noqa: RUF009
        RolePlacement, "The spares' placement (the standby resource pool, fault_tolerance.mode: standby)."
    )


@dataclasses.dataclass(frozen=True)
class SecurityConfig:
    """The ``security`` block: who may take part in a run's weight sync (docs/security.md)."""

    authenticate: bool = config_field(
        True,
        "A secret made per run at start() and handed to every member through Ray; every store value, "
        "zmq signal, manifest, seal, offer and vote carries a MAC bound to the run, group version and "
        "sender rank, and one that does not verify is dropped and audited as forged_message.",
    )
    integrity: Literal["xxh3", "keyed"] = config_field(
        "xxh3",
        "Per-bucket and per-tensor digests. xxh3: fast checksums, catch damage, not forgery (the seal "
        "that carries them is MAC'd when authenticate is on). keyed: BLAKE3 keyed with the run's "
        "secret, so bytes injected into gloo or a slot by anyone without it cannot match (needs "
        "authenticate); a receiver then hashes each byte once, keyed, and takes its per-tensor "
        "checksums from the verified seal. Costs about 2x the xxh3 sync's CPU on 2 cores "
        "(docs/security.md), hence not the default.",
    )


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """Everything a :class:`~ftstate.Runtime` needs to start, sync and recover."""

    trainer_workers: int = config_field(1, "Trainer ranks; each sends what its state_dict() owns (more than 1: gloo, collective route; a replaced rank gets its part back from a rollout).", ge=1)
    rollout_workers: int = config_field(2, "Rollout (inference) actors that receive the weights.", ge=1)
    backend: Literal["gloo", "nccl"] = config_field(
        "gloo", "Collective backend: gloo (CPU, torch) or nccl (GPU, through cupy; extra ftstate[gpu])."
    )
    bucket_size_mb: float = config_field(
        256.0, "Size of one broadcast bucket in MiB (larger tensors are chunked), and of one part of "
               "a device engine's load from the host (at most 2 buckets of device memory beside its "
               "weights). Smaller: less staging and device memory, more copies and calls.", gt=0
    )
    shared_memory: Literal["auto", "off", "require"] = config_field(
        "auto",
        "Same-host route of a sync. auto: rollouts on the trainer's node read each bucket from shared"
        " memory, and on every other node one relay gets it over the collective and shares it there; "
        "where a segment cannot be made the collective is taken and the trail says why "
        "(shm_fallback). off: always the collective. require: such a sync fails with "
        "SharedMemoryUnavailable instead.",
    )
    staging: Literal["private", "node"] = config_field(
        "private",
        "Where a rollout stages an incoming version until the vote commits it. private: a buffer of "
        "its own (about 2x the weights per rollout beside its engine's). node: one shared-memory copy"
        " per node that every rollout there verifies in place and that newcomers there resync from "
        "(1x the weights per node at rest, 2x during a sync); where a node copy cannot be had the "
        "sync stages privately and the trail says why. Needs shared_memory auto or require "
        "(docs/operations.md, 'The same-host route').",
    )
    node_copy_spare: bool = config_field(
        False,
        "staging: node only. false: every sync allocates a fresh node copy (its first touch on the "
        "sync's path); true: the previous copy is kept and rewritten as the next (2x the weights per "
        "node at rest).",
    )
    staging_spare: bool = config_field(
        False,
        "A rollout staging privately whose engine holds its weights (held_weights()): keep the "
        "staging buffer for the next sync (1x the weights at rest) instead of letting it go after "
        "each load. Choose true where touching fresh memory is dear (hosts that return freed pages to"
        " a hypervisor).",
    )
    resync_shared_memory_min_mb: float = config_field(
        1024.0,
        "A newcomer on its source's node is resynced through shared memory only for weights of at "
        "least this many MiB; smaller ones take the collective (cheaper there: docs/benchmarks.md, "
        "'Failover tails'). 0: always shared memory.",
        ge=0,
    )
    worker_cpus: float = config_field(
        0.01,
        "CPUs each worker reserves in its resource pool (Ray's logical CPUs; the default is a "
        "token share so a laptop runs everything; reserve real cores on a cluster).",
        gt=0,
    )
    worker_gpus: float = config_field(0.0, "GPUs each worker reserves (1 for nccl on a GPU cluster).", ge=0)
    address: str | None = config_field(
        None, "Ray cluster address to join (e.g. 'auto' or 'ray://head:10001'); none starts a local cluster."
    )
    audit_log: str | None = config_field(
        None, "Path of the JSON-lines audit trail; none keeps it in memory only (the latest "
        "audit_records_kept records)."
    )
    audit_records_kept: int = config_field(
        50_000, "Audit records the runtime keeps in memory (Runtime.audit.records, what the tests and "
        "views read), the latest ones: the list is cut back to this many once it holds twice as many, so "
        "a run of any length holds at most 2x this many (a record is about 1 KB; a sync writes about "
        "two per member: 20,000 at 10,000 members). The audit_log file keeps every record. 0: none.",
        ge=0,
    )
    init_timeout_s: float = config_field(
        600.0,
        "First rendezvous of a group version: every rank joined and the first barrier passed.",
        gt=0,
        env="FTSTATE_INIT_TIMEOUT_S",
    )
    sync_timeout_s: float = config_field(600.0, "One weight sync, end to end.", gt=0)
    failover_timeout_s: float = config_field(
        120.0, "From a loss being detected to its replacement serving the current weights.", gt=0
    )
    sync_retries: int = config_field(
        2,
        "With fault tolerance on, times one sync() is tried again after a transient failure "
        "(a transport error or an unanswered call) with nobody lost. A retry after a loss that "
        "was replaced or shrunk away is not counted here: each one spends max_failovers. Any "
        "other error (user code raising, bad input) is raised at once, as is the transient "
        "error past this bound.",
        ge=0,
    )
    gc_pause_s: float = config_field(
        30.0,
        "The controller's garbage collector is paused while a sync, a heartbeat round or a failover "
        "round runs, for at most this many seconds each time; 0: never. At thousands of members this "
        "keeps full collections off those paths (docs/benchmarks.md, 'Controller at scale').",
        ge=0,
    )
    held_weights_proof: Literal["every_sync", "admission"] = config_field(
        "every_sync",
        "When a rollout whose engine keeps its own copy (held_weights()) is proven by hashing what it"
        " returns. every_sync: after every load. admission: at admission to serving (a first load, a "
        "resync, a re-admission, the load after a failed proof) and a held_weights_proof_fraction of "
        "the other loads. A rollout without the hook hashes what it was given every time.",
    )
    held_weights_proof_fraction: float = config_field(
        0.0,
        "With held_weights_proof: admission, the fraction (0 to 1) of the other loads proven too, drawn "
        "per rollout and weights version from the run id (the same draws on a replay of the trail).",
        ge=0,
    )
    rollout_updates: Literal["barrier", "in_flight"] = config_field(
        "barrier", "How a committed version reaches a rollout busy in a call. barrier: the commit waits for the call "
        "to end. in_flight: it loads at the call's next safe_point() or its end (docs/concepts.md).")
    max_staleness: int = config_field(
        1, "in_flight: how many versions behind a rollout may be and still be given calls.", ge=0)
    safe_point_timeout_s: float = config_field(
        60.0, "in_flight: how long a rollout may hold a committed version back before it is suspected.", gt=0)
    remove_calls_timeout_s: float = config_field(
        60.0, "rt.remove_rollouts: how long a rollout taken out of serving may finish the calls it is running "
        "before its process is stopped; a call still running then ends with MemberLost (dealt again over the "
        "serving rollouts with fault tolerance on).", gt=0)
    heartbeat_interval_s: float = config_field(1.0, "Seconds between two heartbeats of a worker; bounds each heartbeat call "
                                         "(a node agent's reply for its members: two intervals).", gt=0)
    heartbeat_agent_min_members: int = config_field(
        4,
        "A node with at least this many members (a lone member excepted) has their heartbeats asked, "
        "and a sync's calls made, through one call of its liveness agent (a small actor, no CPU); "
        "fewer are asked directly. 0: never an agent.",
        ge=0,
    )
    heartbeat_timeout_s: float = config_field(
        10.0,
        "A worker with no heartbeat showing progress for this long is declared lost "
        "(it is suspect from the first missed interval).",
        gt=0,
    )
    fault_tolerance: FaultToleranceConfig = config_field(FaultToleranceConfig, "Failover settings.")  # noqa: RUF009
    placement: PlacementConfig = config_field(PlacementConfig, "Where workers run on a multi-node cluster.")  # noqa: RUF009
    security: SecurityConfig = config_field(SecurityConfig, "Authentication of the weight-sync path.")  # noqa: RUF009

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None = None, *, environ: Mapping[str, str] | None = None) -> RuntimeConfig:
        """Build and validate a config from plain data; environment overrides apply on top.

        ``environ`` defaults to ``os.environ``; pass ``{}`` to ignore the environment.
        """
        cfg = build(cls, {} if data is None else data, "")
        env = os.environ if environ is None else environ
        for path, f in walk_fields(cls):
            var = f.metadata.get("env")
            if var and var in env:
                value = convert(f, hint_of(cls, path), env[var], f"{path} (from env {var})", from_env=True)
                cfg = cfg.replace(**{path: value})
        cfg._check_combinations()
        return cfg

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None) -> RuntimeConfig:
        """Load a YAML file; errors name the file and the field."""
        import yaml

        p = Path(path)
        try:
            with p.open("rb") as fh:
                raw = fh.read(MAX_CONFIG_BYTES + 1)
        except FileNotFoundError as exc:
            raise ConfigError("", f"{p}: no such config file") from exc
        except OSError as exc:
            raise ConfigError("", f"{p}: cannot be read: {exc.strerror or exc}") from exc
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError("", f"{p}: larger than {MAX_CONFIG_BYTES} bytes, not a config file")
        try:
            data = load_yaml(raw.decode("utf-8"), str(p))
        except UnicodeDecodeError as exc:
            raise ConfigError("", f"{p}: not UTF-8 text (byte {exc.start})") from exc
        except yaml.YAMLError as exc:
            raise ConfigError("", f"{p}: not valid YAML: {str(exc)[:300]}") from exc
        except RecursionError as exc:  # pragma: no cover - MAX_CONFIG_DEPTH stops it first
            raise ConfigError("", f"{p}: nested too deeply") from exc
        if data is not None and not isinstance(data, Mapping):
            raise ConfigError("", f"{p}: expected a mapping at the top level, got {type(data).__name__}")
        try:
            return cls.from_dict(data, environ=environ)
        except ConfigError as exc:
            raise ConfigError(exc.path, f"{exc.problem} (in {p})") from exc

    def replace(self, **dotted: Any) -> RuntimeConfig:
        """A copy with fields changed, by dotted path (``fault_tolerance.enable=True``)."""
        nested: dict[str, dict[str, Any]] = {}
        top: dict[str, Any] = {}
        for key, value in dotted.items():
            head, _, rest = key.partition(".")
            if rest:
                nested.setdefault(head, {})[rest] = value
            else:
                top[key] = value
        for head, changes in nested.items():
            top[head] = dataclasses.replace(getattr(self, head), **changes)
        return dataclasses.replace(self, **top)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """16 hex digits of the sha256 of the config's canonical JSON: two runs of one config
        compare equal, and any setting that differs tells them apart (a run's first record)."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def spares(self, role: str, rollouts: int | None = None) -> int:
        """Prewarmed spares kept for ``role`` in standby mode (0 otherwise): ``standby_workers``,
        and for the trainer ranks that many per ``trainer_ranks_per_spare`` ranks. ``rollouts``:
        the fleet's size now (it grows and shrinks: ``rt.add_rollouts``); the rollout spares keep
        the configured ratio, ``standby_workers`` per ``rollout_workers``, rounded up, at least one."""
        ft = self.fault_tolerance
        if not (ft.enable and ft.mode == "standby"):
            return 0
        if role == "trainer":
            return ft.standby_workers * -(-self.trainer_workers // ft.trainer_ranks_per_spare)
        if rollouts is None or rollouts == self.rollout_workers or not ft.standby_workers:
            return ft.standby_workers
        return max(1, -(-ft.standby_workers * rollouts // self.rollout_workers))

    def get(self, dotted: str) -> Any:
        """The value at a dotted path, e.g. ``cfg.get('fault_tolerance.max_failovers')``."""
        value: Any = self
        for part in dotted.split("."):
            value = getattr(value, part)
        return value

    def _check_combinations(self) -> None:
        if self.security.integrity == "keyed" and not self.security.authenticate:
            raise ConfigError("security.integrity",
                              "'keyed' needs security.authenticate: true (the key is the run's secret)")
        if self.held_weights_proof_fraction > 1:
            raise ConfigError("held_weights_proof_fraction",
                              f"must be <= 1 (a fraction of the loads), got {self.held_weights_proof_fraction:g}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                "heartbeat_timeout_s",
                f"must be greater than heartbeat_interval_s ({self.heartbeat_interval_s:g}), "
                f"got {self.heartbeat_timeout_s:g}",
            )
        if self.staging == "node" and self.shared_memory == "off":
            raise ConfigError("staging", "'node' needs shared_memory auto or require (the node copy is shared memory)")
        if self.node_copy_spare and self.staging != "node":
            raise ConfigError("node_copy_spare", "true needs staging: node (it keeps a spare node copy)")
        ft = self.fault_tolerance
        if ft.min_rollout_workers > self.rollout_workers:
            raise ConfigError(
                "fault_tolerance.min_rollout_workers",
                f"must be <= rollout_workers ({self.rollout_workers}), got {ft.min_rollout_workers}",
            )
        if ft.standby_resource_pool in ("trainer", "rollout"):
            raise ConfigError(
                "fault_tolerance.standby_resource_pool",
                f"must differ from the role pools 'trainer' and 'rollout', got {short_repr(ft.standby_resource_pool)}",
            )
        if "file" in ft.maintenance_sources and ft.maintenance_file is None:
            raise ConfigError("fault_tolerance.maintenance_file", "required when maintenance_sources names 'file'")
        for source, url in ft.maintenance_endpoints.items():
            if not url.startswith(("http://", "https://")):
                raise ConfigError(
                    f"fault_tolerance.maintenance_endpoints.{source}", f"must be an http:// or https:// URL, got {short_repr(url)}"
                )
        if ft.optimizer_state == "checkpoint" and ft.checkpoint_dir is None:
            raise ConfigError("fault_tolerance.checkpoint_dir", "required when optimizer_state is 'checkpoint'")
        if ft.enable and ft.mode == "standby" and ft.standby_workers == 0:
            raise ConfigError(
                "fault_tolerance.standby_workers",
                "must be >= 1 when fault_tolerance.mode is 'standby' and enable is true, got 0 "
                "(use mode: cold to start replacements on demand)",
            )


def describe(cls: type = RuntimeConfig) -> list[dict[str, Any]]:
    """Every leaf field as ``{path, type, default, doc, env, bounds}``: the source of the config reference."""
    return describe_fields(cls)


def sections(cls: type = RuntimeConfig) -> dict[str, str]:
    """Docs of the nested blocks (``fault_tolerance`` …), for the generated reference."""
    return section_docs(cls)


def leaf_paths() -> set[str]:
    """Every dotted field path of :class:`RuntimeConfig` (specs name deadlines by these)."""
    return {path for path, _ in walk_fields(RuntimeConfig)}


__all__ = ["MAINTENANCE_SOURCES", "MAX_CONFIG_BYTES", "MAX_CONFIG_DEPTH", "METADATA_SOURCES", "FaultToleranceConfig",
           "PlacementConfig", "RolePlacement", "RuntimeConfig", "SecurityConfig", "describe", "leaf_paths", "sections"]
