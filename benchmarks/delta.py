"""Delta syncs (issue 44): how much of the served model does a training step change, what does
shipping only that cost, and what would it buy on the 1T fleet?

Three parts:

1. **Measurement.** A testing-kit Llama (:func:`rollout_sync.testing.tiny_llama.tiny_llama`,
   ~23M parameters, ``--quick``: ~0.6M) initialised with std 0.02 (Hugging Face's
   ``initializer_range``; the norms around 1), its float32 master trained by AdamW (betas
   0.9 / 0.999, eps 1e-8, no weight decay) on a next-token loss over uniformly random token ids
   (fixed seed, the same batches for every learning rate); the served copy is the master cast
   to bf16 after each step. At lr 1e-6 (the headline) and 3e-6, each step from the second to
   ``--steps`` (the first is Adam's largest: skipped) is measured against the served copy
   before it: the fraction of bf16 elements that changed bit for bit, and the bytes of
   :func:`~rollout_sync.transfer.delta.encode_delta` over every tensor against the model's
   bf16 bytes; every delta is applied to a copy of its base and must give the new version's
   bits. The trainer's extra memory is measured too: the bf16 base copy the encoder keeps (the
   version the replicas serve), over the served weights' bytes.
2. **The model.** :func:`rollout_sync.plan.build_plan` on
   :data:`~rollout_sync.scale.FLEET_1T`'s shape with the measured changed fraction: the best
   delta design whose topology is implemented (by the plan's rule: the fastest refit, or one
   within :data:`~rollout_sync.plan.CLOSE_REFIT` of it with a shorter stall) among the
   implemented delta designs, against the best
   implemented full design by the same rule (``fleet_1t_delta_implemented`` says whether
   the package runs that design).
3. **The syncs** (:func:`measure_syncs`; ``--no-syncs`` skips them): the measured versions of
   the headline run moved by real syncs, whole and by delta side by side, on three processes
   (gloo on loopback, every rank's NIC emulated at ``--rate-mb-s``, 50 MB/s by default): a
   trainer (a :class:`~rollout_sync.transfer.delta_sync.DeltaEncoder` and a paced
   :class:`~rollout_sync.WeightTransfer`) and two staged :class:`~rollout_sync.RolloutWorker`
   replicas, the first relaying to the second (pipelined). Version 1 goes whole; then each
   measured step's version by delta, and the same version again whole, so both kinds move
   between the same two states. Per sync: the refit (from a barrier until every rank
   returned), the stall (the replicas' install), what a replica held beyond its served weights
   (the packed delta until its install; a whole version's staging copy), and every replica's
   weights checked bit for bit against the trainer's version.

JSON keys: ``changed_fraction`` (median over the measured steps at lr 1e-6),
``changed_fraction_3e-6``, ``delta_bytes_over_full`` (median at 1e-6),
``delta_bytes_over_full_3e-6``, ``delta_bytes_over_full_modelled`` (what
:func:`~rollout_sync.plan.delta_bytes` models at the measured fraction),
``trainer_extra_bytes_over_weights`` (the encoder's bf16 base, over the served bytes),
``trainer_transient_bytes_over_weights`` (beyond it, while encoding tensor by tensor: the
largest tensor's new bf16 copy and its delta), ``fleet_1t_delta_refit_s``,
``fleet_1t_delta_stall_s``, ``fleet_1t_delta_design``, ``fleet_1t_delta_implemented``,
``fleet_1t_delta_sync_bytes`` (the delta the model moves: the plan's encoding),
``fleet_1t_full_refit_s``, ``fleet_1t_full_stall_s``, ``fleet_1t_full_design``,
``model_params``, ``model_bytes`` (bf16), ``measured_steps``, per step at each learning rate
(``steps_1e-6``, ``steps_3e-6``: ``step``, ``changed_fraction``, ``delta_bytes_over_full``,
``delta_written_fraction`` (elements the delta writes, dense blocks whole), ``encode_s``,
``round_trip``), ``round_trip`` (every step's), ``quick``, ``lr``, ``lr_second``,
``targets_met``, ``wall_s``; from part 3: ``sync_time_over_full`` (median over the steps of
the delta sync's refit over the whole sync's), ``stall_over_full`` (the same of the stalls),
``sync_delta_refit_s``, ``sync_full_refit_s``, ``sync_delta_bytes_over_full`` (what the
trainer's delta sends moved), ``staging_bytes_over_weights`` (what a replica staged for a
delta, over the weights), ``full_staging_bytes_over_weights`` (for a whole version),
``transfer_buffer_bytes_over_weights`` (the transfers' bucket buffers, the same for both
kinds), ``bit_identical``, ``sync_rate_mb_s``, ``syncs`` (each sync: ``version``, ``kind``,
``refit_s``, ``stall_s``, ``nbytes``, ``exact``). Targets: ``delta_bytes_over_full`` <= 0.15,
``fleet_1t_delta_refit_s`` <= 0.5, ``sync_time_over_full`` <= 0.3,
``staging_bytes_over_weights`` <= 0.2, ``bit_identical``. Prints a table per learning rate,
then, as the last line, one JSON object; exits 1 if a delta did not round-trip or a replica's
weights differed from the trainer's version.

Run: ``python benchmarks/delta.py`` (about 1 minute on 2 quiet cores, 2 loaded; ``--quick``:
~15 s)

    python benchmarks/delta.py [--steps 9] [--lr 1e-6 3e-6] [--quick] [--no-syncs]
                               [--rate-mb-s 50] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The path is set up above, so a source checkout runs without installing the package.
from rollout_sync import SyncMode, TransferConfig, build_sync_groups
from rollout_sync.plan import (
    CLOSE_REFIT,
    Design,
    FleetSpec,
    ModelSpec,
    build_plan,
    delta_bytes,
    dtype_bytes,
)
from rollout_sync.scale import FLEET_1T, Link
from rollout_sync.testing import IdleFlatRollout, run_group
from rollout_sync.testing.emulated_nic import EmulatedNic, PacedWeightTransfer
from rollout_sync.testing.tiny_llama import tiny_llama
from rollout_sync.transfer.delta import apply_delta, bits_of, encode_delta
from rollout_sync.transfer.delta_sync import DeltaEncoder, EncodedDelta
from rollout_sync.worker import P2R, R2R, RolloutWorker

HEADLINE_LR = 1e-6
SECOND_LR = 3e-6
TARGET_DELTA_BYTES = 0.15
"""``delta_bytes_over_full`` at most this (issue 44)."""
TARGET_REFIT_S = 0.5
"""``fleet_1t_delta_refit_s`` at most this (issue 44)."""
TARGET_SYNC_TIME = 0.3
"""``sync_time_over_full`` at most this (issue 44)."""
TARGET_STAGING = 0.2
"""``staging_bytes_over_weights`` at most this (issue 44)."""
SERVED = torch.bfloat16
STD = 0.02
"""Hugging Face's ``initializer_range``: what a pretrained-from-scratch Llama starts from."""

MODEL = {
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}
"""~23M parameters: embeddings and LM head 4.2M, six layers of 3.2M."""
QUICK_MODEL = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}
"""~0.6M parameters: a smoke test of the same code."""


@dataclass(frozen=True)
class StepMeasure:
    """One measured training step: the served bf16 copy before it against the one after."""

    step: int
    changed_fraction: float
    """bf16 elements whose bits changed, over all served elements."""
    delta_bytes_over_full: float
    """Every tensor's encoded delta (payload bytes), over the model's bf16 bytes."""
    delta_written_fraction: float
    """Elements the delta writes (a dense block's all), over all served elements."""
    encode_s: float
    """The whole model's :func:`encode_delta`, tensor by tensor, on this machine's CPU."""
    round_trip: bool
    """Every tensor's delta, applied to a copy of its base, gave the new version's bits."""


@dataclass(frozen=True)
class Trajectory:
    """One learning rate's run: every measured step, and the trainer's memory for deltas."""

    lr: float
    params: int
    model_bytes: int
    """The served weights (bf16) in bytes."""
    base_bytes: int
    """The encoder's base: the bf16 copy of the version the replicas serve, in bytes."""
    transient_bytes: int
    """Beyond the base while encoding tensor by tensor: the largest tensor's new bf16 copy plus
    its delta's payload (the most a step held at once)."""
    steps: tuple[StepMeasure, ...]

    def median(self, key: str) -> float:
        """The median of a :class:`StepMeasure` field over the measured steps."""
        return float(statistics.median(getattr(s, key) for s in self.steps))


VersionHook = Callable[[int, Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]], None]
"""Called after each measured step with ``(step, served before, served after)``: the bf16
versions a sync would ship (the side-by-side transfers' way in)."""


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


def train_and_measure(
    lr: float,
    *,
    steps: int,
    quick: bool,
    seed: int,
    batch: int,
    seq_len: int,
    on_version: VersionHook | None = None,
) -> Trajectory:
    """Train a fresh model ``steps`` steps at ``lr`` (the module's protocol) and measure steps
    2 to ``steps`` against the served copy before each."""
    config = QUICK_MODEL if quick else MODEL
    torch.manual_seed(seed)
    model = tiny_llama(seed=seed, std=STD, **config)
    model.train()
    params = dict(model.named_parameters())
    optimizer = torch.optim.AdamW(
        params.values(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
    )
    tokens = torch.Generator().manual_seed(seed + 1)
    served = {name: p.detach().to(SERVED) for name, p in params.items()}
    model_bytes = sum(t.numel() * t.element_size() for t in served.values())
    numel = sum(t.numel() for t in served.values())
    measured: list[StepMeasure] = []
    transient = 0
    for step in range(1, steps + 1):
        ids = torch.randint(config["vocab_size"], (batch, seq_len), generator=tokens)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step == 1:
            served = {name: p.detach().to(SERVED) for name, p in params.items()}
            continue
        changed = written = encoded = 0
        encode_s = 0.0
        round_trip = True
        before = dict(served) if on_version is not None else {}
        for name, p in params.items():
            new = p.detach().to(SERVED)
            base = served[name]
            changed += int((bits_of(base) != bits_of(new)).sum())
            started = time.perf_counter()
            delta = encode_delta(base, new)
            encode_s += time.perf_counter() - started
            encoded += delta.nbytes
            written += delta.changed
            transient = max(transient, _nbytes(new) + delta.nbytes)
            applied = base.clone()
            apply_delta(applied, delta, name=name)
            round_trip = round_trip and torch.equal(bits_of(applied), bits_of(new))
            served[name] = new
        if on_version is not None:
            on_version(step, before, served)
        measured.append(
            StepMeasure(
                step, changed / numel, encoded / model_bytes, written / numel, encode_s, round_trip
            )
        )
    return Trajectory(
        lr=lr,
        params=numel,
        model_bytes=model_bytes,
        base_bytes=sum(_nbytes(t) for t in served.values()),
        transient_bytes=transient,
        steps=tuple(measured),
    )


def _best(designs: Sequence[Design]) -> Design:
    """The plan's rule 5 among ``designs``: the fastest refit, or one within
    :data:`CLOSE_REFIT` of it with a shorter stall."""
    fastest = min(designs, key=lambda d: (d.refit_s, d.stall_s, d.name))
    close = [
        d
        for d in designs
        if d.refit_s <= (1 + CLOSE_REFIT) * fastest.refit_s and d.stall_s < fastest.stall_s
    ]
    return min(close, key=lambda d: (d.stall_s, d.refit_s)) if close else fastest


def fleet_1t(changed_fraction: float) -> dict[str, Any]:
    """The cost model on FLEET_1T's shape with ``changed_fraction``: the best implemented delta
    design and the best implemented full one."""
    _, itemsize = dtype_bytes("bfloat16")
    model = ModelSpec.of(FLEET_1T.model_bytes / itemsize, FLEET_1T.tensors, "bfloat16")
    fleet = FleetSpec(
        trainer_ranks=FLEET_1T.trainer_gpus,
        replicas=FLEET_1T.replicas,
        gpus_per_replica=FLEET_1T.gpus_per_replica,
        nic_bytes_per_s=FLEET_1T.nic.rate_bytes_per_s,
        bucket_bytes=FLEET_1T.bucket_bytes,
    )
    plan = build_plan(model, fleet, changed_fraction=changed_fraction, base=FLEET_1T)
    delta = _best([d for d in plan.designs if d.delta and d.implemented])
    full = _best([d for d in plan.designs if not d.delta and d.implemented])
    return {
        "fleet_1t_delta_refit_s": round(delta.refit_s, 4),
        "fleet_1t_delta_stall_s": round(delta.stall_s, 4),
        "fleet_1t_delta_design": delta.name,
        "fleet_1t_delta_implemented": delta.implemented,
        "fleet_1t_delta_sync_bytes": delta.estimate.scenario.model_bytes,
        "fleet_1t_full_refit_s": round(full.refit_s, 4),
        "fleet_1t_full_stall_s": round(full.stall_s, 4),
        "fleet_1t_full_design": full.name,
        "delta_bytes_over_full_modelled": round(
            delta_bytes(model, changed_fraction) / model.model_bytes, 5
        ),
    }


SYNC_RATE_MB_S = 50.0
"""The emulated NIC of every rank of the side-by-side syncs (issue 44: 50 MB/s)."""
SYNC_BUCKET_MB = 4.0
SYNC_RANKS = 3
"""The trainer (rank 0) and two replicas: rank 1 receives the P2R and relays it (pipelined) to
rank 2, so both hops carry each sync."""


def _sync_process(
    rank: int, path: str, bucket_bytes: int, rate: float, timeout: float
) -> dict[str, Any]:
    """One rank of the side-by-side syncs (see :func:`measure_syncs`)."""
    versions: list[dict[str, torch.Tensor]] = torch.load(path, weights_only=True)
    groups = build_sync_groups(0, [1, 2], timeout_s=timeout)
    nic = EmulatedNic(Link(rate, 0.0))
    config = TransferConfig(bucket_bytes=bucket_bytes, timeout_s=timeout)
    p2r = PacedWeightTransfer(groups.p2r, 0, nic=nic, config=config) if rank in (0, 1) else None
    r2r = (
        PacedWeightTransfer(groups.r2r, 1, nic=nic, config=config)
        if rank in (1, 2) and groups.r2r is not None
        else None
    )
    worker = None
    rollout = None
    if rank > 0:
        rollout = IdleFlatRollout({n: torch.zeros_like(t) for n, t in versions[0].items()})
        worker = RolloutWorker(
            rollout, mode=SyncMode.STAGED, p2r=p2r, r2r=r2r, weight_sync_timeout=timeout
        )
    encoder = DeltaEncoder()
    rows: list[dict[str, Any]] = []
    # Version 1 whole (it starts everything), then per measured step: its delta, then the same
    # version again whole, so both move the same version between the same two states.
    plan = [(1, "whole")] + [
        (k, kind) for k in range(2, len(versions) + 1) for kind in ("delta", "whole")
    ]
    for version, kind in plan:
        weights = versions[version - 1]
        dist.barrier()
        start = time.monotonic()
        stall = staging = nbytes = 0.0
        exact = True
        if rank == 0:
            assert p2r is not None
            encoded = encoder.encode(weights, version) if kind == "delta" else None
            stats = p2r.send(weights, version=version, delta=encoded)
            assert stats.sync_kind == kind, (version, kind, stats.sync_kind, stats.whole_reason)
            sent = encoded if isinstance(encoded, EncodedDelta) else None
            encoder.committed(weights, version, sent)
            nbytes = float(stats.nbytes)
        else:
            assert worker is not None and rollout is not None
            command = P2R(step=version, relay=True) if rank == 1 else R2R(step=version)
            result = worker.handle(command)
            assert result.ok, result.error
            report = worker.last_weight_sync_report
            assert report is not None and report.sync_kind == kind, (rank, version, report)
            stall = report.stall_s
            # What this rank held beyond its served weights for the sync: the packed delta (or
            # the staging copy of a whole version) and the transfers' bucket buffers.
            held = report.nbytes if kind == "delta" else worker.statistics().staging_bytes
            buffers = sum(t.staging_bytes for t in (p2r, r2r) if t is not None)
            staging = float(held), float(buffers)
            served = rollout.served_weights()
            exact = all(torch.equal(served[n], t) for n, t in weights.items())
        end = time.monotonic()
        mine = torch.tensor([start, end, stall], dtype=torch.float64)
        every = [torch.zeros(3, dtype=torch.float64) for _ in range(SYNC_RANKS)]
        dist.all_gather(every, mine)
        rows.append(
            {
                "version": version,
                "kind": kind,
                "refit_s": max(float(e[1]) for e in every) - float(every[0][0]),
                "stall_s": max(float(e[2]) for e in every[1:]),
                "staging": staging,
                "nbytes": nbytes,
                "exact": exact,
            }
        )
    dist.barrier()
    if worker is not None:
        worker.close(timeout)
    return {"rows": rows, "extra_bytes": encoder.extra_bytes}


def measure_syncs(
    versions: Sequence[Mapping[str, torch.Tensor]], *, rate_mb_s: float, bucket_mb: float
) -> dict[str, Any]:
    """Part 3: the measured versions moved by real syncs, whole and by delta side by side.

    Three processes (gloo on loopback, every rank's NIC emulated at ``rate_mb_s``, full duplex):
    a trainer and two staged replicas, the first relaying to the second (pipelined), the
    production code throughout (:class:`~rollout_sync.RolloutWorker`, a
    :class:`~rollout_sync.WeightTransfer` whose collectives are paced). Version 1 goes whole;
    then for each measured step, its version by delta and the same version again whole. Per
    sync: the refit (from a barrier until every rank returned), the stall (the replicas'
    installs), and what a replica held beyond its served weights (the packed delta, or the
    staging copy of a whole version; the transfers' bucket buffers apart); every replica's
    weights are checked bit for bit against the trainer's version after each sync.
    """
    weights_bytes = sum(t.numel() * t.element_size() for t in versions[0].values())
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "versions.pt")
        torch.save([dict(v) for v in versions], path)
        results = run_group(
            _sync_process,
            SYNC_RANKS,
            (path, int(bucket_mb * (1 << 20)), rate_mb_s * 1e6, 60.0),
            timeout_s=600,
            group_timeout_s=60,
        )
    rows = results[0]["rows"]
    replica_rows = [results[r]["rows"] for r in (1, 2)]
    pairs = [(rows[i], rows[i + 1]) for i in range(1, len(rows), 2)]  # (delta, whole) per step

    def median(values: Sequence[float]) -> float:
        return float(statistics.median(values))

    held = [max(replica_rows[r][i]["staging"][0] for r in range(2)) for i in range(1, len(rows), 2)]
    buffers = max(replica_rows[r][i]["staging"][1] for r in range(2) for i in range(len(rows)))
    whole_staging = max(
        replica_rows[r][i]["staging"][0] for r in range(2) for i in range(0, len(rows), 2)
    )
    exact = all(row["exact"] for replica in replica_rows for row in replica)
    return {
        "sync_rate_mb_s": rate_mb_s,
        "sync_time_over_full": round(median([d["refit_s"] / w["refit_s"] for d, w in pairs]), 4),
        "stall_over_full": round(median([d["stall_s"] / w["stall_s"] for d, w in pairs]), 4),
        "sync_delta_refit_s": round(median([d["refit_s"] for d, _ in pairs]), 4),
        "sync_full_refit_s": round(median([w["refit_s"] for _, w in pairs]), 4),
        "sync_delta_bytes_over_full": round(
            median([d["nbytes"] / weights_bytes for d, _ in pairs]), 5
        ),
        "staging_bytes_over_weights": round(median(held) / weights_bytes, 5),
        "full_staging_bytes_over_weights": round(whole_staging / weights_bytes, 4),
        "transfer_buffer_bytes_over_weights": round(buffers / weights_bytes, 4),
        "bit_identical": exact,
        "syncs": [
            {
                k: (round(v, 4) if isinstance(v, float) else v)
                for k, v in row.items()
                if k != "staging"
            }
            for row in rows
        ],
    }


def _print_trajectory(t: Trajectory) -> None:
    print(f"\nlr {t.lr:g}")
    print(f"{'step':>5}{'changed':>10}{'delta/full':>12}{'written':>10}{'encode s':>10}")
    for s in t.steps:
        print(
            f"{s.step:>5}{s.changed_fraction:>10.4f}{s.delta_bytes_over_full:>12.4f}"
            f"{s.delta_written_fraction:>10.4f}{s.encode_s:>10.3f}"
        )
    print(
        f"{'p50':>5}{t.median('changed_fraction'):>10.4f}"
        f"{t.median('delta_bytes_over_full'):>12.4f}{t.median('delta_written_fraction'):>10.4f}"
        f"{t.median('encode_s'):>10.3f}"
    )


def _rows(t: Trajectory) -> list[dict[str, Any]]:
    return [
        {
            "step": s.step,
            "changed_fraction": round(s.changed_fraction, 6),
            "delta_bytes_over_full": round(s.delta_bytes_over_full, 6),
            "delta_written_fraction": round(s.delta_written_fraction, 6),
            "encode_s": round(s.encode_s, 4),
            "round_trip": s.round_trip,
        }
        for s in t.steps
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=9, help="training steps (default 9)")
    parser.add_argument(
        "--lr",
        type=float,
        nargs=2,
        default=[HEADLINE_LR, SECOND_LR],
        metavar=("HEADLINE", "SECOND"),
        help="the headline learning rate and the second one (default 1e-6 3e-6)",
    )
    parser.add_argument("--quick", action="store_true", help="a ~0.6M model: a smoke test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument(
        "--no-syncs", action="store_true", help="skip part 3, the syncs side by side"
    )
    parser.add_argument(
        "--rate-mb-s",
        type=float,
        default=SYNC_RATE_MB_S,
        help=f"part 3's emulated NIC rate (default {SYNC_RATE_MB_S:g} MB/s)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2: the first step is not measured")
    started = time.perf_counter()

    headline_lr, second_lr = args.lr
    versions: list[Mapping[str, torch.Tensor]] = []

    def keep(
        step: int, before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]
    ) -> None:
        if not versions:
            versions.append(dict(before))
        versions.append(dict(after))

    runs = [
        train_and_measure(
            lr,
            steps=args.steps,
            quick=args.quick,
            seed=args.seed,
            batch=args.batch,
            seq_len=args.seq_len,
            on_version=keep if lr == headline_lr and not args.no_syncs else None,
        )
        for lr in (headline_lr, second_lr)
    ]
    headline, second = runs
    print(
        f"model: {headline.params / 1e6:.1f}M parameters, {headline.model_bytes / 1e6:.1f} MB "
        f"in bf16; AdamW on an fp32 master, random tokens ({args.batch} x {args.seq_len}), "
        f"steps 2-{args.steps} measured"
    )
    for run in runs:
        _print_trajectory(run)

    changed = headline.median("changed_fraction")
    round_trip = all(s.round_trip for run in runs for s in run.steps)
    result: dict[str, Any] = {
        "changed_fraction": round(changed, 6),
        "changed_fraction_3e-6": round(second.median("changed_fraction"), 6),
        "delta_bytes_over_full": round(headline.median("delta_bytes_over_full"), 6),
        "delta_bytes_over_full_3e-6": round(second.median("delta_bytes_over_full"), 6),
        "trainer_extra_bytes_over_weights": round(headline.base_bytes / headline.model_bytes, 4),
        "trainer_transient_bytes_over_weights": round(
            headline.transient_bytes / headline.model_bytes, 4
        ),
        **fleet_1t(changed),
    }
    if not args.no_syncs:
        result.update(measure_syncs(versions, rate_mb_s=args.rate_mb_s, bucket_mb=SYNC_BUCKET_MB))
    met = {
        f"delta_bytes_over_full<={TARGET_DELTA_BYTES}": result["delta_bytes_over_full"]
        <= TARGET_DELTA_BYTES,
        f"fleet_1t_delta_refit_s<={TARGET_REFIT_S}": result["fleet_1t_delta_refit_s"]
        <= TARGET_REFIT_S,
    }
    if not args.no_syncs:
        met[f"sync_time_over_full<={TARGET_SYNC_TIME}"] = (
            result["sync_time_over_full"] <= TARGET_SYNC_TIME
        )
        met[f"staging_bytes_over_weights<={TARGET_STAGING}"] = (
            result["staging_bytes_over_weights"] <= TARGET_STAGING
        )
        met["bit_identical"] = result["bit_identical"]
    modelled = "" if result["fleet_1t_delta_implemented"] else ", modelled, not implemented"
    print(
        f"\nchanged fraction (p50): {changed:.4f} at lr {headline_lr:g}, "
        f"{result['changed_fraction_3e-6']:.4f} at lr {second_lr:g}"
    )
    print(
        f"delta bytes / full: {result['delta_bytes_over_full']:.4f} (target <= "
        f"{TARGET_DELTA_BYTES}); modelled at that fraction: "
        f"{result['delta_bytes_over_full_modelled']:.4f}; every delta applied to its base gave "
        f"the new version bit for bit: {round_trip}"
    )
    print(
        f"trainer's extra memory: {result['trainer_extra_bytes_over_weights']:.2f} x the served "
        f"weights (the bf16 base), {result['trainer_transient_bytes_over_weights']:.3f} more "
        "while encoding"
    )
    if not args.no_syncs:
        print(
            f"syncs at {args.rate_mb_s:g} MB/s (trainer -> staged replica, relayed to a second): "
            f"delta refit {result['sync_delta_refit_s']:.3f} s against "
            f"{result['sync_full_refit_s']:.3f} s whole: {result['sync_time_over_full']:.3f} "
            f"(target <= {TARGET_SYNC_TIME}); stall {result['stall_over_full']:.3f} of the whole "
            f"install; staged {result['staging_bytes_over_weights']:.4f} of the weights (target "
            f"<= {TARGET_STAGING}; whole: {result['full_staging_bytes_over_weights']:.2f}, bucket "
            f"buffers apart: {result['transfer_buffer_bytes_over_weights']:.3f}); bit-identical: "
            f"{result['bit_identical']}"
        )
    print(
        f"fleet 1T, delta ({result['fleet_1t_delta_design']}{modelled}): refit "
        f"{result['fleet_1t_delta_refit_s']:.3g} s (target <= {TARGET_REFIT_S}), stall "
        f"{result['fleet_1t_delta_stall_s']:.3g} s; full ({result['fleet_1t_full_design']}): "
        f"refit {result['fleet_1t_full_refit_s']:.3g} s, stall "
        f"{result['fleet_1t_full_stall_s']:.3g} s: " + ("met" if all(met.values()) else "MISSED")
    )
    result.update(
        {
            "model_params": headline.params,
            "model_bytes": headline.model_bytes,
            "quick": args.quick,
            "lr": headline_lr,
            "lr_second": second_lr,
            "measured_steps": [s.step for s in headline.steps],
            "round_trip": round_trip,
            "steps_1e-6": _rows(headline),
            "steps_3e-6": _rows(second),
            "targets_met": met,
            "wall_s": round(time.perf_counter() - started, 1),
        }
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0 if round_trip and result.get("bit_identical", True) else 1


if __name__ == "__main__":
    sys.exit(main())
