"""Chaos: a trainer and three replicas streaming weights and payloads while processes get killed.

Four processes (gloo on loopback): rank 0 the trainer, rank 1 the relay (P2R receiver, R2R
source), ranks 2 and 3 leaves. Each step the trainer takes the payloads that arrived, moves its
weights to the next version and pushes them (P2R, then R2R); each replica generates with the
tiny LM, registers payloads and takes part in the sync. Every round, the controller (this
process) SIGKILLs one process at a random point:

* ``mid_p2r`` (trainer or relay), ``mid_r2r`` (relay or leaf): inside a bucket of the transfer,
  placed by a transfer hook at a random bucket;
* ``mid_payload`` (trainer or any replica): inside a payload transfer, after both ends agreed;
* ``idle`` (anyone): between two steps.

The victim dies by its own hand at that point (``os._exit``, no cleanup: a SIGKILL as far as
its peers can tell). The controller restarts it, every process rejoins at a new address
(:mod:`rollout_sync.recovery`: ``rejoin``, ``build_sync_groups``, ``recover_weights``), senders
register again what the trainer had not acknowledged, and streaming resumes. Every wait is
bounded; a round whose survivors do not report within the bound is counted as a hang and the
whole job is restarted.

Measured: ``torn_served`` (generations that returned from torn weights, plus forwards that the
LM's seqlock saw read a write in progress: must be 0; a replica whose sync failed tries to
generate at once, and ``refused_while_torn`` counts the refusals), ``acked_payloads_lost``
(payloads a sender was told were acknowledged that the trainer never took: must be 0),
``converged``
(after a last clean round every replica is bit-identical to the trainer's last committed
version), ``recovery_s`` (the victim's death seen by the controller until every process of the
new job reports ready: restart, rendezvous, groups, re-seed) and ``hangs`` (must be 0).

    python benchmarks/chaos.py                  # 20 rounds, ~2-3 min on 2 cores
    python benchmarks/chaos.py --rounds 40 --seed 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import time
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_sync.metrics import percentile  # noqa: E402 - the path is set up above

WORLD = 4
TRAINER, RELAY, LEAVES = 0, 1, (2, 3)
ROLES = {0: "trainer", 1: "relay", 2: "leaf", 3: "leaf"}
POINTS = {
    "mid_p2r": (0, 1),
    "mid_r2r": (1, 2, 3),
    "mid_payload": (0, 1, 2, 3),
    "idle": (0, 1, 2, 3),
}
PAYLOADS_PER_STEP = 3


# -- a member of the job -----------------------------------------------------------------------


def _member(rank: int, conn: Connection, trainer_version: int, timeout_s: float) -> None:
    """One process of the job, for as many generations as the controller runs it."""
    import torch

    torch.set_num_threads(1)
    from rollout_sync import RolloutWorker, TransferConfig, TransferHooks, build_sync_groups
    from rollout_sync.backends import TinyLMConfig, TorchLMBackend, tiny_lm_weights
    from rollout_sync.errors import PayloadTimeout, TornWeightsError
    from rollout_sync.payload import PayloadReceiver, PayloadSender, new_payload_groups
    from rollout_sync.recovery import Rendezvous, recover_weights, rejoin
    from rollout_sync.testing import weights_digest
    from rollout_sync.trainer import TransferWeightPusher
    from rollout_sync.worker import P2R, R2R

    lm = TinyLMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=64)
    config = TransferConfig(bucket_bytes=8 << 10, timeout_s=timeout_s)

    def trainer_weights(version: int) -> dict[str, torch.Tensor]:
        return tiny_lm_weights(lm, seed=10_000 + version)

    backend = TorchLMBackend(lm, pause_timeout=timeout_s) if rank != TRAINER else None
    worker = RolloutWorker(backend, weight_sync_timeout=timeout_s) if backend is not None else None
    version = trainer_version
    carried: list[tuple[dict[str, torch.Tensor], dict[str, Any]]] = []
    payload_counter = 0

    reported_torn_forwards = 0

    def serve() -> None:
        """One generation; the controller counts refusals and anything served torn."""
        nonlocal reported_torn_forwards
        assert backend is not None
        try:
            backend.generate([[1, 2, 3]], max_new_tokens=3, timeout=timeout_s)
            if backend.weights_torn:
                conn.send(("torn_served", rank))
        except TornWeightsError:
            conn.send(("refused", rank))
        seen = backend.torn_forwards  # the LM's seqlock: forwards that read a write
        if seen > reported_torn_forwards:
            conn.send(("torn_served", rank))
            reported_torn_forwards = seen

    def die(point: str) -> None:
        conn.send(("dying", rank, point))  # a pipe write: it has arrived when send returns
        os._exit(9)

    while True:
        if not conn.poll(600):
            return  # the controller is gone
        message = conn.recv()
        if message[0] == "exit":
            conn.close()
            # Payload readers of broken generations may still block in native code: leave
            # without the interpreter's teardown, which would wait on (or abort at) them.
            os._exit(0)
        _, generation, port, plan = message
        victim = plan["victim"] == rank
        sender: PayloadSender | None = None
        registered: list[str] = []
        try:
            rejoin(rank, Rendezvous(f"tcp://127.0.0.1:{port}", WORLD, generation), timeout_s=60)
            groups = build_sync_groups(TRAINER, [1, 2, 3], timeout_s=timeout_s)
            payload_groups = new_payload_groups(timeout=60)
            receiver: PayloadReceiver | None = None
            if rank == TRAINER:
                recover_weights(
                    groups, weights=trainer_weights(version), version=version, config=config
                )
                receiver = PayloadReceiver(
                    payload_groups, [1, 2, 3], window=16, default_timeout=timeout_s
                )
                p2r = groups.p2r_transfer(config=config)
                assert p2r is not None
                pusher = TransferWeightPusher(p2r, barrier=groups.p2r_barrier, receiver=receiver)
            else:
                assert worker is not None and backend is not None
                worker.use_groups(groups, config=config)
                recover_weights(groups, worker=worker, config=config)
                sender = PayloadSender(
                    payload_groups, TRAINER, capacity=256, default_timeout=timeout_s
                )
                worker.data_packer = sender
                for tensors, meta in carried:
                    sender.register_payload(tensors, meta)
                    registered.append(meta["id"])
                carried = []
            conn.send(("ready", generation, rank, time.monotonic()))
            hooks_at = plan["step"] if victim else -1
            for step in range(1, plan["steps"] + 1):
                if step == hooks_at:
                    point, bucket = plan["point"], plan["bucket"]
                    if point == "idle":
                        die("idle")

                    def hook(
                        k: int, flat: torch.Tensor, point: str = point, bucket: int = bucket
                    ) -> None:
                        if k == bucket:
                            die(point)

                    if point == "mid_p2r":
                        transfer = pusher.transfer if rank == TRAINER else worker.p2r  # type: ignore[union-attr]
                        assert transfer is not None
                        transfer.hooks = (
                            TransferHooks(after_pack=hook)
                            if rank == TRAINER
                            else TransferHooks(after_receive=hook)
                        )
                    elif point == "mid_r2r":
                        assert worker is not None and worker.r2r is not None
                        worker.r2r.hooks = (
                            TransferHooks(after_pack=hook)
                            if rank == RELAY
                            else TransferHooks(after_receive=hook)
                        )
                    elif point == "mid_payload":
                        original = torch.distributed.batch_isend_irecv

                        def dying(ops: Any, original: Any = original) -> Any:
                            die("mid_payload")
                            return original(ops)

                        torch.distributed.batch_isend_irecv = dying
                if rank == TRAINER:
                    assert receiver is not None
                    window_end = time.monotonic() + 0.05
                    while time.monotonic() < window_end:
                        try:
                            taken = receiver.get(timeout=max(0.001, window_end - time.monotonic()))
                        except PayloadTimeout:
                            break
                        conn.send(("took", taken.meta["id"]))
                    pusher.push_weights(
                        trainer_weights(version + 1), version=version + 1, timeout=timeout_s
                    )
                    version += 1
                    conn.send(("committed", version))
                else:
                    assert worker is not None and backend is not None and sender is not None
                    for _ in range(PAYLOADS_PER_STEP):
                        payload_id = f"{rank}-{payload_counter}"
                        payload_counter += 1
                        sender.register_payload({"tokens": torch.arange(32)}, {"id": payload_id})
                        registered.append(payload_id)
                    serve()
                    results = []
                    if rank == RELAY:
                        results.append(worker.handle(P2R(step=step)))
                    results.append(worker.handle(R2R(step=step)))
                    failed = [r for r in results if not r.ok]
                    acked = sender.statistics().acknowledged
                    conn.send(("acked", rank, registered[:acked]))
                    if failed and failed[0].exception is not None:
                        raise failed[0].exception
            if victim:
                die("end")  # the placed point was never reached (no credit, say): die here
            if plan["final"]:
                if rank == TRAINER:
                    digest = weights_digest(trainer_weights(version))
                    conn.send(("final", rank, {"version": version, "digest": digest}))
                else:
                    assert backend is not None
                    conn.send(
                        (
                            "final",
                            rank,
                            {
                                "version": backend.weight_version,
                                "digest": weights_digest(backend.served_weights()),
                                "torn": backend.weights_torn,
                            },
                        )
                    )
            conn.send(("finished", generation, rank, time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - reported; the controller moves on
            if backend is not None:
                # A replica whose sync failed may be torn: it must refuse to generate.
                try:
                    serve()
                except Exception:  # noqa: BLE001, S110 - a pause still held, say: not served
                    pass
            conn.send(("broken", generation, rank, f"{type(exc).__name__}: {exc}"[:300]))
        finally:
            if sender is not None:
                unacked = sender.unacknowledged()
                acked = sender.statistics().acknowledged
                conn.send(("acked", rank, registered[:acked]))
                carried = unacked


# -- the controller ----------------------------------------------------------------------------


class _Job:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ctx = mp.get_context("spawn")
        self.procs: dict[int, Any] = {}
        self.conns: dict[int, Connection] = {}
        self.committed = 0
        self.took: set[str] = set()
        self.acked: set[str] = set()
        self.finals: dict[int, dict[str, Any]] = {}
        self.dying: dict[int, str] = {}
        self.events: Counter[str] = Counter()

    def start(self, rank: int) -> None:
        mine, theirs = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=_member,
            args=(rank, theirs, self.committed, self.args.timeout),
            name=f"chaos-{ROLES[rank]}-{rank}",
            daemon=True,
        )
        proc.start()
        self.procs[rank], self.conns[rank] = proc, mine

    def restart_all(self) -> None:
        """After a hang: kill every process and start the job afresh (replicas empty, the
        trainer at its last committed version)."""
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
        for proc in self.procs.values():
            proc.join(10)
        for rank in range(WORLD):
            self.start(rank)

    def drain(self, rank: int) -> list[Any]:
        """Every message waiting from ``rank``; bookkeeping ones are applied here."""
        out = []
        conn = self.conns[rank]
        while True:
            try:
                if not conn.poll():
                    return out
                message = conn.recv()
            except (EOFError, OSError):
                return out
            kind = message[0]
            if kind == "took":
                self.took.add(message[1])
            elif kind == "acked":
                self.acked.update(message[2])
            elif kind == "committed":
                self.committed = max(self.committed, message[1])
            elif kind == "dying":
                self.dying[message[1]] = message[2]
            elif kind == "final":
                self.finals[message[1]] = message[2]
            elif kind in ("refused", "torn_served"):
                self.events[kind] += 1
            else:
                out.append(message)

    def run_generation(
        self, generation: int, plan: dict[str, Any], *, deadline_s: float
    ) -> dict[str, Any]:
        """Send the plan, wait for every process's outcome (and the victim's death)."""
        from rollout_sync.distributed import find_free_port

        port = find_free_port()
        for conn in self.conns.values():
            conn.send(("join", generation, port, plan))
        ready: dict[int, float] = {}
        outcome: dict[int, str] = {}
        died_at: float | None = None
        deadline = time.monotonic() + deadline_s
        victim = plan["victim"]
        while time.monotonic() < deadline:
            for rank in list(self.conns):
                for message in self.drain(rank):
                    if message[0] == "ready" and message[1] == generation:
                        ready[rank] = message[3]
                    elif message[0] in ("broken", "finished") and message[1] == generation:
                        outcome[rank] = message[0] if message[0] == "finished" else message[3]
            if victim is not None and died_at is None and not self.procs[victim].is_alive():
                died_at = time.monotonic()
                self.drain(victim)
            survivors = [r for r in self.conns if r != victim]
            if all(r in outcome for r in survivors) and (victim is None or died_at is not None):
                return {"ready": ready, "outcome": outcome, "died_at": died_at, "hang": False}
            time.sleep(0.005)  # polling pipes and a process's liveness
        return {"ready": ready, "outcome": outcome, "died_at": died_at, "hang": True}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeout", type=float, default=3.0, help="every collective's limit, seconds (default 3)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    started = time.monotonic()
    job = _Job(args)
    for rank in range(WORLD):
        job.start(rank)
    rows: list[dict[str, Any]] = []
    recovery_s: list[float] = []
    hangs = 0
    bound = args.timeout * 8 + 60
    # Generation 0 forms the job; each round then kills in generation r and recovers in r + 1.
    plan: dict[str, Any] = {"victim": None, "steps": 1, "final": False, "step": 0}
    result = job.run_generation(0, plan, deadline_s=bound)
    if result["hang"]:
        raise SystemExit(f"the job did not form: {result}")
    print(f"{'round':>5} {'victim':<10}{'point':<13}{'recovery s':>11}  outcome of the others")
    for round_index in range(1, args.rounds + 1):
        point = rng.choice(sorted(POINTS))
        victim = rng.choice(POINTS[point])
        plan = {
            "victim": victim,
            "point": point,
            "step": rng.randint(1, 2),
            "bucket": rng.randint(0, 3),
            "steps": 3,
            "final": False,
        }
        result = job.run_generation(round_index, plan, deadline_s=bound)
        if result["hang"] or result["died_at"] is None:
            hangs += 1
            job.restart_all()
            rows.append({"round": round_index, "victim": victim, "point": point, "hang": True})
            print(f"{round_index:>5} HANG: {result}")
            continue
        job.procs[victim].join(10)
        job.start(victim)  # the restart takes the dead one's rank
        actual = job.dying.pop(victim, point)
        # The next generation is this round's recovery: its plan kills nobody.
        recovered = job.run_generation(
            round_index + 10_000,
            {"victim": None, "steps": 1, "final": False, "step": 0},
            deadline_s=bound,
        )
        if recovered["hang"] or len(recovered["ready"]) < WORLD:
            hangs += 1
            job.restart_all()
            rows.append({"round": round_index, "victim": victim, "point": actual, "hang": True})
            print(f"{round_index:>5} HANG in recovery: {recovered}")
            continue
        took = max(recovered["ready"].values()) - result["died_at"]
        recovery_s.append(took)
        others = Counter(
            "ok" if o == "finished" else o.split(":")[0] for o in result["outcome"].values()
        )
        rows.append(
            {
                "round": round_index,
                "victim": f"{ROLES[victim]}:{victim}",
                "point": actual,
                "recovery_s": took,
                "others": dict(others),
            }
        )
        print(
            f"{round_index:>5} {ROLES[victim] + ':' + str(victim):<10}{actual:<13}{took:>11.2f}  "
            + ", ".join(f"{k} x{v}" for k, v in sorted(others.items()))
        )
    # A last clean generation: every replica must now serve the trainer's version, whole.
    final = job.run_generation(
        99_999, {"victim": None, "steps": 2, "final": True, "step": 0}, deadline_s=bound
    )
    for rank in range(WORLD):
        job.drain(rank)
    for conn in job.conns.values():
        conn.send(("exit",))
    for proc in job.procs.values():
        proc.join(30)
    trainer = job.finals.get(TRAINER, {})
    replicas = [job.finals.get(r, {}) for r in (1, 2, 3)]
    converged = (
        not final["hang"]
        and bool(trainer)
        and all(
            r.get("digest") == trainer["digest"]
            and r.get("version") == trainer["version"]
            and not r.get("torn")
            for r in replicas
        )
    )
    kills = Counter(f"{r['victim'].split(':')[0]}/{r['point']}" for r in rows if "recovery_s" in r)
    summary = {
        "rounds": args.rounds,
        "kills": dict(sorted(kills.items())),
        "torn_served": job.events["torn_served"],
        "refused_while_torn": job.events["refused"],
        "acked_payloads_lost": len(job.acked - job.took),
        "payloads_acked": len(job.acked),
        "payloads_taken": len(job.took),
        "converged": converged,
        "final_version": trainer.get("version"),
        "recovery_s_p50": round(percentile(recovery_s, 50), 2) if recovery_s else None,
        "recovery_s_p99": round(percentile(recovery_s, 99), 2) if recovery_s else None,
        "hangs": hangs,
        "timeout_s": args.timeout,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(
        f"\n{summary['rounds']} rounds in {summary['wall_s']} s: torn served "
        f"{summary['torn_served']}, acknowledged payloads lost {summary['acked_payloads_lost']} "
        f"(of {summary['payloads_acked']}), converged {summary['converged']}, hangs "
        f"{summary['hangs']}; recovery p50 {summary['recovery_s_p50']} s, p99 "
        f"{summary['recovery_s_p99']} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))
    print(json.dumps(summary))
    ok = (
        summary["torn_served"] == 0
        and summary["acked_payloads_lost"] == 0
        and converged
        and hangs == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
