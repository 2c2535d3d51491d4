"""Soak: a week of weight syncs in a few minutes, to show that nothing grows.

The in-process job: a trainer and three replicas on threads of one process. The trainer's
``WeightBroadcastCallback`` announces every step on a ``WorkerCommandChannel`` and pushes the
weights over an in-process bucketed wire (``_LoopbackTransfer``, a
``rollout_sync.worker.SupportsWeightTransfer``: manifest, small buckets, one vote per receiver).
Each replica is a ``RolloutWorker`` in ``worker.run()`` over a ``TornReadBackend`` (a tiny
``VersionStampedModel`` served on its own thread, one payload per forward into a packer whose
sender thread ships it). Replica 1 receives the P2R and is the R2R source for replicas 2 and 3.

Every ``--fail-every`` syncs one transfer dies half-way, placed as data (version, replica): the
replica writes the first bucket, then its receive raises ``WeightTransferError``; the worker marks
it torn and keeps its engine parked, and the next sync must recover it. The victims take turns:
replica 1 in the P2R (its R2R then aborts, and replicas 2 and 3 keep their version), replicas 2
and 3 in the R2R.

Checked, on the last stdout line (one JSON object):

* ``rss_growth_ratio``: resident memory at the end over after the first 1,000 syncs (both read
  after a ``gc.collect()``, from /proc/self/status); must be <= 1.05;
* ``torn_reads``: forwards that saw two versions (0);
* ``bit_identical``: every version any replica received or sent equals the trainer's, bit for
  bit, and every replica ends on the trainer's last version;
* every failure left its replica torn (``torn_after_failure``) and a later sync recovered it
  (``recovered``).

    python benchmarks/soak.py [--syncs 10000] [--fail-every 100] [--history 1024]

Exit status 0 when every check holds.
"""

from __future__ import annotations

import argparse
import gc
import json
import queue
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from rollout_sync import RolloutWorker, WeightBroadcastCallback, WorkerCommandChannel
from rollout_sync.errors import ManifestRejected, WeightTransferError, WeightTransferTimeout
from rollout_sync.testing import RecordingPacker, TornReadBackend, VersionStampedModel
from rollout_sync.transfer import OriginChecksums, TransferStats
from rollout_sync.worker import CommandResult

REPLICAS = (1, 2, 3)
NUM_TENSORS = 8
NUMEL = 256
INJECTED = "injected fault"


def trainer_weights(version: int) -> dict[str, torch.Tensor]:
    """The trainer's weights of ``version``: random bits, each tensor's ends stamped with the
    version (what the model's forward reads to catch a torn read)."""
    gen = torch.Generator().manual_seed(version)
    out = {}
    for i in range(NUM_TENSORS):
        tensor = torch.randn(NUMEL, generator=gen)
        tensor[0] = tensor[-1] = float(version)
        out[f"layers.{i}.weight"] = tensor
    return out


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


# -- the in-process wire -----------------------------------------------------------------------


class _Faults:
    """Faults as data: the replica whose receive of a version dies after its first bucket."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plan: dict[int, int] = {}
        self.fired = 0

    def place(self, version: int, replica: int) -> None:
        with self._lock:
            self._plan[version] = replica

    def take(self, replica: int, version: int) -> bool:
        with self._lock:
            if self._plan.get(version) != replica:
                return False
            del self._plan[version]
            self.fired += 1
            return True


class _Wire:
    """One group in process: an inbox per receiver, and the votes the source collects."""

    def __init__(self, receivers: tuple[int, ...], bucket_bytes: int, timeout_s: float) -> None:
        self.inboxes: dict[int, queue.Queue[tuple[Any, ...]]] = {
            r: queue.Queue() for r in receivers
        }
        self.votes: queue.Queue[tuple[int, bool]] = queue.Queue()
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s


class _LoopbackTransfer:
    """One side of a transfer over a :class:`_Wire`: the manifest, then the weights in buckets
    of at most ``bucket_bytes`` (whole tensors), then each receiver's vote to the source, which
    raises when any receiver failed. A receiver that dies still drains its share, so the next
    version starts clean, as a rank that survives a failed collective would."""

    def __init__(self, wire: _Wire, rank: int | None, faults: _Faults) -> None:
        self.wire = wire
        self.rank = rank
        """The receiving replica; ``None``: the source."""
        self.faults = faults

    @property
    def is_source(self) -> bool:
        return self.rank is None

    def send(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        version: int,
        origin: OriginChecksums | None = None,
        storage: torch.Tensor | None = None,
    ) -> TransferStats:
        start = time.perf_counter()
        buckets = self._pack(weights)
        specs = [(name, t.shape, t.dtype) for name, t in weights.items()]
        for inbox in self.wire.inboxes.values():
            inbox.put(("manifest", version, specs, len(buckets)))
            for names, flat in buckets:
                inbox.put(("bucket", names, flat))
        failed = []
        for _ in self.wire.inboxes:
            try:
                rank, ok = self.wire.votes.get(timeout=self.wire.timeout_s)
            except queue.Empty:
                raise WeightTransferTimeout(
                    f"a receiver's vote on version {version} did not come within "
                    f"{self.wire.timeout_s:.1f} s",
                    operation=f"send version {version}",
                    version=version,
                ) from None
            if not ok:
                failed.append(rank)
        if failed:
            raise WeightTransferError(
                f"replica(s) {failed} failed to receive version {version}",
                operation=f"send version {version}",
                version=version,
            )
        nbytes = sum(int(flat.numel()) for _, flat in buckets)
        elapsed = time.perf_counter() - start
        return TransferStats.build(
            role="send",
            version=version,
            tensors=len(specs),
            buckets=len(buckets),
            nbytes=nbytes,
            manifest_s=0.0,
            transfer_s=elapsed,
            total_s=elapsed,
        )

    def abort(self, reason: str) -> None:
        for inbox in self.wire.inboxes.values():
            inbox.put(("abort", reason))

    def receive(
        self,
        into: Mapping[str, torch.Tensor],
        *,
        allow_subset: bool = True,
        write_kind: str = "",
        storage: torch.Tensor | None = None,
    ) -> TransferStats:
        assert self.rank is not None
        start = time.perf_counter()
        message = self._get("the manifest")
        if message[0] == "abort":
            raise ManifestRejected(
                f"the source aborted: {message[1]}",
                operation="receive a manifest",
                version=None,
                rejected_by=(),
            )
        _, version, specs, num_buckets = message
        for name, shape, dtype in specs:  # checked before anything is written
            target = into[name]
            if target.shape != shape or target.dtype != dtype:
                raise RuntimeError(f"{name}: {tuple(shape)} {dtype} into {tuple(target.shape)}")
        dies = self.faults.take(self.rank, version)
        written = nbytes = 0
        for k in range(num_buckets):
            _, names, flat = self._get(f"bucket {k} of version {version}")
            nbytes += int(flat.numel())
            if dies and k >= 1:
                continue  # dead after the first bucket: drained, not written
            offset = 0
            for name in names:
                target = into[name]
                size = target.numel() * target.element_size()
                target.copy_(flat[offset : offset + size].view(target.dtype).view(target.shape))
                offset += size
                written += 1
        self.wire.votes.put((self.rank, not dies))
        if dies:
            raise WeightTransferError(
                f"{INJECTED}: replica {self.rank} died after bucket 0 of version {version}",
                operation=f"receive version {version}",
                version=version,
                tensors_written=written,
            )
        elapsed = time.perf_counter() - start
        return TransferStats.build(
            role="receive",
            version=version,
            tensors=len(specs),
            buckets=num_buckets,
            nbytes=nbytes,
            manifest_s=0.0,
            transfer_s=elapsed,
            total_s=elapsed,
            tensors_written=written,
        )

    def relay(
        self,
        into: Mapping[str, torch.Tensor],
        forward: _LoopbackTransfer,
        *,
        allow_subset: bool = True,
        write_kind: str = "",
        storage: torch.Tensor | None = None,
    ) -> TransferStats:
        raise NotImplementedError("the soak's wire does not relay (P2R(relay=True))")

    def _pack(self, weights: Mapping[str, torch.Tensor]) -> list[tuple[list[str], torch.Tensor]]:
        groups: list[list[str]] = [[]]
        size = 0
        for name, tensor in weights.items():
            n = tensor.numel() * tensor.element_size()
            if groups[-1] and size + n > self.wire.bucket_bytes:
                groups.append([])
                size = 0
            groups[-1].append(name)
            size += n
        return [
            (names, torch.cat([weights[n].reshape(-1).view(torch.uint8) for n in names]))
            for names in groups
        ]

    def _get(self, what: str) -> tuple[Any, ...]:
        assert self.rank is not None
        try:
            return self.wire.inboxes[self.rank].get(timeout=self.wire.timeout_s)
        except queue.Empty:
            raise WeightTransferTimeout(
                f"{what} did not arrive within {self.wire.timeout_s:.1f} s",
                operation=f"receive {what}",
            ) from None


class _Pusher:
    """The trainer's side of the P2R wire."""

    def __init__(self, transfer: _LoopbackTransfer) -> None:
        self.transfer = transfer

    def push_weights(
        self, weights: Mapping[str, torch.Tensor], *, version: int, timeout: float
    ) -> None:
        self.transfer.send(weights, version=version)


class _CountingPacker(RecordingPacker):
    """A RecordingPacker that counts its sends instead of keeping every payload (a soak sends
    millions)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(capacity=32, default_timeout=timeout_s)
        self.sent_count = 0

    def _send(self, payload: Any) -> None:
        self.sent_count += 1


# -- a replica ---------------------------------------------------------------------------------


class _Replica:
    def __init__(
        self,
        rank: int,
        p2r: _LoopbackTransfer | None,
        r2r: _LoopbackTransfer,
        args: argparse.Namespace,
    ) -> None:
        self.rank = rank
        self.model = VersionStampedModel(NUM_TENSORS, NUMEL, read_gap_s=args.read_gap_s)
        self.packer = _CountingPacker(args.timeout_s)
        self.backend = TornReadBackend(self.model, packer=self.packer, pause_timeout=args.timeout_s)
        self.commands: queue.Queue[object] = queue.Queue()
        self.checked = self.mismatched = 0
        self.torn_after_failure = self.recovered = 0
        self._failed_torn = False
        self.worker = RolloutWorker(
            self.backend,
            p2r=p2r,
            r2r=r2r,
            commands=self.commands,
            data_packer=self.packer,
            weight_sync_timeout=args.timeout_s,
            on_transfer=self._check,
            on_result=self._watch,
            history=args.history,
        )
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"replica-{rank}", daemon=True)

    def _check(self, stats: TransferStats, tensors: Mapping[str, torch.Tensor]) -> None:
        expected = trainer_weights(stats.version)
        self.checked += 1
        self.mismatched += any(not torch.equal(tensors[n], t) for n, t in expected.items())

    def _watch(self, result: CommandResult) -> None:
        if not result.ok and INJECTED in (result.error or ""):
            self.torn_after_failure += self.backend.weights_torn
            self._failed_torn = True
        elif result.ok and self._failed_torn and not self.backend.weights_torn:
            self.recovered += 1
            self._failed_torn = False

    def _run(self) -> None:
        try:
            self.worker.run(idle_timeout_s=self.worker.weight_sync_timeout * 4)
        except BaseException as exc:  # reported by main
            self.error = exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--syncs", type=int, default=10_000)
    parser.add_argument("--fail-every", type=int, default=100)
    parser.add_argument("--baseline-at", type=int, default=1000, help="syncs before the first RSS")
    parser.add_argument("--bucket-bytes", type=int, default=2048)
    parser.add_argument("--history", type=int, default=1024, help="RolloutWorker(history=...)")
    parser.add_argument("--read-gap-s", type=float, default=50e-6)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--max-rss-growth", type=float, default=1.05)
    args = parser.parse_args(argv)
    baseline_at = min(args.baseline_at, args.syncs // 2)

    faults = _Faults()
    p2r_wire = _Wire((REPLICAS[0],), args.bucket_bytes, args.timeout_s)
    r2r_wire = _Wire(REPLICAS[1:], args.bucket_bytes, args.timeout_s)
    replicas = [
        _Replica(
            rank,
            _LoopbackTransfer(p2r_wire, rank, faults) if rank == REPLICAS[0] else None,
            _LoopbackTransfer(r2r_wire, None if rank == REPLICAS[0] else rank, faults),
            args,
        )
        for rank in REPLICAS
    ]
    callback = WeightBroadcastCallback(
        lambda: trainer_weights(callback.version + 1),
        pusher=_Pusher(_LoopbackTransfer(p2r_wire, None, faults)),
        channel=WorkerCommandChannel({r.rank: r.commands for r in replicas}, REPLICAS),
        timeout=args.timeout_s,
        sync_on_run_begin=False,
        report_every_step=True,
    )
    for replica in replicas:
        replica.packer.start()
        replica.thread.start()
    push_failures = 0
    rss_base = 0
    started = time.perf_counter()
    try:
        for step in range(1, args.syncs + 1):
            if step % args.fail_every == args.fail_every // 2:
                victim = REPLICAS[(step // args.fail_every) % len(REPLICAS)]
                faults.place(callback.version + 1, victim)
            try:
                callback.step_end(step)
            except WeightTransferError:
                push_failures += 1  # the P2R victim's vote: this version is pushed again
            if step == baseline_at:
                gc.collect()
                rss_base = rss_bytes()
            if step % 1000 == 0:
                print(
                    f"sync {step}: rss {rss_bytes() / 2**20:.1f} MiB, "
                    f"{time.perf_counter() - started:.0f} s",
                    flush=True,
                )
        callback.train_end(args.syncs)
        for replica in replicas:
            replica.thread.join(args.timeout_s * 4)
    finally:
        for replica in replicas:
            replica.worker.close(args.timeout_s)
            replica.packer.stop(args.timeout_s)
    wall_s = time.perf_counter() - started
    gc.collect()
    rss_end = rss_bytes()

    errors = [f"replica {r.rank}: {r.error!r}" for r in replicas if r.error is not None]
    errors += [f"replica {r.rank} still running" for r in replicas if r.thread.is_alive()]
    stats = [r.worker.statistics() for r in replicas]
    bit_identical = all(
        r.mismatched == 0
        and r.checked > 0
        and torch.equal(
            torch.stack(list(r.backend.served_weights().values())),
            torch.stack(list(trainer_weights(callback.version).values())),
        )
        for r in replicas
    )
    report = {
        "syncs": args.syncs,
        "failures_injected": faults.fired,
        "rss_growth_ratio": round(rss_end / rss_base, 4),
        "torn_reads": sum(r.model.torn_reads for r in replicas),
        "bit_identical": bit_identical,
        "torn_after_failure": sum(r.torn_after_failure for r in replicas),
        "recovered": sum(r.recovered for r in replicas),
        "push_failures": push_failures,
        "failed_commands": sum(s.failed for s in stats),
        "commands": sum(s.commands for s in stats),
        "versions_checked": sum(r.checked for r in replicas),
        "final_version": callback.version,
        "forwards": sum(r.model.forwards for r in replicas),
        "payloads_sent": sum(r.packer.sent_count for r in replicas),
        "history_len": max(len(r.worker.results) for r in replicas),
        "sync_reports_len": max(len(r.worker.sync_reports) for r in replicas),
        "rss_mib_base": round(rss_base / 2**20, 1),
        "rss_mib_end": round(rss_end / 2**20, 1),
        "wall_s": round(wall_s, 1),
        "errors": errors,
    }
    ok = (
        not errors
        and report["rss_growth_ratio"] <= args.max_rss_growth
        and report["torn_reads"] == 0
        and bit_identical
        and faults.fired == report["torn_after_failure"] == report["recovered"] > 0
        and all(s.weight_version == callback.version and not s.weights_torn for s in stats)
        and report["payloads_sent"] > 0
    )
    report["ok"] = ok
    print(json.dumps(report), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
