"""Recovery after a process of the job died: a new rendezvous, new groups, the replicas re-seeded.

A dead process leaves every torch.distributed group it belonged to unusable, the default group
included, and ``new_group`` needs every member of the default group: there is no repairing the
old job in place. Recovery forms a new one among the survivors and the restarted process:

1. **Rejoin** (:func:`rejoin`, on every process): leave the broken default group and meet at a
   new rendezvous (a new ``tcp://host:port``, or the next round of a launcher's ``env://``).
   Whoever restarts the dead process gives everyone the new address; the restarted process
   takes the dead one's rank.
2. **Rebuild** the groups on the new default group, exactly as at start:
   :func:`~rollout_sync.build_sync_groups`, :func:`~rollout_sync.new_payload_groups`, and hand
   the new transfers to each worker (:meth:`~rollout_sync.RolloutWorker.use_groups`).
3. **Re-seed** (:func:`recover_weights`, on every process): every process says which weight
   version it holds and whether it is whole; the trainer's version is the one all replicas must
   serve. Replicas that are torn or hold another version receive it in one transfer from a
   whole replica that holds it, or from the trainer if none does. A replica re-seeded that way
   serves exactly the trainer's bytes, bit-identical, and nothing torn is ever served: a torn
   replica refuses to generate until this transfer commits.
4. **Resume**: the next weight sync runs on the new groups as usual.

::

    rejoin(rank, Rendezvous("tcp://10.0.0.1:29600", world_size=4, generation=1), timeout_s=30)
    groups = build_sync_groups(trainer=0, replicas=[1, 2, 3], timeout_s=30)
    if rank == 0:
        plan, stats = recover_weights(groups, weights=model_weights, version=last_pushed)
    else:
        worker.use_groups(groups, config=transfer_config)
        plan, stats = recover_weights(groups, worker=worker, config=transfer_config)
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .distributed import DEFAULT_GROUP_TIMEOUT_S, init_process_group, new_group, wait_work
from .errors import RecoveryError, RecoveryTimeout
from .transfer import TransferConfig, TransferStats, WeightTransfer

if TYPE_CHECKING:
    from .worker import RolloutWorker, SyncGroups

__all__ = [
    "RecoveryError",
    "RecoveryTimeout",
    "Rendezvous",
    "ReseedPlan",
    "WeightState",
    "exchange_weight_states",
    "leave",
    "recover_weights",
    "rejoin",
]


@dataclass(frozen=True)
class Rendezvous:
    """Where a (re)formed job meets.

    Attributes:
        init_method: torch.distributed's ``tcp://host:port`` (or ``env://``); a new address for
            every generation, since the old one may have been hosted by the dead process.
        world_size: processes in the job (survivors plus restarted ones).
        generation: counts the job's formations: 0 at start, +1 per recovery. For messages.
    """

    init_method: str
    world_size: int
    generation: int = 0


def leave(timeout_s: float = 30.0) -> None:
    """Leave the default process group (and every group made from it), if this process is in
    one. Bounded: a teardown still blocked after ``timeout_s`` seconds is a
    :class:`~rollout_sync.errors.RecoveryTimeout` (the process must then be restarted too).
    """
    if not dist.is_initialized():
        return
    failure: list[BaseException] = []

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except BaseException as exc:  # noqa: BLE001 - reported below
            failure.append(exc)

    thread = threading.Thread(target=destroy, name="rollout-sync-leave", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RecoveryTimeout(
            f"leaving the broken process group did not finish within {timeout_s:.1f} s; "
            "restart this process as well"
        )
    if failure and dist.is_initialized():
        raise RecoveryError(
            f"leaving the broken process group failed: {type(failure[0]).__name__}: {failure[0]}"
        ) from failure[0]


def rejoin(
    rank: int, rendezvous: Rendezvous, *, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S
) -> None:
    """Leave the broken default group (if any) and join the job at ``rendezvous`` as ``rank``.

    Every process of the new job calls this, survivors and restarted ones alike; it returns
    when all ``rendezvous.world_size`` have arrived. ``timeout_s`` bounds the teardown and the
    rendezvous each, and is the new default group's collective limit.

    Raises:
        RecoveryTimeout: the teardown, or the rendezvous, did not finish within ``timeout_s``
            (a process of the new job never arrived).
    """
    leave(timeout_s)
    try:
        init_process_group(
            rank=rank,
            world_size=rendezvous.world_size,
            init_method=rendezvous.init_method,
            timeout_s=timeout_s,
        )
    except dist.DistError as exc:
        # The host of the store waits for the others (DistStoreError); the others wait to
        # reach a store nobody hosts (DistNetworkError, a connect timeout): both time out.
        raise RecoveryTimeout(
            f"generation {rendezvous.generation} of the job did not form at "
            f"{rendezvous.init_method} within {timeout_s:.1f} s (rank {rank} of "
            f"{rendezvous.world_size}): {exc}"
        ) from exc


@dataclass(frozen=True)
class WeightState:
    """What one process holds: its weight version and whether those weights are whole."""

    rank: int
    version: int
    whole: bool
    """False while torn (a write failed part-way); such weights are never a source."""


def exchange_weight_states(
    version: int, whole: bool, *, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S
) -> list[WeightState]:
    """All-gather every process's :class:`WeightState` over the default group, by rank."""
    mine = torch.tensor([version, 1 if whole else 0], dtype=torch.int64)
    everyone = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size())]
    work = dist.all_gather(everyone, mine, async_op=True)
    assert work is not None
    wait_work(work, operation="exchange weight states", timeout_s=timeout_s)
    return [WeightState(rank, int(state[0]), bool(state[1])) for rank, state in enumerate(everyone)]


@dataclass(frozen=True)
class ReseedPlan:
    """Who sends which version to whom, decided alike on every process from the same states.

    Attributes:
        version: the version every replica must serve: the trainer's.
        source: a whole replica holding ``version`` (the lowest rank), or the trainer if none.
        receivers: the replicas that are torn or hold another version, in rank order; empty
            when every replica already serves ``version`` whole.
    """

    version: int
    source: int
    receivers: tuple[int, ...]

    @classmethod
    def from_states(
        cls, states: Sequence[WeightState], *, trainer: int, replicas: Sequence[int]
    ) -> ReseedPlan:
        by_rank = {s.rank: s for s in states}
        target = by_rank[trainer].version
        current = [r for r in replicas if by_rank[r].whole and by_rank[r].version == target]
        receivers = tuple(r for r in sorted(replicas) if r not in current)
        return cls(target, min(current) if current else trainer, receivers)

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks of the re-seed transfer (source first)."""
        return (self.source, *self.receivers) if self.receivers else ()


def recover_weights(
    groups: SyncGroups,
    *,
    worker: RolloutWorker | None = None,
    weights: Mapping[str, torch.Tensor] | None = None,
    version: int = 0,
    config: TransferConfig | None = None,
    timeout_s: float | None = None,
) -> tuple[ReseedPlan, TransferStats | None]:
    """Bring every replica to the trainer's version; every process of the job calls this.

    On the trainer pass ``weights`` and ``version`` (what it would push next: its last
    committed weights); on a replica pass its ``worker`` (re-seeded through
    :meth:`~rollout_sync.RolloutWorker.reseed`, guarded: paused, egress held, then
    committed; a source replica only holds egress).

    Returns:
        The plan, and this process's transfer statistics (``None`` where it took no part).

    Raises:
        RecoveryError: the caller passed neither (or both) of ``worker`` and ``weights`` for
            its role.
        WeightTransferError and its kinds: the re-seed transfer failed (another death):
            recover again.
    """
    rank = dist.get_rank()
    is_trainer = rank == groups.trainer
    if is_trainer and (weights is None or worker is not None):
        raise RecoveryError(
            "recover_weights on the trainer needs its weights (and version), and no worker"
        )
    if not is_trainer and (worker is None or weights is not None):
        raise RecoveryError(
            f"recover_weights on replica rank {rank} needs its worker, and no weights"
        )
    limit = (
        timeout_s
        if timeout_s is not None
        else (config.timeout_s if config is not None else DEFAULT_GROUP_TIMEOUT_S)
    )
    if is_trainer:
        states = exchange_weight_states(version, True, timeout_s=limit)
    else:
        assert worker is not None
        rollout = worker.rollout
        states = exchange_weight_states(
            rollout.weight_version, not rollout.weights_torn, timeout_s=limit
        )
    plan = ReseedPlan.from_states(states, trainer=groups.trainer, replicas=groups.replicas)
    if not plan.receivers:
        return plan, None
    # Every process makes the group (torch's rule), members or not.
    group = new_group(sorted(plan.members), timeout_s=limit)
    if rank not in plan.members:
        return plan, None
    transfer = WeightTransfer(group, plan.source, config=config)
    if is_trainer:
        assert weights is not None
        return plan, transfer.send(weights, version=plan.version)
    assert worker is not None
    return plan, worker.reseed(transfer)
