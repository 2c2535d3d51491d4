"""A process killed at a placed point, and the job recovered: rejoin, rebuild, re-seed, resume.

Five processes: ranks 0-3 form the job (trainer, relay, two leaves); the fifth is the restart
of the victim, which joins the second rendezvous only. The victim dies inside a transfer hook
(a placed point, not a timer). The survivors must fail in bounded time with a clear error,
never serve torn weights, then rejoin with the restarted process at a new address, rebuild the
groups, re-seed every replica to the trainer's version and resume, bit-identically.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from rollout_sync.backends import TinyLMConfig, TorchLMBackend, tiny_lm_weights
from rollout_sync.distributed import init_process_group
from rollout_sync.errors import (
    CollectiveError,
    ManifestRejected,
    PayloadSendersFailed,
    PayloadsExhausted,
    RecoveryError,
    RecoveryTimeout,
    TornWeightsError,
    WeightTransferError,
    WeightTransferTimeout,
)
from rollout_sync.payload import PayloadReceiver, PayloadSender, new_payload_groups
from rollout_sync.recovery import (
    Rendezvous,
    ReseedPlan,
    WeightState,
    recover_weights,
    rejoin,
)
from rollout_sync.testing import (
    ErrorReport,
    FaultSchedule,
    Kill,
    fault_point,
    find_free_port,
    run_processes,
    transfer_fault_hooks,
    weights_digest,
)
from rollout_sync.transfer import TransferConfig, WeightTransfer
from rollout_sync.worker import P2R, R2R, RolloutWorker, SyncGroups, build_sync_groups

WORLD = 4
TIMEOUT_S = 6.0
"""Collective limit: a death noticed in time is well under it."""

_LM = TinyLMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=32)
_CONFIG = TransferConfig(bucket_bytes=4096, timeout_s=TIMEOUT_S)


def _trainer_weights(version: int) -> dict[str, torch.Tensor]:
    return tiny_lm_weights(_LM, seed=1000 + version)


# -- the plan, in one process ------------------------------------------------------------------


def test_the_plan_reseeds_from_a_whole_replica_at_the_trainers_version_else_the_trainer() -> None:
    def states(*rows: tuple[int, bool]) -> list[WeightState]:
        return [WeightState(rank, v, whole) for rank, (v, whole) in enumerate(rows)]

    replicas = [1, 2, 3]
    # Replica 2 holds the trainer's version whole: it sends; the torn and the stale receive.
    plan = ReseedPlan.from_states(
        states((5, True), (5, False), (5, True), (4, True)), trainer=0, replicas=replicas
    )
    assert plan == ReseedPlan(5, 2, (1, 3)) and plan.members == (2, 1, 3)
    # Nobody whole at the trainer's version: the trainer sends to everyone.
    plan = ReseedPlan.from_states(
        states((5, True), (0, True), (5, False), (4, True)), trainer=0, replicas=replicas
    )
    assert plan == ReseedPlan(5, 0, (1, 2, 3))
    # Everyone current: nothing to do.
    plan = ReseedPlan.from_states(
        states((5, True), (5, True), (5, True), (5, True)), trainer=0, replicas=replicas
    )
    assert plan.receivers == () and plan.members == ()
    # A restarted trainer at an older checkpoint: the replicas follow it back.
    plan = ReseedPlan.from_states(
        states((3, True), (5, True), (5, True), (5, True)), trainer=0, replicas=replicas
    )
    assert plan == ReseedPlan(3, 0, (1, 2, 3))


# -- deaths at placed points -------------------------------------------------------------------

_KILLS = {
    # the victim dies after bucket 3 of its send (after_pack) or receive (after_receive) of v2
    "trainer_mid_p2r": Kill(0, "after_pack", 3),
    "relay_mid_r2r": Kill(1, "after_pack", 3),
    "leaf_mid_r2r": Kill(3, "after_receive", 3),
}


@dataclass
class _Outcome:
    """What one rank of the recovered job saw: the failed sync of version 2, then recovery."""

    rank: int
    errors: list[ErrorReport] = field(default_factory=list)
    """The failed commands of the sync the victim died in (the trainer: its send)."""
    elapsed_s: float = 0.0
    servable: bool = True
    version_after_death: int = 1
    plan: tuple[int, int, tuple[int, ...]] = (0, 0, ())
    after_reseed: tuple[int, bool] = (0, False)
    reseed_digest: str = ""
    resumed: list[bool] = field(default_factory=list)
    resume_error: ErrorReport | None = None
    final: tuple[int, bool] = (0, False)
    digest: str = ""
    digests: dict[int, str] = field(default_factory=dict)

    @property
    def error(self) -> ErrorReport | None:
        return self.errors[-1] if self.errors else None


def _replica(rank: int, groups: SyncGroups) -> tuple[TorchLMBackend, RolloutWorker]:
    backend = TorchLMBackend(_LM, pause_timeout=TIMEOUT_S)
    worker = RolloutWorker(backend, weight_sync_timeout=TIMEOUT_S)
    worker.use_groups(groups, config=_CONFIG)
    return backend, worker


def _sync(
    rank: int,
    groups: SyncGroups,
    worker: RolloutWorker | None,
    version: int,
    transfer: WeightTransfer | None = None,
) -> list[ErrorReport | None]:
    """One P2R then R2R of ``version``: what each command of this rank raised (the trainer's
    one command is its send)."""
    if rank == groups.trainer:
        assert transfer is not None
        try:
            groups.p2r_barrier(TIMEOUT_S)  # the relay meets it inside its bracket
            transfer.send(_trainer_weights(version), version=version)
        except (WeightTransferError, CollectiveError) as exc:
            return [ErrorReport.of(exc)]
        return [None]
    assert worker is not None
    results = [worker.handle(P2R(step=version))] if rank == groups.r2r_source else []
    results.append(worker.handle(R2R(step=version)))
    return [ErrorReport.of_optional(r.exception) for r in results]


def _death_child(index: int, port0: int, port1: int, victim: int) -> _Outcome:
    restarted = index == WORLD
    rank = victim if restarted else index
    out = _Outcome(rank)
    backend: TorchLMBackend | None = None
    worker: RolloutWorker | None = None
    trainer_version = 1  # a restarted trainer resumes from its checkpoint: version 1
    if not restarted:
        init_process_group(
            rank=rank,
            world_size=WORLD,
            init_method=f"tcp://127.0.0.1:{port0}",
            timeout_s=TIMEOUT_S * 3,
        )
        groups = build_sync_groups(0, [1, 2, 3], timeout_s=TIMEOUT_S)
        p2r = groups.p2r_transfer(config=_CONFIG) if rank == 0 else None
        if rank != 0:
            backend, worker = _replica(rank, groups)
        assert not any(_sync(rank, groups, worker, 1, p2r))
        # Armed on every rank; only the scheduled victim dies at its point.
        placed = p2r if worker is None else worker.r2r
        assert placed is not None
        placed.hooks = transfer_fault_hooks()
        started = time.monotonic()
        out.errors = [e for e in _sync(rank, groups, worker, 2, p2r) if e is not None]
        out.elapsed_s = time.monotonic() - started
        if rank == 0 and not out.errors:
            trainer_version = 2
        if backend is not None:
            out.servable = not backend.weights_torn
            out.version_after_death = backend.weight_version
    # -- generation 1: rejoin, rebuild, re-seed, resume --
    rejoin(
        rank,
        Rendezvous(f"tcp://127.0.0.1:{port1}", WORLD, generation=1),
        timeout_s=TIMEOUT_S * 3,
    )
    groups = build_sync_groups(0, [1, 2, 3], timeout_s=TIMEOUT_S)
    if rank == 0:
        plan, _ = recover_weights(
            groups, weights=_trainer_weights(trainer_version), version=trainer_version
        )
    else:
        if worker is None:
            backend, worker = _replica(rank, groups)
        else:
            worker.use_groups(groups, config=_CONFIG)
        plan, _ = recover_weights(groups, worker=worker, config=_CONFIG)
        assert backend is not None
        out.after_reseed = (backend.weight_version, not backend.weights_torn)
        out.reseed_digest = weights_digest(backend.served_weights())
    out.plan = (plan.version, plan.source, plan.receivers)
    resumed = _sync(rank, groups, worker, 3, groups.p2r_transfer(config=_CONFIG))
    if rank == 0:
        out.resume_error = resumed[0]
        out.digests = {v: weights_digest(_trainer_weights(v)) for v in (1, 2, 3)}
    else:
        assert backend is not None and worker is not None
        out.resumed = [e is None for e in resumed]
        out.final = (backend.weight_version, not backend.weights_torn)
        out.digest = weights_digest(backend.served_weights())
        worker.close(TIMEOUT_S)
    return out


def _run_death(scenario: str) -> dict[int, _Outcome]:
    kill = _KILLS[scenario]
    values = run_processes(
        _death_child,
        WORLD + 1,
        (find_free_port(), find_free_port(), kill.rank),
        timeout_s=120,
        faults=FaultSchedule(kill),
        intra_op_threads=1,
    )
    # By rank in the recovered job; the victim's first process reported nothing.
    return {outcome.rank: outcome for outcome in values.values()}


def _check_recovered(results: dict[int, _Outcome]) -> None:
    trainer = results[0]
    assert trainer.resume_error is None
    version = trainer.plan[0]
    for rank in (1, 2, 3):
        replica = results[rank]
        assert replica.after_reseed == (version, True), rank
        assert replica.reseed_digest == trainer.digests[version], rank
        assert replica.resumed == ([True, True] if rank == 1 else [True])
        assert replica.final == (3, True)
        assert replica.digest == trainer.digests[3]


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_trainer_killed_mid_p2r_is_restarted_and_the_job_recovers() -> None:
    results = _run_death("trainer_mid_p2r")
    relay = results[1]
    p2r, r2r = relay.errors
    # Its P2R saw the trainer die (a dead peer, not a timeout) and left it torn...
    assert p2r.is_a(WeightTransferError) and "peer most likely died" in p2r.message
    # ...so its R2R refused to send torn weights.
    assert r2r.is_a(TornWeightsError) and "refuses to generate" in r2r.message
    assert relay.servable is False and relay.elapsed_s < TIMEOUT_S / 2
    for rank in (2, 3):
        leaf = results[rank]
        # The torn relay's abort header: untouched, at once.
        assert leaf.error is not None and leaf.error.is_a(ManifestRejected), leaf.errors
        assert "aborted" in leaf.error.message, leaf.errors
        assert leaf.servable is True and leaf.version_after_death == 1
        assert leaf.elapsed_s < TIMEOUT_S / 2
    # The restarted trainer is at version 1; replica 2 holds it whole and re-seeds the relay.
    assert results[0].plan == (1, 2, (1,))
    _check_recovered(results)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_relay_killed_mid_r2r_is_restarted_and_the_job_recovers() -> None:
    results = _run_death("relay_mid_r2r")
    assert results[0].errors == []  # the P2R of version 2 had committed
    for rank in (2, 3):
        leaf = results[rank]
        assert leaf.error is not None and leaf.error.is_a(WeightTransferError), leaf.errors
        assert "peer most likely died" in leaf.error.message
        assert leaf.servable is False  # buckets 0-2 landed: torn, refused
        assert leaf.elapsed_s < TIMEOUT_S / 2
    # Nobody holds version 2 whole (the relay restarted empty, the leaves are torn).
    assert results[0].plan == (2, 0, (1, 2, 3))
    _check_recovered(results)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_leaf_killed_mid_r2r_is_restarted_and_the_job_recovers() -> None:
    results = _run_death("leaf_mid_r2r")
    relay = results[1]
    assert relay.error is not None and relay.error.is_a(WeightTransferError), relay.errors
    assert relay.servable is True  # a source only reads its weights
    assert relay.elapsed_s < TIMEOUT_S / 2  # the source sees the receiver die at once
    # The other leaf waits for its next bucket, which gloo cannot cancel: the source that saw
    # the death posts the group's abort flag, and the leaf's wait ends at it, not at the limit.
    leaf = results[2]
    assert leaf.error is not None and leaf.error.is_a(WeightTransferError), leaf.errors
    assert not leaf.error.is_a(WeightTransferTimeout), leaf.errors
    assert "another rank of the group saw it fail" in leaf.error.message
    assert leaf.elapsed_s < TIMEOUT_S / 2
    # Leaf 2 had written buckets before its wait ran out: torn, re-seeded with the restarted 3.
    assert leaf.servable is False
    assert results[0].plan == (2, 1, (2, 3))
    _check_recovered(results)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_recover_weights_refuses_a_call_without_what_its_role_needs() -> None:
    run_processes(_refuse_child, 2, (find_free_port(),), timeout_s=50)


def _refuse_child(rank: int, port: int) -> None:
    init_process_group(rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout_s=20)
    groups = build_sync_groups(0, [1], timeout_s=20)
    with pytest.raises(RecoveryError, match="needs"):
        recover_weights(groups)


# -- a payload sender killed mid-transfer ------------------------------------------------------

_PER_SENDER = 20


def _payload(sender: int, i: int, tag: str = "") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return {"tokens": torch.arange(64) + i}, {"id": f"{sender}-{tag}{i}"}


@dataclass
class _PayloadOutcome:
    rank: int
    gen0: Any = None
    """The first transport's statistics (receiver or sender)."""
    gen0_end: PayloadSendersFailed | None = None
    """How the trainer's plain loop over the first transport ended."""
    gen1: Any = None
    received: list[str] = field(default_factory=list)
    carried: list[str] = field(default_factory=list)
    """Sent on the first transport, not acknowledged: sent again on the second."""


_PAYLOAD_KILL = Kill(2, "mid_payload")
"""The sender killed mid-transfer: the receiver accepted, and it had sent a few."""


def _payload_death_child(index: int, port0: int, port1: int, acked_file: str) -> _PayloadOutcome:
    world, victim = 3, _PAYLOAD_KILL.rank
    restarted = index == world
    rank = victim if restarted else index
    out = _PayloadOutcome(rank)
    carried: list[tuple[dict[str, torch.Tensor], dict[str, Any]]] = []
    if not restarted:
        init_process_group(
            rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port0}", timeout_s=30
        )
        groups = new_payload_groups(timeout=30)
        if rank == 0:
            receiver = PayloadReceiver(groups, [1, 2], window=4, default_timeout=TIMEOUT_S)
            # A consumer's plain loop: it must learn that the stream did not end cleanly.
            try:
                for payload in receiver.iter_payloads(timeout=60):
                    out.received.append(payload.meta["id"])
            except PayloadSendersFailed as exc:
                out.gen0_end = exc
            receiver.close(30)
            out.gen0 = receiver.statistics()
        else:
            sender = PayloadSender(groups, 0, capacity=64, default_timeout=TIMEOUT_S)
            if rank == victim:
                original = torch.distributed.batch_isend_irecv
                calls = [0]

                def dying(ops: Any) -> Any:
                    # Mid-transfer (the receiver accepted it), once the victim has been told
                    # of at least one acknowledged payload and has sent a few.
                    calls[0] += 1
                    if calls[0] >= 3 and sender.statistics().acknowledged > 0:
                        with open(acked_file, "w") as f:  # what it was told, as it dies
                            f.write(str(sender.statistics().acknowledged))
                        fault_point(_PAYLOAD_KILL.point)
                    return original(ops)

                torch.distributed.batch_isend_irecv = dying
            for i in range(_PER_SENDER):
                sender.register_payload(*_payload(rank, i))
            sender.close(30)  # the survivor says goodbye; the victim never gets here
            out.gen0 = sender.statistics()
            carried = sender.unacknowledged()  # to send again on the new transport
    # -- generation 1 --
    rejoin(rank, Rendezvous(f"tcp://127.0.0.1:{port1}", world, generation=1), timeout_s=30)
    groups = new_payload_groups(timeout=30)
    if rank == 0:
        receiver = PayloadReceiver(groups, [1, 2], window=4, default_timeout=TIMEOUT_S)
        try:
            for payload in receiver.iter_payloads(timeout=30):
                out.received.append(payload.meta["id"])
        except PayloadsExhausted:
            pass
        receiver.close(30)
        out.gen1 = receiver.statistics()
    else:
        sender = PayloadSender(groups, 0, default_timeout=TIMEOUT_S)
        for tensors, meta in carried:
            sender.register_payload(tensors, meta)
        if restarted:
            for i in range(5):
                sender.register_payload(*_payload(rank, i, "new"))
        sender.close(30)
        out.carried = [meta["id"] for _, meta in carried]
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_sender_killed_mid_payload_loses_nothing_acknowledged(tmp_path: Any) -> None:
    acked_file = str(tmp_path / "acked")
    values = run_processes(
        _payload_death_child,
        4,
        (find_free_port(), find_free_port(), acked_file),
        timeout_s=120,
        faults=FaultSchedule(_PAYLOAD_KILL),
        intra_op_threads=1,
    )
    results = {outcome.rank: outcome for outcome in values.values()}
    trainer, survivor = results[0], results[1]
    gen0 = trainer.gen0
    # The receiver names the dead sender and the cause, counts what it had in flight as lost,
    # and went on receiving from the other sender.
    assert gen0.failed_senders == {2: "closed"}
    assert gen0.lost >= 1
    # The trainer's plain `for` loop over iter_payloads ended with the loss, not quietly.
    end = trainer.gen0_end
    assert end is not None and (end.failed_senders, end.lost) == ({2: "closed"}, gen0.lost)
    received = trainer.received
    assert {f"1-{i}" for i in range(_PER_SENDER)} <= set(received)
    # Nothing the dead sender was told was acknowledged is missing.
    victim_acked = int(open(acked_file).read())
    assert victim_acked > 0
    assert {f"2-{i}" for i in range(victim_acked)} <= set(received)
    # The survivor sent again exactly what was not acknowledged; the restarted sender's
    # payloads arrived; nothing was lost on the new transport.
    assert survivor.carried == [f"1-{i}" for i in range(survivor.gen0.acknowledged, _PER_SENDER)]
    assert {f"2-new{i}" for i in range(5)} <= set(received)
    assert trainer.gen1.lost == 0 and trainer.gen1.failed_senders == {}


def _rejoin_alone(child: int, rank: int, port: int) -> ErrorReport | None:
    """Rejoin a job of two whose other process never comes; what it raised."""
    try:
        rejoin(rank, Rendezvous(f"tcp://127.0.0.1:{port}", 2, generation=1), timeout_s=3.0)
    except BaseException as exc:  # the test asserts on the type, so report any
        return ErrorReport.of(exc)
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank", [0, 1], ids=["hosting-the-store", "reaching-for-it"])
def test_rejoin_whose_peer_never_comes_is_a_recovery_timeout(rank: int) -> None:
    """Rank 0 hosts the rendezvous store and waits for the others; rank 1 waits to reach a
    store nobody hosts. Torch raises different errors for the two; both are the job not
    forming in time."""
    error = run_processes(_rejoin_alone, 1, (rank, find_free_port()), timeout_s=90)[0]
    assert error is not None and error.is_a(RecoveryTimeout), error
