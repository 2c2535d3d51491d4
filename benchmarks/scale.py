"""Refit at scale: the cost model (rollout_sync.scale) against real transfers, then a 1T fleet.

One run, three parts, on one job of eight processes (gloo on loopback), every link an emulated
NIC (:mod:`rollout_sync.testing.emulated_nic`: each rank's egress and ingress paced at a set
rate and latency, full duplex, every broadcast charged as gloo sends it, a binomial tree; so
link time dominates the two shared cores):

1. **Calibration.** The model's residual constants, measured side by side in the same run:
   the software cost of one control collective (tiny paced collectives on the P2R pair, and
   among the four ranks of a sharded P2R group, whose cells run more processes than cores)
   and of launching one bucket, the manifest's validation per tensor, the copy rate of packing
   and unpacking a bucket, and an install's fixed cost and rate.
2. **The grid.** Real syncs, the production code with only its collectives and sends paced:
   one source (P2R, then R2R) and the pipelined relay (``relay()``), a trainer rank (rank 0)
   and replicas of one rank (ranks 1-3), :class:`~rollout_sync.WeightTransfer` s; and the
   sharded designs, a :class:`~rollout_sync.transfer.ShardedTransfer` P2R with ``relay()`` into
   the R2R transfer of each rank position: the two-hop relay (receive whole, then send) and the
   pipelined one (``pipelined_relay=True``: each bucket passed on as its tensors arrive,
   two-phase), the two-hop in two shapes, the pipelined in the first:
   balanced, two trainer ranks (0 and 1, each holding half of every tensor, as FSDP does) into
   replicas of two tensor-parallel ranks (ranks 2-7, tensors cut alternately column- and
   row-parallel, so each trainer rank sends to both ranks of the first replica); and
   unbalanced, three trainer ranks (0-2, a third of every tensor each) into three replicas of
   one rank (3-5), whose first rank's ingress takes all three trainer ranks' bytes. 2 and 3
   replicas (the unbalanced shape: 3), staged (received into a
   :class:`~rollout_sync.WeightBuffer`, then installed) and in place (received into flat served
   storage), the NIC at two rates. Each cell's refit (the trainers' push until every replica
   serves the version, the slowest rank) and stall (staged: the install; in place: the whole
   receive) against the model's (``Scenario.broadcast = Broadcast.GLOO``), median of
   ``--iterations``, cells interleaved so that load drift hits all alike.
3. **The fleet.** :data:`rollout_sync.scale.FLEET_1T` (1T parameters in bf16, 256 trainer GPUs,
   4 replicas of 32 GPUs, 50 GB/s per GPU, NCCL's chain broadcasts): every topology, staged and
   in place, where the time goes, beside the published figures (docs/scale.md cites them).

Prints the tables and, as the last line, one JSON object (``max_prediction_error``,
``emulated_speedup``, ``fleet_1t_refit_s``, ``fleet_1t_stall_s``,
``fleet_1t_one_source_refit_s``, ...; docs/scale.md lists them all).

    python benchmarks/scale.py            # ~2.5 minutes on 2 cores
    python benchmarks/scale.py --rates 20 40 --model-mb 8 --iterations 5
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The path is set up above, so a source checkout runs without installing the package.
from rollout_sync import SyncMode, TransferConfig, WeightBuffer, build_sync_groups
from rollout_sync.plan import CLOSE_REFIT
from rollout_sync.scale import (
    FLEET_1T,
    Broadcast,
    Fleet,
    Link,
    RefitEstimate,
    Scenario,
    SyncCosts,
    Topology,
    estimate,
)
from rollout_sync.sharded_groups import build_sharded_sync_groups
from rollout_sync.testing import IdleFlatRollout, run_group
from rollout_sync.testing.emulated_nic import (
    EmulatedNic,
    PacedCollectives,
    PacedShardedTransfer,
    PacedWeightTransfer,
)
from rollout_sync.transfer import Layout, TransferPlan, WeightManifest
from rollout_sync.weights import check_weights_match

GRID_TOPOLOGIES = (
    Topology.ONE_SOURCE,
    Topology.PIPELINED_RELAY,
    Topology.SHARDED_TWO_HOP,
    Topology.SHARDED_PIPELINED,
)
"""The topologies of the grid: each at every rate, 2 and 3 replicas, staged and in place. The
sharded pipelined relay's cells are built as the sharded two-hop's (:data:`SHARDED_TOPOLOGIES`),
its P2R a ``ShardedTransfer`` with ``pipelined_relay=True`` (:data:`SHARDED_OPTIONS`), driven by
the same ``relay()``."""
IMPLEMENTED = tuple(t for t in GRID_TOPOLOGIES if t.implemented)
SHARDED_TOPOLOGIES = (Topology.SHARDED_TWO_HOP, Topology.SHARDED_PIPELINED)
SHARDED_OPTIONS: dict[Topology, dict[str, Any]] = {
    Topology.SHARDED_PIPELINED: {"pipelined_relay": True},
}
"""Keyword arguments of a sharded topology's ``ShardedTransfer`` (P2R)."""
RELAYS = (Topology.PIPELINED_RELAY, *SHARDED_TOPOLOGIES)
"""The topologies whose first replica passes the version on with ``relay()``."""
ONE_SOURCE_RANKS = {3: (0, [1, 2, 3]), 2: (0, [1, 2])}
"""Replicas -> (the trainer rank, the replica ranks) of the one-source cells."""
WORLD = 8
BROADCAST = Broadcast.GLOO
"""How the grid's broadcasts run (gloo's binomial tree), for the emulated NIC and the model."""


@dataclass(frozen=True)
class Shape:
    """A sharded cell's job: its trainer ranks and each replica's ranks, by replica count."""

    name: str
    trainers: tuple[int, ...]
    replicas: dict[int, list[tuple[int, ...]]]

    @property
    def tp(self) -> int:
        """Ranks per replica (tensor parallel)."""
        return len(self.replicas[max(self.replicas)][0])


BALANCED = Shape("2 trainers, TP2", (0, 1), {3: [(2, 3), (4, 5), (6, 7)], 2: [(2, 3), (4, 5)]})
"""2 trainer ranks into replicas of 2 ranks: each trainer rank sends as much as each replica
rank receives."""
UNBALANCED = Shape("3 trainers, TP1", (0, 1, 2), {3: [(3,), (4,), (5,)]})
"""3 trainer ranks into replicas of 1 rank: the replica rank's ingress takes three trainer
ranks' egress, the hop bound by it (the sharded first link's ``max(bytes / trainer ranks,
bytes / replica GPUs)``)."""
SHAPES = (BALANCED, UNBALANCED)


@dataclass(frozen=True)
class Cell:
    topology: Topology
    replicas: int
    staged: bool
    rate_mb_s: float
    shape: Shape = BALANCED
    """The sharded cells' job (the one-source cells ignore it)."""

    @property
    def sharded(self) -> bool:
        return self.topology in SHARDED_TOPOLOGIES

    @property
    def trainer_ranks(self) -> int:
        return len(self.shape.trainers) if self.sharded else 1

    @property
    def ranks(self) -> list[int]:
        """Every rank that takes part, trainers first."""
        if self.sharded:
            replicas = self.shape.replicas[self.replicas]
            return [*self.shape.trainers, *(r for rep in replicas for r in rep)]
        trainer, replicas_ = ONE_SOURCE_RANKS[self.replicas]
        return [trainer, *replicas_]

    @property
    def shape_name(self) -> str:
        return self.shape.name if self.sharded else "1 trainer, TP1"

    @property
    def name(self) -> str:
        where = "staged" if self.staged else "in place"
        shape = f" ({self.shape.name})" if self.sharded else ""
        return f"{self.topology.value} x{self.replicas}{shape} {where} {self.rate_mb_s:g} MB/s"


def _weights(args: argparse.Namespace, seed: int) -> dict[str, torch.Tensor]:
    """The model: ``args.tensors`` matrices of 256 columns (fewer rows for a smaller model)."""
    numel = int(args.model_mb * (1 << 20) / 4 / args.tensors)
    cols = min(256, numel)
    gen = torch.Generator().manual_seed(seed)
    return {
        f"layers.{i}.weight": torch.rand(numel // cols, cols, generator=gen)
        for i in range(args.tensors)
    }


def _layouts(weights: dict[str, torch.Tensor], shape: Shape) -> tuple[Layout, Layout]:
    """A sharded shape's layouts: the trainer's ranks each hold a part of the rows of every
    tensor (FSDP's dim-0 shards); a replica's ranks hold alternately a part of the rows (column
    parallel) and of the columns (row parallel), so every trainer rank sends to every replica
    rank (a replica of one rank holds every tensor whole)."""
    trainer = Layout.build(weights, len(shape.trainers), shard={name: 0 for name in weights})
    cut = {name: i % 2 for i, name in enumerate(weights)} if shape.tp > 1 else {}
    replica = Layout.build(weights, shape.tp, shard=cut)
    return trainer, replica


_SCRATCH = torch.zeros(0, dtype=torch.uint8)


def _median_s(fn: Any, repeat: int = 7, *, cold: bool = False) -> float:
    """The median time of ``fn()``; ``cold``: each call after 64 MiB of other writes, so its
    operands come from memory rather than the caches, as a sync's copies do."""
    global _SCRATCH
    if cold and _SCRATCH.numel() == 0:
        _SCRATCH = torch.zeros(64 << 20, dtype=torch.uint8)
    times = []
    for _ in range(repeat):
        if cold:
            _SCRATCH.add_(1)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _calibrate_collectives(
    rank: int,
    args: argparse.Namespace,
    group: Any,
    members: Sequence[int],
    broadcast: Broadcast = BROADCAST,
) -> list[float]:
    """Control collectives and bucket launches on ``group`` (of ``members``, the first the
    source), paced at the grid's latency and a rate so high that the bytes cost nothing: what
    a round (a broadcast, paced as ``broadcast``, then an all-gather) takes beyond its
    latencies is the software of two collectives. (collective seconds, launch seconds),
    medians of 10 rounds; [] off the group."""
    if rank not in members:
        return []
    latency = args.latency_ms / 1e3
    ops = PacedCollectives(group, EmulatedNic(Link(1e12, latency)), broadcast=broadcast)
    header = torch.zeros(2, dtype=torch.int64)
    votes = [torch.zeros(1, dtype=torch.int32) for _ in members]
    mine = torch.ones(1, dtype=torch.int32)
    launch, rounds = [], []
    for _ in range(10):
        t0 = time.perf_counter()
        work = ops.broadcast(header, members[0])
        launch.append(time.perf_counter() - t0)
        work.wait()
        ops.all_gather(votes, mine).wait()
        rounds.append(time.perf_counter() - t0)
    # The all-gather ends once the farthest member had the broadcast (its hops) and joined.
    latencies = (broadcast.hops(len(members)) + 1) * latency
    return [max(0.0, (statistics.median(rounds) - latencies) / 2), statistics.median(launch)]


def _calibrate_copies(
    rank: int, args: argparse.Namespace, weights: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Copy rates and the manifest's validation, on the ranks whose work they are."""
    out: dict[str, float] = {}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    if rank == 0:
        # Packing the trainer's tensors into a flat bucket buffer, and the reverse.
        offsets = [0, *itertools.accumulate(t.numel() * 4 for t in weights.values())]
        flat = torch.empty(offsets[-1], dtype=torch.uint8)
        tensors = list(weights.values())
        views = [
            flat[a:b].view(torch.float32).view(t.shape)
            for (a, b), t in zip(itertools.pairwise(offsets), tensors, strict=True)
        ]
        pack = _median_s(lambda: torch._foreach_copy_(views, tensors), cold=True)
        unpack = _median_s(lambda: torch._foreach_copy_(tensors, views), cold=True)
        out["copy_bytes_per_s"] = nbytes / ((pack + unpack) / 2)
    if rank == 1:
        served = IdleFlatRollout(weights)
        manifest = WeightManifest.build(weights, bucket_bytes=int(args.bucket_mb * (1 << 20)))
        check = _median_s(lambda: check_weights_match(manifest.specs, served.served_weights()))
        out["manifest_s_per_tensor"] = check / len(weights)
        # An install: the default load_weights (check, then a copy per tensor); its fixed part
        # is the same call with nothing to copy (the tensors are the served ones).
        clone = {n: t.clone() for n, t in served.served_weights().items()}
        install = _median_s(lambda: served.load_weights(clone), cold=True)
        fixed = _median_s(lambda: served.load_weights(served.served_weights()))
        out["install_s"] = fixed
        out["install_bytes_per_s"] = nbytes / max(install - fixed, 1e-6)
    return out


@dataclass
class _Role:
    """One rank's part in one cell: its transfers and what it sends or serves."""

    trainer: bool
    p2r: PacedWeightTransfer | PacedShardedTransfer | None
    r2r: PacedWeightTransfer | None
    weights: dict[str, torch.Tensor]
    """A trainer rank's: what it sends (the whole model, or its shards)."""
    served: IdleFlatRollout
    buffer: WeightBuffer


def _bench_process(rank: int, args: argparse.Namespace, cells: list[Cell]) -> dict[str, Any]:
    timeout = args.timeout
    # Every rank makes every group, in the same order (torch.distributed's rule).
    groups = {
        n: build_sync_groups(t, r, timeout_s=timeout) for n, (t, r) in ONE_SOURCE_RANKS.items()
    }
    sharded_groups = {
        (shape.name, n): build_sharded_sync_groups(shape.trainers, r, timeout_s=timeout)
        for shape in SHAPES
        for n, r in shape.replicas.items()
    }
    weights = _weights(args, seed=rank)
    model = _weights(args, seed=0)  # the sharded cells' model, whole, the same on every rank
    layouts = {shape.name: _layouts(model, shape) for shape in SHAPES}
    plans = {name: TransferPlan.between(*pair) for name, pair in layouts.items()}
    dist.barrier()
    calibration = _calibrate_copies(rank, args, weights)
    collectives: list[list[float]] = []
    sharded_collectives: list[list[float]] = []
    config = TransferConfig(bucket_bytes=int(args.bucket_mb * (1 << 20)), timeout_s=timeout)
    latency = args.latency_ms / 1e3

    def served(tensors: dict[str, torch.Tensor]) -> tuple[IdleFlatRollout, WeightBuffer]:
        rollout = IdleFlatRollout(tensors)
        buffer = WeightBuffer(rollout.served_weights(), mode=SyncMode.ASYNC_PER_GENERATION)
        return rollout, buffer

    whole = served(weights)
    # Per sharded shape, this rank's: its shards to send (a trainer rank), or its slice to
    # serve (a replica rank, by its position k).
    own: dict[str, dict[str, torch.Tensor]] = {}
    shards: dict[str, tuple[IdleFlatRollout, WeightBuffer]] = {}
    for shape in SHAPES:
        trainer_layout, replica_layout = layouts[shape.name]
        position = sharded_groups[(shape.name, max(shape.replicas))].position(rank)
        if rank in shape.trainers:
            own[shape.name] = trainer_layout.shard(model, shape.trainers.index(rank))
        elif position is not None:
            shards[shape.name] = served(replica_layout.shard(model, position[1]))

    # One NIC and one pair of transfers per cell and rank, kept across iterations (their
    # manifest caches warm up in the first, discarded, iteration).
    roles: list[_Role | None] = []
    p2r: PacedWeightTransfer | PacedShardedTransfer | None
    for cell in cells:
        nic = EmulatedNic(Link(cell.rate_mb_s * 1e6, latency))
        if rank not in cell.ranks:
            roles.append(None)
        elif cell.sharded:
            shape = cell.shape
            sg = sharded_groups[(shape.name, cell.replicas)]
            first = sg.replicas[0]
            p2r = (
                PacedShardedTransfer(
                    sg.p2r,
                    plans[shape.name],
                    source_ranks=shape.trainers,
                    target_ranks=first,
                    nic=nic,
                    config=config,
                    **SHARDED_OPTIONS.get(cell.topology, {}),
                )
                if rank in shape.trainers + first
                else None
            )
            where = sg.position(rank)
            r2r = (
                PacedWeightTransfer(sg.r2r[where[1]], first[where[1]], nic=nic, config=config)
                if where is not None and cell.replicas > 1
                else None
            )
            trainer = rank in shape.trainers
            mine = whole if trainer else shards[shape.name]
            roles.append(_Role(trainer, p2r, r2r, own.get(shape.name, {}), *mine))
        else:
            g = groups[cell.replicas]
            p2r = (
                PacedWeightTransfer(g.p2r, g.trainer, nic=nic, config=config)
                if rank in (g.trainer, g.r2r_source)
                else None
            )
            r2r = (
                PacedWeightTransfer(g.r2r, g.r2r_source, nic=nic, config=config)
                if rank in g.replicas and g.r2r is not None
                else None
            )
            roles.append(_Role(rank == g.trainer, p2r, r2r, weights, *whole))

    version = itertools.count(1)
    samples: dict[int, list[tuple[float, float, float]]] = {i: [] for i in range(len(cells))}
    for iteration in range(args.iterations + 1):
        # The software constants drift with the machine's load: measured every iteration,
        # beside the cells they predict.
        dist.barrier()
        collectives.append(_calibrate_collectives(rank, args, groups[3].p2r, (0, 1)))
        # Four ranks in one collective outnumber the two cores: the sharded cells' votes (both
        # shapes' P2R groups have four ranks). Their broadcasts are never a cell's (the sharded
        # P2R sends point to point): paced as a chain, every member one latency away.
        dist.barrier()
        sg = sharded_groups[(BALANCED.name, 3)]
        p2r_ranks = (*BALANCED.trainers, *BALANCED.replicas[3][0])
        sharded_collectives.append(
            _calibrate_collectives(rank, args, sg.p2r, p2r_ranks, Broadcast.CHAIN)
        )
        for i, cell in enumerate(cells):
            v = next(version)
            role = roles[i]
            dist.barrier()
            start = time.monotonic()
            stall = _sync(cell, v, role)
            end = time.monotonic()
            if stall is None:  # in place: parked from the push until its receive returned
                stall = end - start if role is not None and not role.trainer else 0.0
            mine = torch.tensor([start, end, stall], dtype=torch.float64)
            every = [torch.zeros(3, dtype=torch.float64) for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine)
            if iteration > 0 and rank == 0:
                taking = cell.ranks
                t0 = min(float(every[r][0]) for r in taking[: cell.trainer_ranks])
                refit = max(float(every[r][1]) for r in taking) - t0
                worst_stall = max(float(every[r][2]) for r in taking[cell.trainer_ranks :])
                samples[i].append((refit, worst_stall, 0.0))
    if rank in (0, 1):
        calibration["collective_s"] = statistics.median(c[0] for c in collectives[1:])
        calibration["bucket_s"] = statistics.median(c[1] for c in collectives[1:])
    if rank == 0:
        calibration["collective_s_4_ranks"] = statistics.median(
            c[0] for c in sharded_collectives[1:]
        )
    if rank != 0:
        return {"calibration": calibration}
    manifest = WeightManifest.build(weights, bucket_bytes=config.bucket_bytes)
    gpu_manifests = {
        name: WeightManifest.build(replica.shard(model, 0), bucket_bytes=config.bucket_bytes)
        for name, (_, replica) in layouts.items()
    }
    return {
        "calibration": calibration,
        "samples": samples,
        "model_bytes": manifest.nbytes,
        "buckets": list(manifest.bucket_nbytes),
        "manifest_bytes": len(manifest.to_bytes()),
        "gpu_manifest_bytes": {n: len(m.to_bytes()) for n, m in gpu_manifests.items()},
        "plan_bytes_sent": {
            s.name: [plans[s.name].bytes_sent(i) for i in range(len(s.trainers))] for s in SHAPES
        },
        "plan_bytes_received": {
            s.name: [plans[s.name].bytes_received(i) for i in range(s.tp)] for s in SHAPES
        },
    }


def _sync(cell: Cell, version: int, role: _Role | None) -> float | None:
    """This rank's part of one sync; a staged replica's install time (else ``None``)."""
    if role is None:
        return None  # not in this cell's job
    p2r, r2r = role.p2r, role.r2r
    if role.trainer:
        assert p2r is not None
        p2r.send(role.weights, version=version)
        return None
    flat, buffer = role.served.flat, role.buffer
    # The sharded two-hop relay receives all of its shard, then sends it on; the pipelined
    # relays pass each bucket on as it arrives.
    relays = cell.topology in RELAYS
    if not cell.staged:
        if p2r is not None and relays and r2r is not None:
            p2r.relay(flat.tensors, r2r, storage=flat.storage)
        elif p2r is not None:
            p2r.receive(flat.tensors, storage=flat.storage)
            if r2r is not None:
                r2r.send(flat.tensors, version=version, storage=flat.storage)
        else:
            assert r2r is not None
            r2r.receive(flat.tensors, storage=flat.storage)
        return None
    with buffer.write() as handle:
        if p2r is not None and relays and r2r is not None:
            p2r.relay(handle.tensors, r2r)
        elif p2r is not None:
            p2r.receive(handle.tensors)
        else:
            assert r2r is not None
            r2r.receive(handle.tensors)
        handle.version = version
    if p2r is not None and not relays and r2r is not None:
        r2r.send(buffer.tensors, version=version)  # what it received, from its staging area
    report = buffer.install_into(role.served)
    assert report is not None and report.version == version
    return report.install_s


def _scenario(args: argparse.Namespace, result: dict[str, Any], cell: Cell) -> Scenario:
    """The model's view of ``cell``: the sharded cells' replica GPUs each hold a slice of
    every tensor (tensor parallel), their manifests measured; every broadcast gloo's."""
    sharded = cell.sharded
    return Scenario(
        model_bytes=result["model_bytes"],
        bucket_bytes=int(args.bucket_mb * (1 << 20)),
        replicas=cell.replicas,
        nic=Link(cell.rate_mb_s * 1e6, args.latency_ms / 1e3),
        staged=cell.staged,
        tensors=args.tensors,
        manifest_bytes=(
            result["gpu_manifest_bytes"][cell.shape.name] if sharded else result["manifest_bytes"]
        ),
        trainer_ranks=cell.trainer_ranks,
        gpus_per_replica=cell.shape.tp if sharded else 1,
        tensors_per_gpu=args.tensors if sharded else None,
        # Both shapes cut every tensor along other dimensions on the two sides (the trainer's
        # rows; the replicas' columns, or whole): every replica rank takes regions from every
        # trainer rank.
        sources_per_gpu=cell.trainer_ranks if sharded else None,
        trainer_packs=True,
        replica_copies=cell.staged,
        broadcast=BROADCAST,
    )


SIZES = (8e9, 70e9, 235e9, 671e9, 1e12)
"""Parameter counts of the by-size table (bf16)."""


def _by_size(fleet: Fleet) -> list[dict[str, Any]]:
    """The fleet's links and costs at other model sizes: each replica the smallest power of two
    of GPUs that holds the weights at no more than the 1T fleet's load per GPU, the manifest
    growing with the bytes."""
    per_gpu = fleet.model_bytes / fleet.gpus_per_replica
    rows = []
    for params in SIZES:
        nbytes = int(2 * params)
        gpus = 1
        while nbytes / gpus > per_gpu:
            gpus *= 2
        sized = replace(
            fleet,
            model_bytes=nbytes,
            gpus_per_replica=gpus,
            tensors=max(300, round(fleet.tensors * nbytes / fleet.model_bytes)),
        )
        in_place, staged = sized.scenario(staged=False), sized.scenario(staged=True)

        costs = sized.costs
        rows.append(
            {
                "params_b": params / 1e9,
                "gb": nbytes / 1e9,
                "gpus_per_replica": gpus,
                "one_source_s": estimate(Topology.ONE_SOURCE, in_place, costs).refit_s,
                "relay_s": estimate(Topology.PIPELINED_RELAY, in_place, costs).refit_s,
                "relay_staged_stall_s": estimate(Topology.PIPELINED_RELAY, staged, costs).stall_s,
                "sharded_two_hop_s": estimate(Topology.SHARDED_TWO_HOP, in_place, costs).refit_s,
                "sharded_two_hop_staged_s": estimate(
                    Topology.SHARDED_TWO_HOP, staged, costs
                ).refit_s,
                "sharded_pipelined_s": estimate(
                    Topology.SHARDED_PIPELINED, in_place, costs
                ).refit_s,
                "speed_of_light_s": sized.speed_of_light_s,
            }
        )
    return rows


def _best(estimates: list[RefitEstimate], tolerance: float = CLOSE_REFIT) -> RefitEstimate:
    """The implemented design with the shortest refit; a staged one within ``tolerance`` of it
    instead (about the same refit for a much shorter stall)."""
    implemented = [e for e in estimates if e.implemented]
    fastest = min(implemented, key=lambda e: e.refit_s)
    close = [
        e
        for e in implemented
        if e.scenario.staged and e.refit_s <= (1 + tolerance) * fastest.refit_s
    ]
    return min(close, key=lambda e: e.stall_s) if close else fastest


def _where(estimate_: RefitEstimate) -> str:
    total = estimate_.refit_s
    return ", ".join(
        f"{p.name} {p.seconds:.3g} s ({p.seconds / total:.0%})"
        for p in estimate_.phases
        if p.seconds >= 0.0005 * total
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-mb", type=float, default=12.0, help="model size, MiB")
    parser.add_argument("--tensors", type=int, default=48)
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="bucket size, MiB")
    parser.add_argument(
        "--rates", type=float, nargs="+", default=[25.0, 50.0], help="emulated NIC rates, MB/s"
    )
    parser.add_argument("--latency-ms", type=float, default=1.0, help="emulated NIC latency")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--json", metavar="PATH", help="also write everything as JSON")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    cells = [
        Cell(topology, replicas, staged, rate, shape)
        for rate in args.rates
        for replicas in (2, 3)
        for staged in (False, True)
        for topology, shape in [
            *((t, BALANCED) for t in IMPLEMENTED),
            # The unbalanced sharded plan: three trainer ranks into each one-rank replica.
            *([(Topology.SHARDED_TWO_HOP, UNBALANCED)] if replicas in UNBALANCED.replicas else []),
        ]
    ]
    values = run_group(
        _bench_process,
        WORLD,
        (args, cells),
        timeout_s=args.timeout * 4 + 300,
        group_timeout_s=args.timeout,
        what="benchmarks/scale.py",
    )
    result = values[0]
    calibration = {**values[1]["calibration"], **values[0]["calibration"]}
    costs = SyncCosts(
        collective_s=calibration["collective_s"],
        bucket_s=calibration["bucket_s"],
        forward_s=calibration["bucket_s"],
        manifest_s_per_tensor=calibration["manifest_s_per_tensor"],
        copy_bytes_per_s=calibration["copy_bytes_per_s"],
        install_s=calibration["install_s"],
        install_bytes_per_s=calibration["install_bytes_per_s"],
    )
    # The sharded cells' control collectives have four ranks (and their R2R hops run two or
    # three groups at once): more processes than cores, so each costs more, measured alike.
    sharded_costs = replace(costs, collective_s=calibration["collective_s_4_ranks"])
    print(
        f"calibration (this machine, measured in this run): control collective "
        f"{costs.collective_s * 1e3:.2f} ms beyond the latency (among 4 ranks: "
        f"{sharded_costs.collective_s * 1e3:.2f} ms), bucket launch "
        f"{costs.bucket_s * 1e3:.2f} ms, manifest validation "
        f"{costs.manifest_s_per_tensor * 1e6:.1f} us/tensor, copies "
        f"{costs.copy_bytes_per_s / 1e9:.2f} GB/s, install {costs.install_s * 1e3:.2f} ms + "
        f"{costs.install_bytes_per_s / 1e9:.2f} GB/s"
    )

    def megabytes(nbytes: list[int]) -> str:
        return " + ".join(f"{n / 1e6:.1f}" for n in nbytes) + " MB"

    sent, received = result["plan_bytes_sent"], result["plan_bytes_received"]
    print(
        f"\ngrid: {result['model_bytes'] / 1e6:.1f} MB in {args.tensors} tensors, "
        f"{len(result['buckets'])} buckets of {args.bucket_mb:g} MiB; one source and the "
        f"pipelined relay: a trainer rank + 2 or 3 replicas of one rank; sharded_two_hop: "
        + "; ".join(
            f"{shape.name}, {'/'.join(map(str, shape.replicas))} replicas (trainer ranks "
            f"sending {megabytes(sent[shape.name])}, replica ranks receiving "
            f"{megabytes(received[shape.name])})"
            for shape in SHAPES
        )
        + f"; broadcasts as gloo sends them; emulated NIC latency {args.latency_ms:g} ms, "
        f"egress and ingress paced; median of {args.iterations}"
    )
    width = max(len(cell.name) for cell in cells) + 2
    header = (
        f"{'cell':<{width}}{'refit pred':>11}{'measured':>10}{'error':>8}"
        f"{'stall pred':>12}{'measured':>10}"
    )
    print(header)
    rows: list[dict[str, Any]] = []
    for i, cell in enumerate(cells):
        got = result["samples"][i]
        refit = statistics.median(s[0] for s in got)
        stall = statistics.median(s[1] for s in got)
        scenario = _scenario(args, result, cell)
        predicted = estimate(cell.topology, scenario, sharded_costs if cell.sharded else costs)
        error = abs(predicted.refit_s - refit) / refit
        stall_error = abs(predicted.stall_s - stall) / stall if stall > 0 else math.nan
        rows.append(
            {
                "cell": cell.name,
                "topology": cell.topology.value,
                "replicas": cell.replicas,
                "staged": cell.staged,
                "rate_mb_s": cell.rate_mb_s,
                "trainer_ranks": cell.trainer_ranks,
                "gpus_per_replica": scenario.gpus_per_replica,
                "shape": cell.shape_name,
                "refit_predicted_s": predicted.refit_s,
                "refit_measured_s": refit,
                "refit_measured_all_s": [s[0] for s in got],
                "error": error,
                "stall_predicted_s": predicted.stall_s,
                "stall_measured_s": stall,
                "stall_error": stall_error,
            }
        )
        print(
            f"{cell.name:<{width}}{predicted.refit_s * 1e3:>9.0f}ms{refit * 1e3:>8.0f}ms"
            f"{error:>8.1%}{predicted.stall_s * 1e3:>10.1f}ms{stall * 1e3:>8.1f}ms"
        )
    # The sharded design with its relay pipelined: the model's alone, until it is measured.
    for rate in args.rates if not Topology.SHARDED_PIPELINED.implemented else ():
        cell = Cell(Topology.SHARDED_TWO_HOP, 3, False, rate, BALANCED)
        scenario = _scenario(args, result, cell)
        modelled = estimate(Topology.SHARDED_PIPELINED, scenario, sharded_costs)
        name = cell.name.replace(Topology.SHARDED_TWO_HOP.value, modelled.topology.value)
        print(
            f"{name:<{width}}{modelled.refit_s * 1e3:>9.0f}ms{'-':>10}{'-':>8}"
            f"{modelled.stall_s * 1e3:>10.1f}ms{'-':>10}   modelled, not implemented"
        )
    max_error = max(r["error"] for r in rows)
    unbalanced_rows = [r for r in rows if r["shape"] == UNBALANCED.name]
    max_unbalanced_error = max(r["error"] for r in unbalanced_rows)
    stall_errors = [r["stall_error"] for r in rows if r["staged"]]

    def measured(topology: Topology, rate: float, staged: bool = False) -> dict[str, Any]:
        """A 3-replica cell: one trainer rank, or the balanced sharded shape."""
        return next(
            r
            for r in rows
            if r["topology"] == topology.value
            and r["replicas"] == 3
            and r["rate_mb_s"] == rate
            and r["staged"] == staged
            and r["shape"] != UNBALANCED.name
        )

    # The best implemented topology (fastest measured refit), 3 replicas in place, against one
    # source: P2R then R2R from a single trainer rank, the whole model.
    best_by_rate = {
        rate: min(IMPLEMENTED, key=lambda t: measured(t, rate)["refit_measured_s"])
        for rate in args.rates
    }

    def speedup(rate: float, topology: Topology, key: str) -> float:
        ratio: float = measured(Topology.ONE_SOURCE, rate)[key] / measured(topology, rate)[key]
        return ratio

    speedups = {r: speedup(r, best_by_rate[r], "refit_measured_s") for r in args.rates}
    predicted_speedups = {r: speedup(r, best_by_rate[r], "refit_predicted_s") for r in args.rates}
    relay_speedups = {
        r: speedup(r, Topology.PIPELINED_RELAY, "refit_measured_s") for r in args.rates
    }
    print(
        f"\nmax prediction error (refit, {len(rows)} cells): {max_error:.1%} (target <= 20%); "
        f"the unbalanced sharded plan's ({UNBALANCED.name}, {len(unbalanced_rows)} cells): "
        f"{max_unbalanced_error:.1%}; staged stall: up to {max(stall_errors):.0%} (an install "
        "of a few ms, noisy)"
    )
    print(
        "emulated speedup, the best implemented topology over one source, 3 replicas, in place: "
        + ", ".join(
            f"{best_by_rate[r].value} {speedups[r]:.2f} measured / "
            f"{predicted_speedups[r]:.2f} predicted at {r:g} MB/s"
            for r in args.rates
        )
        + "; the pipelined relay's: "
        + ", ".join(f"{relay_speedups[r]:.2f} at {r:g} MB/s" for r in args.rates)
    )

    # -- the fleet --------------------------------------------------------------------------
    fleet = FLEET_1T
    print(f"\nfleet: {fleet.name}; NIC {fleet.nic.rate_bytes_per_s / 1e9:g} GB/s per GPU")
    print(
        f"speed of light (each replica takes in the model through its NICs): "
        f"{fleet.speed_of_light_s:.3g} s"
    )
    design_width = max(len(e.design) for e in fleet.estimates()) + 4
    print(
        f"{'design':<{design_width}}{'refit s':>9}{'stall s':>9}{'busiest GB':>12}"
        "  where the time goes"
    )
    estimates = fleet.estimates()
    for e in estimates:
        mark = "" if e.implemented else " *"
        print(
            f"{e.design + mark:<{design_width}}{e.refit_s:>9.3g}{e.stall_s:>9.3g}"
            f"{e.busiest_link_bytes / 1e9:>12.4g}  {_where(e)}"
        )
    if any(not e.implemented for e in estimates):
        print("* modelled, not implemented")

    def fleet_row(topology: Topology, staged: bool) -> RefitEstimate:
        return next(e for e in estimates if e.topology is topology and e.scenario.staged == staged)

    best = _best(estimates)
    best_staged = fleet_row(best.topology, staged=True)
    one_source = fleet_row(Topology.ONE_SOURCE, staged=False)
    relay = fleet_row(Topology.PIPELINED_RELAY, staged=False)
    relay_staged = fleet_row(Topology.PIPELINED_RELAY, staged=True)
    pipelined = fleet_row(Topology.SHARDED_PIPELINED, staged=False)
    pipelined_staged = fleet_row(Topology.SHARDED_PIPELINED, staged=True)
    device_costs = replace(fleet.costs, install_bytes_per_s=fleet.device_install_bytes_per_s)
    device = estimate(Topology.SHARDED_TWO_HOP, fleet.scenario(staged=True), device_costs)
    slow_nic = estimate(
        Topology.SHARDED_TWO_HOP,
        replace(fleet.scenario(staged=False), nic=Link(25e9, 20e-6)),
        fleet.costs,
    )
    print(
        f"\nsensitivity: sharded two-hop, staged in device memory (an HBM copy; needs 2 x 62.5 "
        f"GB per GPU): refit {device.refit_s:.3g} s, stall {device.stall_s:.3g} s; sharded "
        f"two-hop at 25 GB/s per NIC (half the line rate): refit {slow_nic.refit_s:.3g} s"
    )
    sizes = _by_size(fleet)
    print(
        f"\nby model size (bf16, 4 replicas, the fleet's links and costs; refit in place "
        f"unless said, s)\n{'params':>8}{'GB':>7}"
        f"{'GPUs/rep':>9}{'one source':>11}{'relay':>8}{'relay staged stall':>19}"
        f"{'sharded 2-hop':>14}{'2-hop staged':>13}{'sharded pipelined':>19}{'light':>7}"
    )
    for row in sizes:
        print(
            f"{row['params_b']:>7g}B{row['gb']:>7g}{row['gpus_per_replica']:>9}"
            f"{row['one_source_s']:>11.3g}{row['relay_s']:>8.3g}"
            f"{row['relay_staged_stall_s']:>19.3g}{row['sharded_two_hop_s']:>14.3g}"
            f"{row['sharded_two_hop_staged_s']:>13.3g}{row['sharded_pipelined_s']:>19.3g}"
            f"{row['speed_of_light_s']:>7.3g}"
        )
    print(
        "published (figures from elsewhere, docs/scale.md): RDMA static schedule 1.3 s; vLLM "
        "sharded_rdt 7.53 s (its speed of light 1.25 s); checkpoint-engine broadcast 16.04 s"
    )
    first_bar = best.refit_s <= 5.0
    print(
        f"best implemented design ({best.design}): refit {best.refit_s:.3g} s (first bar "
        f"<= 5 s: {'met' if first_bar else 'NOT met'}), stall {best.stall_s:.3g} s; staged: "
        f"refit {best_staged.refit_s:.3g} s, stall {best_staged.stall_s:.3g} s; one source "
        f"{one_source.refit_s:.3g} s; the sharded two-hop (not pipelined) "
        f"{fleet_row(Topology.SHARDED_TWO_HOP, staged=False).refit_s:.3g} s"
    )

    wall = time.perf_counter() - started
    summary = {
        "max_prediction_error": round(max_error, 4),
        "max_prediction_error_of": f"refit, |predicted - measured| / measured, {len(rows)} cells "
        f"(one source, pipelined relay, sharded two-hop and sharded pipelined: {BALANCED.name}; "
        f"sharded two-hop: {UNBALANCED.name})",
        "max_prediction_error_unbalanced": round(max_unbalanced_error, 4),
        "grid_broadcast": BROADCAST.value,
        "emulated_speedup": round(min(speedups.values()), 3),
        "emulated_speedup_by_rate": {f"{r:g}": round(v, 3) for r, v in speedups.items()},
        "emulated_speedup_predicted": {
            f"{r:g}": round(v, 3) for r, v in predicted_speedups.items()
        },
        "emulated_speedup_best_topology": {f"{r:g}": t.value for r, t in best_by_rate.items()},
        "emulated_speedup_compares": "the best implemented topology (measured; the sharded "
        "ones: 2 trainer ranks, replicas of 2 ranks) / one source (P2R then R2R from a single "
        "trainer rank, the whole model), 3 replicas, in place, emulated NIC",
        "emulated_speedup_pipelined_relay": {
            f"{r:g}": round(v, 3) for r, v in relay_speedups.items()
        },
        "fleet_1t_refit_s": round(best.refit_s, 3),
        "fleet_1t_stall_s": round(best.stall_s, 3),
        "fleet_1t_best_design": best.design,
        "fleet_1t_first_bar_met": first_bar,
        "fleet_1t_staged_refit_s": round(best_staged.refit_s, 3),
        "fleet_1t_staged_stall_s": round(best_staged.stall_s, 3),
        "fleet_1t_one_source_refit_s": round(one_source.refit_s, 3),
        "fleet_1t_pipelined_relay_refit_s": round(relay.refit_s, 3),
        "fleet_1t_pipelined_relay_staged_refit_s": round(relay_staged.refit_s, 3),
        "fleet_1t_pipelined_relay_staged_stall_s": round(relay_staged.stall_s, 3),
        "fleet_1t_sharded_pipelined_refit_s": round(pipelined.refit_s, 3),
        "fleet_1t_sharded_two_hop_refit_s": round(
            fleet_row(Topology.SHARDED_TWO_HOP, staged=False).refit_s, 3
        ),
        "fleet_1t_sharded_pipelined_refit_s_modelled": round(pipelined.refit_s, 3),
        "fleet_1t_sharded_pipelined_staged_refit_s_modelled": round(pipelined_staged.refit_s, 3),
        "fleet_1t_sharded_pipelined_staged_stall_s_modelled": round(pipelined_staged.stall_s, 3),
        "fleet_1t_speed_of_light_s": round(fleet.speed_of_light_s, 3),
        "fleet_1t_one_nic_bound_s": round(fleet.model_bytes / fleet.nic.rate_bytes_per_s, 3),
        "max_stall_prediction_error_staged": round(max(stall_errors), 4),
        "grid_cells": len(rows),
        "trainer_ranks_measured": sorted({r["trainer_ranks"] for r in rows}),
        "two_trainer_ranks": "measured: sharded_two_hop, 2 trainer ranks into replicas of 2 "
        "tensor-parallel ranks, 2 and 3 replicas, staged and in place; and 3 trainer ranks into "
        "3 replicas of 1 rank (unbalanced: the replica rank's ingress bounds P2R), staged and "
        "in place",
        "calibration": {k: float(f"{v:.4g}") for k, v in calibration.items()},
        "wall_s": round(wall, 1),
    }
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "rows": rows, "summary": summary}, indent=2)
        )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
