"""A process killed at a placed point, and the job recovered: rejoin, rebuild, re-seed, resume.

Five processes: ranks 0-3 form the job (trainer, relay, two leaves); the fifth is the restart
of the victim, which joins the second rendezvous only. The victim dies inside a transfer hook
(a placed point, not a timer). The survivors must fail in bounded time with a clear error,
never serve torn weights, then rejoin with the restarted process at a new address, rebuild the
groups, re-seed every replica to the trainer's version and resume, bit-identically.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from rollout_sync.backends import TinyLMConfig, TorchLMBackend, tiny_lm_weights
from rollout_sync.distributed import init_process_group
from rollout_sync.errors import (
    CollectiveError,
    ManifestRejected,
    RecoveryError,
    TornWeightsError,
    WeightTransferError,
)
from rollout_sync.recovery import (
    Rendezvous,
    ReseedPlan,
    WeightState,
    recover_weights,
    rejoin,
)
from rollout_sync.testing import find_free_port, run_processes, weights_digest
from rollout_sync.transfer import TransferConfig, TransferHooks, WeightTransfer
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

_SCENARIOS = {
    # victim rank, the transfer it dies in, its hook
    "trainer_mid_p2r": (0, "after_pack"),
    "relay_mid_r2r": (1, "after_pack"),
    "leaf_mid_r2r": (3, "after_receive"),
}


def _die_at_bucket_3(k: int, flat: torch.Tensor) -> None:
    if k == 3:
        os._exit(17)


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
) -> Any:
    """One P2R then R2R of ``version``: the trainer's exception, or the replica's results."""
    if rank == groups.trainer:
        assert transfer is not None
        try:
            groups.p2r_barrier(TIMEOUT_S)  # the relay meets it inside its bracket
            transfer.send(_trainer_weights(version), version=version)
        except (WeightTransferError, CollectiveError) as exc:
            return exc
        return None
    assert worker is not None
    results = []
    if rank == groups.r2r_source:
        results.append(worker.handle(P2R(step=version)))
    results.append(worker.handle(R2R(step=version)))
    return results


def _death_child(index: int, port0: int, port1: int, scenario: str) -> dict[str, Any]:
    victim, hook = _SCENARIOS[scenario]
    restarted = index == WORLD
    rank = victim if restarted else index
    out: dict[str, Any] = {"rank": rank, "restarted": restarted}
    backend: TorchLMBackend | None = None
    worker: RolloutWorker | None = None
    trainer_version = 0
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
        first = _sync(rank, groups, worker, 1, p2r)
        assert first is None or all(r.ok for r in first), first
        trainer_version = 1
        if rank == victim:
            # The victim dies at bucket 3 of its next send or receive of version 2.
            placed = p2r if rank == 0 else worker.r2r if worker is not None else None
            assert placed is not None
            placed.hooks = TransferHooks(**{hook: _die_at_bucket_3})
        started = time.monotonic()
        second = _sync(rank, groups, worker, 2, p2r)
        out["elapsed"] = time.monotonic() - started
        if rank == 0:
            out["error"] = type(second).__name__ if second is not None else None
            if second is None:
                trainer_version = 2
        else:
            assert backend is not None
            failed = [r for r in second if not r.ok]
            out["errors"] = [(type(r.exception).__name__, r.error) for r in failed]
            out["error"] = type(failed[-1].exception).__name__ if failed else None
            out["text"] = failed[-1].error if failed else None
            out["servable"] = not backend.weights_torn
            out["version_after_death"] = backend.weight_version
    else:
        # A restarted trainer resumes from its last committed version (its checkpoint):
        # version 2 never committed when it died mid-P2R.
        trainer_version = 1
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
        out["after_reseed"] = (backend.weight_version, (not backend.weights_torn))
        out["reseed_digest"] = weights_digest(backend.served_weights())
    out["plan"] = (plan.version, plan.source, plan.receivers)
    resumed = _sync(rank, groups, worker, 3, groups.p2r_transfer(config=_CONFIG))
    if rank == 0:
        out["resume_error"] = repr(resumed) if resumed is not None else None
        out["digests"] = {v: weights_digest(_trainer_weights(v)) for v in (1, 2, 3)}
    else:
        assert backend is not None and worker is not None
        out["resumed"] = [r.ok for r in resumed]
        out["final"] = (backend.weight_version, (not backend.weights_torn))
        out["digest"] = weights_digest(backend.served_weights())
        worker.close(TIMEOUT_S)
    return out


def _run_death(scenario: str) -> dict[int, dict[str, Any]]:
    victim, _ = _SCENARIOS[scenario]
    values = run_processes(
        _death_child,
        WORLD + 1,
        (find_free_port(), find_free_port(), scenario),
        timeout_s=120,
        expected_exits={victim: 17},
        intra_op_threads=1,
    )
    # By rank in the recovered job; the victim's gen-0 process reported nothing.
    return {v["rank"]: v for v in values.values() if v is not None}


def _check_recovered(results: dict[int, dict[str, Any]]) -> None:
    trainer = results[0]
    assert trainer["resume_error"] is None
    for rank in (1, 2, 3):
        replica = results[rank]
        assert replica["after_reseed"] == (trainer["plan"][0], True), rank
        assert replica["reseed_digest"] == trainer["digests"][trainer["plan"][0]], rank
        assert replica["resumed"] == ([True, True] if rank == 1 else [True])
        assert replica["final"] == (3, True)
        assert replica["digest"] == trainer["digests"][3]


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_trainer_killed_mid_p2r_is_restarted_and_the_job_recovers() -> None:
    results = _run_death("trainer_mid_p2r")
    relay = results[1]
    (p2r_kind, p2r_text), (r2r_kind, r2r_text) = relay["errors"]
    # Its P2R saw the trainer die (a dead peer, not a timeout) and left it torn...
    assert p2r_kind == WeightTransferError.__name__ and "peer most likely died" in p2r_text
    # ...so its R2R refused to send torn weights.
    assert r2r_kind == TornWeightsError.__name__ and "refuses to generate" in r2r_text
    assert relay["servable"] is False and relay["elapsed"] < TIMEOUT_S / 2
    for rank in (2, 3):
        leaf = results[rank]
        # The torn relay's abort header: untouched, at once.
        assert leaf["error"] == ManifestRejected.__name__, leaf["text"]
        assert leaf["servable"] is True and leaf["version_after_death"] == 1
        assert leaf["elapsed"] < TIMEOUT_S / 2
    # The restarted trainer is at version 1; replica 2 holds it whole and re-seeds the relay.
    assert results[0]["plan"] == (1, 2, (1,))
    _check_recovered(results)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_relay_killed_mid_r2r_is_restarted_and_the_job_recovers() -> None:
    results = _run_death("relay_mid_r2r")
    assert results[0]["error"] is None  # the P2R of version 2 had committed
    for rank in (2, 3):
        leaf = results[rank]
        assert leaf["error"] == WeightTransferError.__name__, leaf["text"]
        assert "peer most likely died" in leaf["text"]
        assert leaf["servable"] is False  # buckets 0-2 landed: torn, refused
        assert leaf["elapsed"] < TIMEOUT_S / 2
    # Nobody holds version 2 whole (the relay restarted empty, the leaves are torn).
    assert results[0]["plan"] == (2, 0, (1, 2, 3))
    _check_recovered(results)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_leaf_killed_mid_r2r_is_restarted_and_the_job_recovers() -> None:
    results = _run_death("leaf_mid_r2r")
    relay = results[1]
    assert relay["error"] == WeightTransferError.__name__, relay["text"]
    assert relay["servable"] is True  # a source only reads its weights
    assert relay["elapsed"] < TIMEOUT_S / 2  # the source sees the receiver die at once
    # The other leaf waits for its next bucket: gloo gives the source no way to break that
    # wait, so it ends at the collective limit (bounded; docs/distributed.md, Recovery).
    leaf = results[2]
    assert leaf["error"] == "WeightTransferTimeout", leaf["text"]
    assert TIMEOUT_S <= leaf["elapsed"] < TIMEOUT_S * 1.5
    # Leaf 2 had written buckets before its wait ran out: torn, re-seeded with the restarted 3.
    assert leaf["servable"] is False
    assert results[0]["plan"] == (2, 1, (2, 3))
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


def _payload_death_child(index: int, port0: int, port1: int, acked_file: str) -> dict[str, Any]:
    from rollout_sync.errors import PayloadSendersFailed, PayloadsExhausted
    from rollout_sync.payload import PayloadReceiver, PayloadSender, new_payload_groups

    world, victim = 3, 2
    restarted = index == world
    rank = victim if restarted else index
    out: dict[str, Any] = {"rank": rank}
    carried: list[tuple[dict[str, torch.Tensor], dict[str, Any]]] = []
    received: list[str] = []
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
                    received.append(payload.meta["id"])
            except PayloadSendersFailed as exc:
                out["gen0_end"] = {"failed_senders": exc.failed_senders, "lost": exc.lost}
            receiver.close(30)
            out["gen0"] = receiver.statistics()
        else:
            sender = PayloadSender(groups, 0, capacity=64, default_timeout=TIMEOUT_S)
            if rank == victim:

                def record_acked() -> None:
                    with open(acked_file, "w") as f:  # what it was told, just before it dies
                        f.write(str(sender.statistics().acknowledged))

                original = torch.distributed.batch_isend_irecv
                calls = [0]

                def dying(ops: Any) -> Any:
                    # Mid-transfer (the receiver accepted it), once the victim has been told
                    # of at least one acknowledged payload and has sent a few.
                    calls[0] += 1
                    if calls[0] >= 3 and sender.statistics().acknowledged > 0:
                        record_acked()
                        os._exit(17)
                    return original(ops)

                torch.distributed.batch_isend_irecv = dying
            for i in range(_PER_SENDER):
                sender.register_payload(*_payload(rank, i))
            sender.close(30)  # the survivor says goodbye; the victim never gets here
            out["gen0"] = sender.statistics()
            carried = sender.unacknowledged()  # to send again on the new transport
    # -- generation 1 --
    rejoin(rank, Rendezvous(f"tcp://127.0.0.1:{port1}", world, generation=1), timeout_s=30)
    groups = new_payload_groups(timeout=30)
    if rank == 0:
        receiver = PayloadReceiver(groups, [1, 2], window=4, default_timeout=TIMEOUT_S)
        try:
            for payload in receiver.iter_payloads(timeout=30):
                received.append(payload.meta["id"])
        except PayloadsExhausted:
            pass
        receiver.close(30)
        out["gen1"] = receiver.statistics()
        out["received"] = received
    else:
        sender = PayloadSender(groups, 0, default_timeout=TIMEOUT_S)
        for tensors, meta in carried:
            sender.register_payload(tensors, meta)
        if restarted:
            for i in range(5):
                sender.register_payload(*_payload(rank, i, "new"))
        sender.close(30)
        out["carried"] = [meta["id"] for _, meta in carried]
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
        expected_exits={2: 17},
        intra_op_threads=1,
    )
    results = {v["rank"]: v for v in values.values() if v is not None}
    trainer, survivor = results[0], results[1]
    gen0 = trainer["gen0"]
    # The receiver names the dead sender and the cause, counts what it had in flight as lost,
    # and went on receiving from the other sender.
    assert gen0.failed_senders == {2: "closed"}
    assert gen0.lost >= 1
    # The trainer's plain `for` loop over iter_payloads ended with the loss, not quietly.
    assert trainer.get("gen0_end") == {"failed_senders": {2: "closed"}, "lost": gen0.lost}
    received = trainer["received"]
    assert {f"1-{i}" for i in range(_PER_SENDER)} <= set(received)
    # Nothing the dead sender was told was acknowledged is missing.
    victim_acked = int(open(acked_file).read())
    assert victim_acked > 0
    assert {f"2-{i}" for i in range(victim_acked)} <= set(received)
    # The survivor sent again exactly what was not acknowledged; the restarted sender's
    # payloads arrived; nothing was lost on the new transport.
    assert survivor["carried"] == [
        f"1-{i}" for i in range(survivor["gen0"].acknowledged, _PER_SENDER)
    ]
    assert {f"2-new{i}" for i in range(5)} <= set(received)
    assert trainer["gen1"].lost == 0 and trainer["gen1"].failed_senders == {}


def _rejoin_alone(child: int, rank: int, port: int) -> str:
    """Rejoin a job of two whose other process never comes; the error's type name."""
    from rollout_sync.errors import RecoveryTimeout
    from rollout_sync.recovery import Rendezvous, rejoin

    try:
        rejoin(rank, Rendezvous(f"tcp://127.0.0.1:{port}", 2, generation=1), timeout_s=3.0)
    except RecoveryTimeout as exc:
        return f"RecoveryTimeout: {exc}"
    except BaseException as exc:  # the test asserts on the type, so report any other
        return f"{type(exc).__name__}: {exc}"
    return "joined"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank", [0, 1], ids=["hosting-the-store", "reaching-for-it"])
def test_rejoin_whose_peer_never_comes_is_a_recovery_timeout(rank: int) -> None:
    """Rank 0 hosts the rendezvous store and waits for the others; rank 1 waits to reach a
    store nobody hosts. Torch raises different errors for the two; both are the job not
    forming in time."""
    result = run_processes(_rejoin_alone, 1, (rank, find_free_port()), timeout_s=90)
    assert result[0].startswith("RecoveryTimeout"), result[0]
