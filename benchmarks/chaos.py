"""Chaos: the job as users run it - replicas in their command loops, the trainer's callback -
while processes get killed, and recovered by the documented calls.

Four processes (gloo on loopback): rank 0 the trainer, rank 1 the relay (P2R receiver, R2R
source), ranks 2 and 3 leaves. Each replica is a ``RolloutWorker`` in ``worker.run()`` taking
``StoreCommandQueue`` commands, while a thread of its own generates with the tiny LM and ships
payloads through a ``PayloadSender`` (the worker's ``data_packer``). The trainer runs a training
loop whose ``WeightBroadcastCallback.step_end`` announces each step on a
``WorkerCommandChannel`` and pushes through a ``TransferWeightPusher`` (P2R barrier, payload
receive hold); between steps it takes the payloads that arrived. ``train_end`` sends ``Stop``.

Every round, the controller (this process) kills one process of the running job:

* ``any_moment`` (anyone): SIGKILLed from outside at a random wall-clock moment of the round;
* ``mid_p2r`` (trainer or relay), ``mid_r2r`` (relay or leaf): inside a random bucket of a
  random step's transfer, placed by a transfer hook (the victim ends itself with
  ``os._exit``: a SIGKILL as far as its peers can tell);
* ``mid_payload`` (anyone): inside a payload transfer, after both ends agreed.

Once the victim is dead, the controller tells every survivor (``worker.interrupt()`` on a
replica, which makes ``run()`` raise ``RunInterrupted``; a flag the trainer's loop checks
between steps), restarts the victim, and hands out a new rendezvous. Every process then runs
docs/distributed.md's recovery (``rejoin``, ``build_sync_groups``, ``new_payload_groups``,
``use_groups``, ``recover_weights``, ``command_queues``, ``callback.use_pusher``), senders
register again what the trainer had not acknowledged, and the replicas go back into
``worker.run()``. A last clean round pushes ``--final-steps`` versions.

Measured: ``torn_served`` (forwards that the LM's seqlock saw read a write in progress, and
generations a torn replica served when asked right after its loop broke: must be 0; a torn
replica refuses instead, counted in ``refused_while_torn``), ``acked_payloads_lost``
(payloads a sender was told were acknowledged that the trainer never took: must be 0),
``mismatched_commits`` (a replica committed a version whose bytes differ from the trainer's:
must be 0), ``converged`` (the last round's every push landed bit-identically on every replica,
``final_pushes_identical`` of them, and nobody is torn), ``recovery_s`` (the victim's death seen
by the controller until every process of the new job reports ready: interrupt, restart,
rendezvous, groups, re-seed; ``survivors_out_s`` is its first part, the death until the last
survivor left its loop) and ``hangs`` (must be 0).

``--staged`` runs every replica's worker in ``SyncMode.STAGED`` (stage, then swap, two-phase:
a version is installed on every replica of a sync or on none); the default is ``SyncMode.SYNC``
(in place, parked for the whole transfer). Two more numbers say what a death mid-wire leaves
behind, measured the same way in both modes from what each replica reports after every command
(its ``CommandResult``: ok, ``weight_version``, ``committed_at``) and at every check below:

* ``torn_replicas``: (replica, round) pairs in which the replica was found with torn served
  weights at any check - after each command, by its generation thread (a refused request), when
  its loop broke, at the end. In place a death mid-wire tears the receivers, to be re-seeded;
  with ``--staged`` it must be 0: the served weights are written only by the install.
* ``mixed_versions``: syncs after which the live replicas of the sync serve different versions
  while at least one of them committed in it. A sync is one trainer step of one round (its P2R
  and R2R commands); every replica is in every sync. A replica committed in it when one of its
  commands of that step reports ``committed_at`` within the command (a commit made outside any
  command, a re-seed, is not one). A replica is live through the sync when it survived the
  round, or (the round's victim) it reported the result of its last command of that step or of
  a later one. What it serves after the sync is the ``weight_version`` of its last result of
  that step (else its version before it); a replica torn by the sync still counts its old
  version, so a receive that failed while another replica installed is mixed. A commit by a
  victim that then died counts: it served that version while the others did not. In place the
  relay commits at its P2R, before any leaf has received, so a death in the R2R leaves the fleet
  mixed until the re-seed; with ``--staged`` it must be 0.

``stall_ms_p50`` (and p99) is over (replica, sync): how long that replica's generation was
parked for the sync (the sum of ``SyncReport.stall_s`` over its commands of that step; re-seeds
excluded): the whole transfer in place, the install alone staged. ``skew_ms_p50`` is over the
syncs every replica committed in: the last ``committed_at`` minus the first (how long the fleet
served two versions). ``syncs_committed`` counts the syncs some replica committed in; ``mixed``
lists each mixed one: who committed what, and what every live replica served after it.

    python benchmarks/chaos.py                       # 20 rounds, ~2-3 min on 2 cores
    python benchmarks/chaos.py --rounds 40 --seed 3
    python benchmarks/chaos.py --kill leaf:any_moment --kill trainer:any_moment
    python benchmarks/chaos.py --rounds 6 --staged   # staged, two-phase syncs
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import random
import sys
import threading
import time
from collections import Counter, defaultdict
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_sync.metrics import percentile  # noqa: E402 - the path is set up above

WORLD = 4
TRAINER, RELAY, LEAVES = 0, 1, (2, 3)
REPLICAS = (1, 2, 3)
ROLES = {0: "trainer", 1: "relay", 2: "leaf", 3: "leaf"}
POINTS = {
    "any_moment": (0, 1, 2, 3),
    "mid_p2r": (0, 1),
    "mid_r2r": (1, 2, 3),
    "mid_payload": (0, 1, 2, 3),
}
STEPS_PER_ROUND = 3
TRAIN_WINDOW_S = 0.05
"""The trainer's stand-in for a training step: it takes payloads for this long."""


# -- a member of the job -----------------------------------------------------------------------


class _ControllerLink:
    """A member's end of its pipe to the controller. A thread reads it: ``join`` messages
    queue up for the member's main thread; ``interrupt`` is acted on at once (the main thread
    may be inside ``worker.run()`` or a training step); ``exit`` ends the process."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.joins: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.interrupted = threading.Event()
        self.on_interrupt: Any = None
        self._send_lock = threading.Lock()
        threading.Thread(target=self._read, name="controller-link", daemon=True).start()

    def send(self, *message: Any) -> None:
        with self._send_lock:
            self.conn.send(message)

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                message = ("exit",)  # the controller is gone
            if message[0] == "exit":
                # Payload readers of broken generations may still block in native code: leave
                # without the interpreter's teardown, which would wait on (or abort at) them.
                os._exit(0)
            if message[0] == "interrupt":
                self.interrupted.set()
                if self.on_interrupt is not None:
                    self.on_interrupt(message[1])
            else:
                self.joins.put(message)


def _member(
    rank: int, conn: Connection, trainer_version: int, timeout_s: float, staged: bool
) -> None:
    """One process of the job, for as many generations as the controller runs it."""
    import torch

    torch.set_num_threads(1)
    from rollout_sync import (
        RolloutWorker,
        SyncMode,
        TransferConfig,
        TransferHooks,
        WeightBroadcastCallback,
        WorkerCommandChannel,
        build_sync_groups,
    )
    from rollout_sync.backends import TinyLMConfig, TorchLMBackend, tiny_lm_weights
    from rollout_sync.errors import (
        PayloadBackpressureTimeout,
        PayloadTimeout,
        RolloutSyncError,
        TornWeightsError,
    )
    from rollout_sync.launch import command_queues
    from rollout_sync.payload import PayloadReceiver, PayloadSender, new_payload_groups
    from rollout_sync.recovery import Rendezvous, recover_weights, rejoin
    from rollout_sync.testing import weights_digest
    from rollout_sync.trainer import TransferWeightPusher
    from rollout_sync.worker import P2R, R2R, CommandResult

    link = _ControllerLink(conn)
    lm = TinyLMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=64)
    config = TransferConfig(bucket_bytes=8 << 10, timeout_s=timeout_s)

    def trainer_weights(version: int) -> dict[str, torch.Tensor]:
        return tiny_lm_weights(lm, seed=10_000 + version)

    def die(point: str) -> None:
        link.send("dying", rank, point)  # a pipe write: it has arrived when send returns
        os._exit(9)

    def dying_hook(transfer_index: int, bucket: int, point: str) -> Any:
        """A transfer hook that ends this process in bucket ``bucket`` of its
        ``transfer_index``-th transfer from now (1-based; a transfer starts at bucket 0)."""
        seen = [0]

        def hook(k: int, flat: torch.Tensor) -> None:
            if k == 0:
                seen[0] += 1
            if seen[0] == transfer_index and k == bucket:
                die(point)

        return hook

    def die_mid_payload(calls: int) -> None:
        original = torch.distributed.batch_isend_irecv
        seen = [0]

        def dying(ops: Any) -> Any:
            seen[0] += 1
            if seen[0] >= calls:
                die("mid_payload")
            return original(ops)

        torch.distributed.batch_isend_irecv = dying

    # -- the trainer ---------------------------------------------------------------------------

    def run_trainer() -> None:
        callback: WeightBroadcastCallback | None = None

        def next_weights() -> dict[str, torch.Tensor]:
            """The training step's result: the weights of the next version."""
            assert callback is not None
            return trainer_weights(callback.version + 1)

        while True:
            _, generation, port, plan = link.joins.get()
            link.interrupted.clear()  # the recovery it asked for starts now
            victim = plan["victim"] == rank
            try:
                # docs/distributed.md, Recovery: the trainer's calls.
                version = trainer_version if callback is None else callback.version
                rejoin(rank, Rendezvous(f"tcp://127.0.0.1:{port}", WORLD, generation), timeout_s=60)
                groups = build_sync_groups(TRAINER, list(REPLICAS), timeout_s=timeout_s)
                payload_groups = new_payload_groups(timeout=60)
                recover_weights(
                    groups, weights=trainer_weights(version), version=version, config=config
                )
                receiver = PayloadReceiver(
                    payload_groups, list(REPLICAS), window=16, default_timeout=timeout_s
                )
                p2r = groups.p2r_transfer(config=config)
                assert p2r is not None
                pusher = TransferWeightPusher(p2r, barrier=groups.p2r_barrier, receiver=receiver)
                channel = WorkerCommandChannel.for_groups(groups, command_queues(groups.replicas))
                if callback is None:
                    callback = WeightBroadcastCallback(
                        next_weights,
                        pusher=pusher,
                        channel=channel,
                        timeout=timeout_s,
                        initial_version=version,
                        sync_on_run_begin=False,
                    )
                else:
                    callback.use_pusher(pusher, channel=channel)
                link.send("ready", generation, rank, time.monotonic())
                for step in range(1, plan["steps"] + 1):
                    if link.interrupted.is_set():
                        raise RolloutSyncError("interrupted by the controller")
                    if victim and step == plan["step"]:
                        if plan["point"] == "mid_p2r":
                            pusher.transfer.hooks = TransferHooks(
                                after_pack=dying_hook(1, plan["bucket"], "mid_p2r")
                            )
                        elif plan["point"] == "mid_payload":
                            die_mid_payload(plan["calls"])
                    window_end = time.monotonic() + TRAIN_WINDOW_S
                    while time.monotonic() < window_end:
                        try:
                            taken = receiver.get(timeout=max(0.001, window_end - time.monotonic()))
                        except PayloadTimeout:
                            break
                        link.send("took", taken.meta["id"])
                    callback.step_end(step, train_metrics={})
                    link.send(
                        "pushed",
                        callback.version,
                        weights_digest(trainer_weights(callback.version)),
                        generation,
                    )
                if victim and plan["point"] != "any_moment":
                    die("end")  # the placed point was never reached: die here
                callback.train_end(plan["steps"])  # Stop to every replica
                link.send("finished", generation, rank, time.monotonic())
            except Exception as exc:  # noqa: BLE001 - reported; the controller moves on
                link.send("broken", generation, rank, f"{type(exc).__name__}: {exc}"[:300])

    # -- a replica -----------------------------------------------------------------------------

    def run_replica() -> None:
        backend = TorchLMBackend(lm, pause_timeout=timeout_s)
        generation_now = [0]
        reports_seen = [0]  # sync reports already harvested (worker.statistics() counts them)

        def stalled_since() -> float:
            """Generation parked by the sync reports since the last call, seconds."""
            total = worker.statistics().sync_reports_total
            new, reports_seen[0] = total - reports_seen[0], total
            recent = list(worker.sync_reports)
            return sum(r.stall_s for r in recent[max(0, len(recent) - new) :]) if new > 0 else 0.0

        def report_result(result: CommandResult) -> None:
            """Every command's outcome, for the controller's torn and mixed-version counts."""
            if not isinstance(result.command, (P2R, R2R)):
                return
            # committed_at is set only by a commit inside this command (the worker resets it
            # at each command's start: a re-seed's, outside any command, is not counted).
            committed = result.committed_at is not None
            if committed:
                # The served weights right after the commit: only this thread writes them.
                digest = weights_digest(backend.served_weights())
                link.send("commit", rank, result.weight_version, digest)
            link.send(
                "result",
                rank,
                generation_now[0],
                "p2r" if isinstance(result.command, P2R) else "r2r",
                result.command.step,
                {
                    "ok": result.ok,
                    "version": result.weight_version,
                    "committed_at": result.committed_at if committed else None,
                    "stall_s": stalled_since(),
                    "torn": backend.weights_torn,
                    "error": None if result.ok else (result.error or "")[:200],
                },
            )

        worker = RolloutWorker(
            backend,
            weight_sync_timeout=timeout_s,
            on_result=report_result,
            mode=SyncMode.STAGED if staged else SyncMode.SYNC,
        )
        link.on_interrupt = worker.interrupt
        sender: PayloadSender | None = None
        commands: Any = None
        registered: list[str] = []
        reported = [0]  # how many of `registered` were reported acknowledged
        counter = [0]
        torn_forwards = [0]

        def report_acked(of: PayloadSender) -> None:
            acked = of.statistics().acknowledged
            if acked > reported[0]:
                link.send("acked", rank, registered[reported[0] : acked])
                reported[0] = acked

        def generate(of: PayloadSender, stop: threading.Event) -> None:
            """Generation on its own thread, as a serving engine would: one short request at
            a time, a payload for each. The worker's guard parks it during every sync."""
            while not stop.is_set():
                try:
                    backend.generate([[1, 2, 3]], max_new_tokens=3, timeout=timeout_s)
                except TornWeightsError:
                    link.send("refused", rank, generation_now[0])
                    stop.wait(0.05)  # a torn replica: ask again later, not in a tight loop
                    continue
                except RolloutSyncError:
                    continue  # a pause outlasted the limit (the job breaking): try again
                seen = backend.torn_forwards  # the LM's seqlock: forwards that read a write
                if seen > torn_forwards[0]:
                    link.send("torn_served", rank)
                    torn_forwards[0] = seen
                payload_id = f"{rank}-{counter[0]}"
                counter[0] += 1
                try:
                    of.register_payload({"tokens": torch.arange(32)}, {"id": payload_id})
                except (PayloadBackpressureTimeout, RolloutSyncError):
                    continue  # full, or its transport broke: not registered, not promised
                registered.append(payload_id)
                report_acked(of)
                stop.wait(0.02)  # pacing: a few payloads per step

        while True:
            _, generation, port, plan = link.joins.get()
            generation_now[0] = generation
            victim = plan["victim"] == rank
            stop = threading.Event()
            generator: threading.Thread | None = None
            try:
                if commands is not None:
                    try:
                        commands.close(2.0)  # the old store's queue
                    except RolloutSyncError:
                        pass  # its store stopped answering: the reader is a daemon
                # docs/distributed.md, Recovery: a replica's calls.
                carried = sender.unacknowledged() if sender is not None else []
                rejoin(rank, Rendezvous(f"tcp://127.0.0.1:{port}", WORLD, generation), timeout_s=60)
                groups = build_sync_groups(TRAINER, list(REPLICAS), timeout_s=timeout_s)
                payload_groups = new_payload_groups(timeout=60)
                sender = PayloadSender(
                    payload_groups, TRAINER, capacity=256, default_timeout=timeout_s
                )
                worker.data_packer = sender  # before the re-seed, which holds it
                worker.use_groups(groups, config=config)
                recover_weights(groups, worker=worker, config=config)
                stalled_since()  # the re-seed's park is not a sync's
                # A new sender counts acknowledgements from 0: the carried ones come first.
                registered[:], reported[0] = [], 0
                for tensors, meta in carried:
                    sender.register_payload(tensors, meta)
                    registered.append(meta["id"])
                commands = command_queues([rank])[rank]
                worker.commands = commands
                if victim and plan["point"] == "mid_p2r":
                    assert worker.p2r is not None
                    worker.p2r.hooks = TransferHooks(
                        after_receive=dying_hook(plan["step"], plan["bucket"], "mid_p2r")
                    )
                elif victim and plan["point"] == "mid_r2r":
                    assert worker.r2r is not None
                    worker.r2r.hooks = (
                        TransferHooks(
                            after_pack=dying_hook(plan["step"], plan["bucket"], "mid_r2r")
                        )
                        if rank == RELAY
                        else TransferHooks(
                            after_receive=dying_hook(plan["step"], plan["bucket"], "mid_r2r")
                        )
                    )
                elif victim and plan["point"] == "mid_payload":
                    die_mid_payload(plan["calls"])
                link.send("ready", generation, rank, time.monotonic(), backend.weight_version)
                generator = threading.Thread(target=generate, args=(sender, stop), daemon=True)
                generator.start()
                worker.run(idle_timeout_s=600)  # until the trainer's Stop
                if victim and plan["point"] != "any_moment":
                    die("end")  # the placed point was never reached: die here
                outcome = ("finished", generation, rank, time.monotonic())
            except Exception as exc:  # noqa: BLE001 - reported; the controller moves on
                outcome = ("broken", generation, rank, f"{type(exc).__name__}: {exc}"[:300])
                if backend.weights_torn:
                    link.send("torn", rank, generation)
                    # Asked to serve now, a torn replica must refuse (counted either way).
                    try:
                        backend.generate([[1, 2, 3]], max_new_tokens=3, timeout=timeout_s)
                        link.send("torn_served", rank)
                    except TornWeightsError:
                        link.send("refused", rank, generation)
            stop.set()
            if generator is not None:
                generator.join(timeout_s * 3)
            if sender is not None:
                report_acked(sender)
            if plan["final"]:
                link.send(
                    "final",
                    rank,
                    {"version": backend.weight_version, "torn": backend.weights_torn},
                )
            link.send(*outcome)

    if rank == TRAINER:
        run_trainer()
    else:
        run_replica()


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
        self.pushed: dict[int, str] = {}
        """Version -> the trainer's digest of it."""
        self.pushed_in: dict[int, list[int]] = defaultdict(list)
        """Generation -> the versions pushed in it."""
        self.commits: dict[int, dict[int, str]] = defaultdict(dict)
        """Replica rank -> version -> digest of what it committed (the last commit of each)."""
        self.mismatched: list[tuple[int, int]] = []
        self.finals: dict[int, dict[str, Any]] = {}
        self.dying: dict[int, str] = {}
        self.events: Counter[str] = Counter()
        self.results: dict[tuple[int, int], list[tuple[str, int, dict[str, Any]]]] = defaultdict(
            list
        )
        """(generation, replica rank) -> its commands' outcomes in order: (kind, step, result)."""
        self.serving_at_ready: dict[tuple[int, int], int] = {}
        """(generation, replica rank) -> the version it served once recovered."""
        self.torn: set[tuple[int, int]] = set()
        """(generation, replica rank) found with torn served weights at some check."""
        self.victims: dict[int, int | None] = {}
        """Generation -> the rank killed in it."""

    def start(self, rank: int) -> None:
        mine, theirs = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=_member,
            args=(rank, theirs, self.committed, self.args.timeout, self.args.staged),
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
            elif kind == "pushed":
                version, digest, generation = message[1:]
                self.committed = max(self.committed, version)
                self.pushed[version] = digest
                self.pushed_in[generation].append(version)
            elif kind == "commit":
                self.commits[message[1]][message[2]] = message[3]
            elif kind == "result":
                rank_of, generation, command, step, result = message[1:]
                self.results[(generation, rank_of)].append((command, step, result))
                if result["torn"]:
                    self.torn.add((generation, rank_of))
            elif kind == "torn":
                self.torn.add((message[2], message[1]))
            elif kind == "dying":
                self.dying[message[1]] = message[2]
            elif kind == "final":
                self.finals[message[1]] = message[2]
            elif kind == "refused":
                self.events[kind] += 1
                self.torn.add((message[2], message[1]))
            elif kind == "torn_served":
                self.events[kind] += 1
            else:
                out.append(message)

    def interrupt(self, survivors: list[int], reason: str) -> None:
        for rank in survivors:
            try:
                self.conns[rank].send(("interrupt", reason))
            except (BrokenPipeError, OSError):
                pass  # that one is gone too: the round's bound catches it

    def run_generation(
        self, generation: int, plan: dict[str, Any], rng: random.Random, *, deadline_s: float
    ) -> dict[str, Any]:
        """Send the plan; kill the victim (at a random moment, or wait for it to die at its
        placed point); interrupt the survivors; wait for every outcome."""
        from rollout_sync.distributed import find_free_port

        port = find_free_port()
        self.victims[generation] = plan["victim"]
        for conn in self.conns.values():
            conn.send(("join", generation, port, plan))
        ready: dict[int, float] = {}
        outcome: dict[int, str] = {}
        ended: dict[int, float] = {}
        died_at: float | None = None
        kill_at: float | None = None
        deadline = time.monotonic() + deadline_s
        victim = plan["victim"]
        survivors = [r for r in self.conns if r != victim]
        while time.monotonic() < deadline:
            for rank in list(self.conns):
                for message in self.drain(rank):
                    if message[0] == "ready" and message[1] == generation:
                        ready[rank] = message[3]
                        if len(message) > 4:
                            self.serving_at_ready[(generation, rank)] = message[4]
                    elif message[0] in ("broken", "finished") and message[1] == generation:
                        outcome[rank] = message[0] if message[0] == "finished" else message[3]
                        ended[rank] = time.monotonic()
            if victim is not None and died_at is None:
                if kill_at is None and plan["point"] == "any_moment" and len(ready) == WORLD:
                    kill_at = time.monotonic() + rng.uniform(0, plan["within_s"])
                if kill_at is not None and time.monotonic() >= kill_at:
                    self.procs[victim].kill()  # SIGKILL, from outside
                    kill_at = float("inf")
                if not self.procs[victim].is_alive():
                    died_at = time.monotonic()
                    self.drain(victim)
                    self.interrupt(survivors, f"rank {victim} died (generation {generation})")
            if all(r in outcome for r in survivors) and (victim is None or died_at is not None):
                return {
                    "ready": ready,
                    "outcome": outcome,
                    "ended": ended,
                    "died_at": died_at,
                    "hang": False,
                }
            time.sleep(0.005)  # polling pipes and a process's liveness
        return {
            "ready": ready,
            "outcome": outcome,
            "ended": ended,
            "died_at": died_at,
            "hang": True,
        }

    def mixed_versions(self) -> tuple[list[dict[str, Any]], int]:
        """The syncs after which live replicas serve different versions while one of them
        committed in it (the module docstring defines each word), each with who committed what
        and what every live replica served after it; and how many syncs some replica committed
        in."""
        mixed = []
        syncs_committed = 0
        for generation, victim in sorted(self.victims.items()):
            outcomes = {r: self.results.get((generation, r), []) for r in REPLICAS}
            for step in sorted({s for mine in outcomes.values() for _, s, _ in mine}):
                committed = {
                    r: result["version"]
                    for r, mine in outcomes.items()
                    for _, s, result in mine
                    if s == step and result["committed_at"] is not None
                }
                if not committed:
                    continue
                syncs_committed += 1
                serving = {}
                for r, mine in outcomes.items():
                    # Every replica's last command of a step is its R2R.
                    if r == victim and not any(
                        s > step or (s == step and c == "r2r") for c, s, _ in mine
                    ):
                        continue  # it died before the sync was over
                    before = [result["version"] for _, s, result in mine if s <= step]
                    if before:
                        serving[r] = before[-1]
                    elif (generation, r) in self.serving_at_ready:
                        serving[r] = self.serving_at_ready[(generation, r)]
                if len(set(committed.values()) | set(serving.values())) > 1:
                    mixed.append(
                        {
                            "round": generation,
                            "step": step,
                            "committed": committed,
                            "serving": serving,
                        }
                    )
        return mixed, syncs_committed

    def stalls_s(self) -> list[float]:
        """Per (replica, sync): how long its generation was parked for that sync."""
        per_sync: dict[tuple[int, int, int], float] = defaultdict(float)
        for (generation, rank), mine in self.results.items():
            for _, step, result in mine:
                per_sync[(generation, rank, step)] += result["stall_s"]
        return list(per_sync.values())

    def skews_s(self) -> list[float]:
        """Per sync every replica committed in: the last commit's time minus the first's (how
        long two replicas served different versions)."""
        at: dict[tuple[int, int], list[float]] = defaultdict(list)
        for (generation, _), mine in self.results.items():
            for _, step, result in mine:
                if result["committed_at"] is not None:
                    at[(generation, step)].append(result["committed_at"])
        return [max(t) - min(t) for t in at.values() if len(t) == len(REPLICAS)]

    def check_commits(self) -> None:
        """Every version a replica committed must be the trainer's bytes of that version."""
        self.mismatched = [
            (rank, version)
            for rank, commits in self.commits.items()
            for version, digest in commits.items()
            if version in self.pushed and digest != self.pushed[version]
        ]


def _parse_kill(text: str) -> tuple[int, str]:
    """``WHO:POINT`` (WHO: trainer, relay, leaf or a rank) -> (rank, point)."""
    who, _, point = text.partition(":")
    if point not in POINTS:
        raise argparse.ArgumentTypeError(f"point must be one of {sorted(POINTS)}, got {point!r}")
    ranks = {"trainer": (TRAINER,), "relay": (RELAY,), "leaf": LEAVES}.get(who)
    rank = ranks[-1] if ranks else int(who) if who.isdigit() else -1
    if rank not in POINTS[point]:
        raise argparse.ArgumentTypeError(f"{who} cannot be killed at {point}")
    return rank, point


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=None, help="default 20, or one per --kill")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kill",
        type=_parse_kill,
        action="append",
        default=[],
        metavar="WHO:POINT",
        help="the rounds' kills in order instead of random ones (WHO: trainer, relay, leaf or "
        f"a rank; POINT: {', '.join(sorted(POINTS))}); moments and buckets stay random",
    )
    parser.add_argument(
        "--timeout", type=float, default=3.0, help="every collective's limit, seconds (default 3)"
    )
    parser.add_argument(
        "--final-steps", type=int, default=3, help="pushes of the last, clean round (default 3)"
    )
    parser.add_argument(
        "--staged",
        action="store_true",
        help="replicas run SyncMode.STAGED (stage, then swap; every replica of a sync installs "
        "or none); torn_replicas and mixed_versions must then be 0",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else len(args.kill) or 20
    rng = random.Random(args.seed)
    started = time.monotonic()
    job = _Job(args)
    for rank in range(WORLD):
        job.start(rank)
    rows: list[dict[str, Any]] = []
    recovery_s: list[float] = []
    survivors_out_s: list[float] = []
    """From the death to the last survivor out of its loop (interrupted, or failed)."""
    hangs = 0
    bound = args.timeout * 8 + 60
    # Generation 0 forms the job; round r kills in generation r, and generation r + 1 (the
    # next round's) begins with the recovery.
    plan: dict[str, Any] = {"victim": None, "steps": 1, "final": False}
    result = job.run_generation(0, plan, rng, deadline_s=bound)
    if result["hang"]:
        raise SystemExit(f"the job did not form: {result}")
    print(f"{'round':>5} {'victim':<10}{'point':<13}{'recovery s':>11}  outcome of the others")
    last_death: tuple[float, int, str, dict[str, Any], dict[str, int]] | None = None
    for round_index in range(1, rounds + 2):
        final = round_index == rounds + 1
        if final:
            plan = {"victim": None, "steps": args.final_steps, "final": True}
        else:
            if round_index <= len(args.kill):
                victim, point = args.kill[round_index - 1]
            else:
                point = rng.choice(sorted(POINTS))
                victim = rng.choice(POINTS[point])
            plan = {
                "victim": victim,
                "point": point,
                "step": rng.randint(1, STEPS_PER_ROUND),
                "bucket": rng.randint(0, 3),
                "calls": rng.randint(1, 6),
                "within_s": 1.0,
                "steps": STEPS_PER_ROUND,
                "final": False,
            }
        result = job.run_generation(round_index, plan, rng, deadline_s=bound)
        if last_death is not None:
            died_at, victim_before, point_before, others, placed = last_death
            if result["hang"] or len(result["ready"]) < WORLD:
                hangs += 1
                print(f"{round_index - 1:>5} HANG in recovery: {result}")
                rows.append({"round": round_index - 1, "hang": True})
            else:
                took = max(result["ready"].values()) - died_at
                recovery_s.append(took)
                rows.append(
                    {
                        "round": round_index - 1,
                        "victim": f"{ROLES[victim_before]}:{victim_before}",
                        "point": point_before,
                        **placed,
                        "recovery_s": took,
                        "others": others,
                    }
                )
                print(
                    f"{round_index - 1:>5} {ROLES[victim_before] + ':' + str(victim_before):<10}"
                    f"{point_before:<13}{took:>11.2f}  "
                    + ", ".join(f"{k} x{v}" for k, v in sorted(others.items()))
                )
            last_death = None
        if final:
            break
        victim = plan["victim"]
        if result["hang"] or result["died_at"] is None:
            hangs += 1
            job.restart_all()
            rows.append({"round": round_index, "victim": victim, "point": point, "hang": True})
            print(f"{round_index:>5} HANG: {result}")
            continue
        job.procs[victim].join(10)
        job.start(victim)  # the restart takes the dead one's rank
        actual = job.dying.pop(victim, plan["point"])
        others = Counter(
            "ok" if o == "finished" else o.split(":")[0]
            for rank, o in result["outcome"].items()
            if rank != victim
        )
        placed = {} if plan["point"] == "any_moment" else {"step": plan["step"]}
        if plan["point"] in ("mid_p2r", "mid_r2r"):
            placed["bucket"] = plan["bucket"]
        out_at = max(
            (t for rank, t in result["ended"].items() if rank != victim), default=result["died_at"]
        )
        survivors_out_s.append(max(0.0, out_at - result["died_at"]))
        last_death = (result["died_at"], victim, actual, dict(others), placed)
    for rank in range(WORLD):
        job.drain(rank)
    for conn in job.conns.values():
        try:
            conn.send(("exit",))
        except (BrokenPipeError, OSError):
            pass
    for proc in job.procs.values():
        proc.join(30)
    job.check_commits()
    job.torn |= {(rounds + 1, r) for r, final in job.finals.items() if final.get("torn")}
    mixed, syncs_committed = job.mixed_versions()
    stalls_ms = [s * 1e3 for s in job.stalls_s()]
    skews_ms = [s * 1e3 for s in job.skews_s()]
    final_versions = job.pushed_in.get(rounds + 1, [])
    identical = [
        v for v in final_versions if all(job.commits[r].get(v) == job.pushed[v] for r in REPLICAS)
    ]
    converged = (
        not result["hang"]
        and len(final_versions) == args.final_steps
        and len(identical) == len(final_versions)
        and all(
            job.finals.get(r, {}).get("version") == final_versions[-1]
            and not job.finals.get(r, {}).get("torn", True)
            for r in REPLICAS
        )
        if final_versions
        else False
    )
    kills = Counter(f"{r['victim'].split(':')[0]}/{r['point']}" for r in rows if "recovery_s" in r)
    summary = {
        "rounds": rounds,
        "mode": "staged" if args.staged else "sync",
        "kills": dict(sorted(kills.items())),
        "torn_served": job.events["torn_served"],
        "torn_replicas": len(job.torn),
        "mixed_versions": len(mixed),
        "mixed": mixed,
        "syncs_committed": syncs_committed,
        "refused_while_torn": job.events["refused"],
        "acked_payloads_lost": len(job.acked - job.took),
        "payloads_acked": len(job.acked),
        "payloads_taken": len(job.took),
        "mismatched_commits": len(job.mismatched),
        "commits_checked": sum(
            v in job.pushed for commits in job.commits.values() for v in commits
        ),
        "converged": converged,
        "final_pushes_identical": len(identical),
        "final_version": final_versions[-1] if final_versions else None,
        "recovery_s_p50": round(percentile(recovery_s, 50), 2) if recovery_s else None,
        "recovery_s_p99": round(percentile(recovery_s, 99), 2) if recovery_s else None,
        "survivors_out_s_p50": round(percentile(survivors_out_s, 50), 2)
        if survivors_out_s
        else None,
        "hangs": hangs,
        "stall_ms_p50": round(percentile(stalls_ms, 50), 2) if stalls_ms else None,
        "stall_ms_p99": round(percentile(stalls_ms, 99), 2) if stalls_ms else None,
        "skew_ms_p50": round(percentile(skews_ms, 50), 2) if skews_ms else None,
        "placed": [
            {k: r[k] for k in ("victim", "point", "step", "bucket") if k in r}
            for r in rows
            if "step" in r
        ],
        "timeout_s": args.timeout,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(
        f"\n{summary['rounds']} rounds ({summary['mode']}) in {summary['wall_s']} s: torn served "
        f"{summary['torn_served']}, torn replicas {summary['torn_replicas']}, mixed versions "
        f"{summary['mixed_versions']} (of {summary['syncs_committed']} syncs), acknowledged "
        f"payloads lost {summary['acked_payloads_lost']} "
        f"(of {summary['payloads_acked']}), mismatched commits {summary['mismatched_commits']} "
        f"(of {summary['commits_checked']}), converged {summary['converged']} "
        f"({summary['final_pushes_identical']} final pushes identical everywhere), hangs "
        f"{summary['hangs']}; recovery p50 {summary['recovery_s_p50']} s, p99 "
        f"{summary['recovery_s_p99']} s; stall p50 {summary['stall_ms_p50']} ms"
    )
    if args.json:
        commands = {f"{g}/{r}": mine for (g, r), mine in sorted(job.results.items())}
        Path(args.json).write_text(
            json.dumps({"rows": rows, "summary": summary, "commands": commands}, indent=2)
        )
    print(json.dumps(summary))
    ok = (
        summary["torn_served"] == 0
        and summary["acked_payloads_lost"] == 0
        and summary["mismatched_commits"] == 0
        and converged
        and hangs == 0
        # In place these two measure the hazard (the contrast); staged they are the contract.
        and (not args.staged or (summary["torn_replicas"] == 0 and summary["mixed_versions"] == 0))
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
