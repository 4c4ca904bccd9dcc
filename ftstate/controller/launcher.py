"""The launcher, in the controller: starts and kills the run's worker actors in its resource pools (through
the cluster backend), each with its worker machine added to the membership."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from ftstate.controller.backend import ClusterBackend, Pool
from ftstate.controller.feasibility import fits_one
from ftstate.controller.membership import Member, Membership
from ftstate.core.audit import AuditTrail
from ftstate.core.config import RuntimeConfig
from ftstate.core.liveness import Liveness
from ftstate.core.machine import StateMachine
from ftstate.core.spec import get_spec


class ActorLauncher:
    """Starts worker actors for one run: ``classes``/``args`` per role, ``on_transition`` attached to every
    worker machine, ``backend`` the cluster they run on."""

    def __init__(
        self,
        *,
        run_id: str,
        config: RuntimeConfig,
        audit: AuditTrail,
        membership: Membership,
        classes: Mapping[str, type],
        args: Mapping[str, tuple[Sequence[Any], Mapping[str, Any]]],
        on_transition: Callable[[StateMachine, str, str, str], None],
        backend: ClusterBackend,
    ) -> None:
        self.run_id = run_id
        self.config = config
        self.audit = audit
        self.membership = membership
        self.classes = dict(classes)
        self.args = dict(args)
        self.backend = backend
        self._on_transition = on_transition
        self.pools: dict[str, Pool] = {}
        # The run's secret (security.authenticate), made at start() and handed to members over Ray's channel.
        from ftstate.transport import auth

        self._secret = auth.new_secret() if config.security.authenticate else None
        if self._secret is not None:
            auth.install(run_id, self._secret)
        else:
            auth.uninstall()

    def make_pools(self) -> None:
        """One placement group per role, plus the standby pool: a slot per spare and per member (for
        replacements kept off a lost node)."""
        cfg, ft = self.config, self.config.fault_tolerance
        sizes = {"trainer": (cfg.trainer_workers, cfg.placement.trainer),
                 "rollout": (cfg.rollout_workers, cfg.placement.rollout)}
        if ft.enable or ft.detect_node_maintenance:
            # Spares and replacements that must keep off a node: a placement group each, made when needed.
            spares = cfg.spares("trainer") + cfg.spares("rollout")
            sizes[ft.standby_resource_pool] = (spares + cfg.trainer_workers + cfg.rollout_workers,
                                               cfg.placement.standby)
        for name, (slots, placement) in sizes.items():
            kind = self.backend.spare_pool if name == ft.standby_resource_pool else self.backend.resource_pool
            self.pools[name] = kind(self.run_id, name, slots, cpus=cfg.worker_cpus, gpus=cfg.worker_gpus,
                                    placement=placement)

    def add_pool(self, name: str, role: str, slots: int) -> Pool:
        """A pool of ``slots`` more ``role`` workers mid-run, each slot placed when taken off the avoided
        nodes; refuses at once what the cluster could never place."""
        cfg = self.config
        pool = self.backend.spare_pool(self.run_id, name, slots, cpus=cfg.worker_cpus, gpus=cfg.worker_gpus,
                                       placement=getattr(cfg.placement, role))
        self.pools[name] = pool
        return pool

    def grow_pool(self, name: str, slots: int) -> None:
        """Let slot-by-slot pool ``name`` hold ``slots`` more (negative: fewer, never below what it holds)."""
        pool = self.pools.get(name)
        if pool is not None:
            pool.slots = max(0, pool.slots + slots)

    def describe_pools(self) -> str:
        """What the run asks of the cluster, and what it has (for a placement that never comes)."""
        from ftstate.controller.feasibility import describe_cluster

        asked = "; ".join(pool.describe() for pool in self.pools.values())
        return f"placement of {asked}; the cluster has {describe_cluster(self.backend.nodes())}"

    def unplaced(self) -> list[str]:
        """The pools Ray has not placed yet."""
        out = []
        for name, pool in self.pools.items():
            try:
                placed = pool.placed
            except Exception:  # noqa: BLE001 - asked at a deadline's expiry: report what we can
                placed = False
            if not placed:
                out.append(f"pool {name}")
        return out

    async def pools_ready(self) -> None:
        import asyncio

        await asyncio.gather(*(pool.ready() for pool in self.pools.values()))

    def liveness(self) -> Liveness:
        cfg = self.config
        return Liveness(max(cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s / 2), cfg.heartbeat_timeout_s)

    def start(
        self, role: str, rank: int, name: str, pool: str | None = None, avoid_nodes: Collection[str] = (),
        *, strict: bool = False,
    ) -> Member:
        """Start an actor for ``role`` in a free slot of ``pool`` (default: the role's own),
        on a node outside ``avoid_nodes`` when the pool has a free slot there (``strict``: or
        not at all, FTError); its machine starts in INIT. The actor constructs the user's class in its process."""
        resource_pool = self.pools[pool or role]
        slot = resource_pool.take(avoid_nodes, strict=strict)  # first: a refusal leaves nothing behind
        machine = StateMachine(get_spec("worker"), member=name, role=role, rank=rank, config=self.config,
                               audit=self.audit)
        machine.listen(self._on_transition)
        args, kwargs = self.args[role]
        handle = self.backend.start_actor(
            name=name, run_id=self.run_id, pool=resource_pool, slot=slot, role=role, user_class=self.classes[role],
            args=args, kwargs=kwargs,
            host={"backend": self.config.backend, "bucket_bytes": int(self.config.bucket_size_mb * 2**20),
                  "secret": self._secret, "integrity": self.config.security.integrity,
                  "held_proof": (self.config.held_weights_proof, self.config.held_weights_proof_fraction),
                  "staging_spare": self.config.staging_spare,
                  "in_flight": self.config.rollout_updates == "in_flight"})
        member = Member(name, role, rank, machine, handle, self.liveness(), pool=resource_pool.name, slot=slot)
        self.membership.add(member)
        return member

    def node_of(self, member: Member) -> str | None:
        """Ray's id of the node ``member`` runs on: what it said, else where its slot was placed."""
        if member.node_id is not None:
            return member.node_id
        pool = self.pools.get(member.pool)
        try:
            return pool.slot_nodes().get(member.slot) if pool is not None else None
        except Exception:  # noqa: BLE001 - the pool may be gone with the cluster
            return None

    def placeable(self, pool: str, avoid: Collection[str] = ()) -> set[str]:
        """The alive nodes off ``avoid`` that could hold a worker of ``pool`` (its labels and resources)."""
        p = self.pools[pool]
        return {n["node_id"] for n in self.backend.nodes()
                if n["node_id"] not in avoid and fits_one(n, p.bundle, p.placement.labels)}

    def alive_nodes(self) -> set[str]:
        """Ray ids of the nodes Ray counts alive."""
        return {n["node_id"] for n in self.backend.nodes()}

    def has_free_slot(self, pool: str) -> bool:
        return self.pools[pool].has_free_slot()

    def give_back(self, member: Member) -> None:
        """Return a member's slot to its pool (it was retired or never started)."""
        self.pools[member.pool].give_back(member.slot)

    def kill(self, member: Member) -> None:
        """Kill a member's process now (see the module docstring)."""
        self.backend.kill(member.handle, pid=member.pid, node=member.node)

    def kill_all(self) -> None:
        for member in self.membership:
            self.kill(member)

    def close(self) -> None:
        """Kill every actor and remove the placement groups; forget the run's secret."""
        from ftstate.transport import auth

        self.kill_all()
        auth.uninstall()
        for pool in self.pools.values():
            with contextlib.suppress(Exception):  # the cluster may be gone already
                pool.remove()
        self.pools.clear()
