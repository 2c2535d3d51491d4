"""vLLM's native weight update with the ``"rollout_sync"`` engine, against the alternatives.

For a tiny Llama and a ~100 MB random Llama served by vLLM (CPU build works), side by side on
one engine, alternating so the ratios are fair on a noisy machine:

* **guarded native**: the trainer engine (``WeightTransferTrainerFactory``) pushes through a
  ``GuardedWeightSyncClient``: pause, hold, start, the transfer (manifest, buckets,
  checksums, votes) loaded by vLLM's layerwise reload, finish with the read-back, resume;
* **unguarded native**: the same push through vLLM's plain client protocol (no pause): the
  bracket's overhead is guarded over unguarded;
* **safetensors RPC**: the backend's older write, the model serialized through
  ``collective_rpc`` (the backend's ``write_path="rpc"``; the default where the engine has no
  weight-transfer config);
* **raw broadcast**: one gloo broadcast of the same bytes between this process and another,
  the wire's speed;
* **staged**: the same push staged (``RolloutSyncTrainerInitInfo(staged=True)`` through a
  ``GuardedWeightSyncClient(staged=True)``) while ``--streams`` requests decode: the workers
  receive on a thread of their own and the engine keeps stepping; only the install (vLLM's
  load of the staged tensors, the read-back, the version) is parked. Reported: the whole update
  and its stall (the report's ``stall_s``: parked to resumed), the decode tokens produced while
  the wire ran, and the decode step (the interval between two tokens of one stream then);
* **load alone**: vLLM's own load of the same tensors with no wire (layerwise reload, the
  model's loader, finalize; tensors already in the worker), run in the engine's worker, parked;
* **engine wire**: the same send received by the worker's ``"rollout_sync"`` transfer with no
  load (``WeightTransfer.stream`` with the engine's ``receive_ahead``,
  checksums verified, the loader a no-op), timed in the worker from the end of the manifest
  vote to the last bucket verified; **engine wire, no checksums**: the same without checksums
  (what the checksums cost).

The engine runs in its own process (vLLM's engine core), so every row crosses a process
boundary. Ratios are of bytes/s (higher is better for ``*_over_raw``). The last line is one JSON
object: ``native_over_raw``, ``rpc_over_raw``, ``bracket_overhead``, ``stall_over_update``
(staged stall / whole staged update), ``staged_stall_ms``, ``staged_update_ms``,
``load_alone_ms``, ``decode_step_ms``, ``tokens_during_wire``, ``engine_wire_ms``,
``engine_wire_over_raw`` (engine wire / raw broadcast: what the engine adds to the wire),
``engine_wire_unchecked_over_raw`` (the same without checksums), ``update_over_max_wire_load``
(guarded native / max(raw broadcast, load alone): how well the in-place update overlaps the
wire with vLLM's load), ``update_over_wire_plus_load`` (guarded native / (raw broadcast + load
alone)) (medians; all for the larger model), ``model_mb``, and every row.

Run: ``python benchmarks/vllm_native.py`` (``--iterations``, ``--skip-large``, ``--streams``,
``--bucket-mb``, ``--receive-ahead``; their defaults are ``RolloutSyncTrainerInitInfo``'s). The
engine's worker runs one OpenMP thread (``OMP_NUM_THREADS``, default 1, as in the main job).

``--tp N`` measures tensor parallelism instead: the backend's native write
(``VLLMBlockingBackend.load_weights``) into an engine with ``tensor_parallel_size=1`` and one
with ``N``, the same model: the push time (median), and per worker the bytes its
``"rollout_sync"`` engine received against the bytes of its shard (what vLLM's loader keeps).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
# One OpenMP thread in the engine's worker, as the main job runs its engines: with two, vLLM's
# load alone keeps both cores of a 2-core machine busy (the second thread mostly spinning) and
# nothing is left for the wire to overlap with. OMP_NUM_THREADS=2 in the environment overrides.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The load-alone row runs a function of this file in the engine's worker (collective_rpc).
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rollout_sync.backends.vllm import VLLMAsyncBackend, VLLMEngineConfig, greedy_params
from rollout_sync.backends.vllm.engine import DEFAULT_BUCKET_BYTES, DEFAULT_RECEIVE_AHEAD
from rollout_sync.distributed import find_free_port, standalone_group
from rollout_sync.errors import VLLMUnavailableError
from rollout_sync.testing.tiny_llama import build_tiny_llama, random_llama_weights

LARGE = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}
"""~24M parameters: ~95 MB in float32."""


def _raw_receiver(port: int, nbytes: int, iterations: int) -> None:
    torch.set_num_threads(1)
    group = standalone_group("127.0.0.1", port, 1, 2, timeout_s=120)
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(iterations):
        group.broadcast([buffer]).wait()
    group.shutdown()


def _raw_broadcast_s(nbytes: int, iterations: int) -> list[float]:
    """Seconds per broadcast of ``nbytes`` from this process to another, over gloo."""
    port = find_free_port()
    child = multiprocessing.get_context("spawn").Process(
        target=_raw_receiver, args=(port, nbytes, iterations + 1)
    )
    child.start()
    group = standalone_group("127.0.0.1", port, 0, 2, timeout_s=120)
    buffer = torch.ones(nbytes, dtype=torch.uint8)
    times = []
    for i in range(iterations + 1):
        start = time.perf_counter()
        group.broadcast([buffer]).wait()
        if i:  # the first one warms the connection up
            times.append(time.perf_counter() - start)
    group.shutdown()
    child.join(60)
    return times


def _load_alone(worker: Any, seed: int, repeats: int) -> list[float]:
    """In the engine's worker (``collective_rpc``): seconds for vLLM's own load of version
    ``seed``'s tensors, already in the worker (no wire): the layerwise reload, the model's
    loader, finalize; ``repeats`` times. The same steps a staged install runs, without the
    read-back."""
    engine = worker.weight_transfer_engine
    shapes = {name: tuple(t.shape) for name, t in engine._expected.items()}
    weights = random_llama_weights(shapes, seed=seed)
    times = []
    for _ in range(repeats):
        names = list(weights)
        tensors = [t.clone() for t in weights.values()]  # the reload keeps what it is given
        start = time.perf_counter()
        engine._start_reload()
        engine._load_into_model(names, tensors)
        engine._finish_reload()
        times.append(time.perf_counter() - start)
    return times


def _wire_alone(worker: Any) -> float:
    """In the engine's worker (``collective_rpc``, beside the trainer's send): receive one
    transfer as the engine does, with no load; seconds from the end of the manifest vote to
    the last bucket verified."""
    engine = worker.weight_transfer_engine
    last = [0.0]

    def arrived(names: list[str], tensors: list[torch.Tensor]) -> None:
        last[0] = time.perf_counter()

    start = time.perf_counter()
    stats = engine.transfer.stream(engine._expected, arrived, ahead=engine._receive_ahead)
    return last[0] - (start + stats.manifest_s)


def _engine_wire_s(
    backend: VLLMAsyncBackend, engine: Any, weights: Any, version: int, *, checksums: bool
) -> float:
    """One engine-wire row: the worker's no-load stream beside this process's send."""
    import dataclasses
    import threading

    from rollout_sync.backends.vllm.trainer import in_layer_order
    from rollout_sync.transfer import WeightTransfer

    transfer = engine.transfer
    if not checksums:
        config = dataclasses.replace(transfer.config, checksums=False)
        transfer = WeightTransfer(engine.group, 0, config=config, device=transfer.device)
    got: list[Any] = []

    def receive() -> None:
        call = backend.engine.collective_rpc(_wire_alone)
        got.append(backend.run_on_loop(call, 600, "engine wire"))

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    transfer.send(in_layer_order(weights), version=version)
    thread.join(600)
    return float(got[0][0])


class _Streams:
    """Keeps ``count`` long greedy requests decoding on ``backend``; counts their tokens."""

    def __init__(self, backend: VLLMAsyncBackend, count: int) -> None:
        self.backend = backend
        self.requests = [self._submit(i) for i in range(count)]

    def _submit(self, i: int) -> Any:
        return self.backend.submit([1 + i, 5, 9, 33, 7], greedy_params(1500))

    def refill(self) -> None:
        """Replace finished requests (call between rounds, never while counting)."""
        self.requests = [self._submit(i) if r.done else r for i, r in enumerate(self.requests)]

    def tokens(self) -> int:
        return sum(len(r.tokens()) for r in self.requests)

    def decode_step_s(self, tokens: int = 24) -> float:
        """The interval between two tokens of the first stream, over ``tokens`` tokens."""
        first = self.requests[0]
        have = len(first.wait_for_tokens(len(first.tokens()) + 1, timeout=60))
        start = time.perf_counter()
        first.wait_for_tokens(have + tokens, timeout=60)
        return (time.perf_counter() - start) / tokens

    def stop(self) -> None:
        for request in self.requests:
            self.backend.abort(request)


def _staged_push(engine: Any, client: Any, streams: _Streams, weights: Any, version: int) -> dict:
    """One staged update driven step by step (as ``RolloutSyncTrainerEngine.push`` with
    ``staged=True`` does), to count the tokens decoded while the wire ran."""
    from dataclasses import asdict

    from rollout_sync.backends.vllm.engine import RolloutSyncUpdateInfo
    from rollout_sync.backends.vllm.trainer import in_layer_order

    info = engine.init_info
    update = asdict(
        RolloutSyncUpdateInfo(group=f"{info.master_address}:{info.master_port}", staged=True)
    )
    start = time.perf_counter()
    client.start_weight_update()
    client.update_weights(update)  # returns once the worker's receive thread runs
    before = streams.tokens()
    engine.transfer.send(in_layer_order(weights), version=version)
    during = streams.tokens() - before
    client.finish_weight_update(str(version))  # the install, parked
    total = time.perf_counter() - start
    report = client.reports[-1]
    return {"update_s": total, "stall_s": report.stall_s, "tokens_during_wire": during}


def _bench_model(
    model_dir: Path, iterations: int, settings: dict[str, Any], streams: int = 4
) -> dict[str, Any]:
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from rollout_sync.backends.vllm.client import GuardedWeightSyncClient
    from rollout_sync.backends.vllm.trainer import MappingSource, RolloutSyncTrainerInitInfo

    backend = VLLMAsyncBackend(
        VLLMEngineConfig(
            model_dir,
            dtype="float32",
            kv_cache_memory_bytes=64 << 20,
            weight_transfer_config={"backend": "rollout_sync"},
        ),
        rpc_timeout=600.0,
        # The older write, for its row: the native path would take the engine's one transfer
        # slot away from the trainer engine below.
        write_path="rpc",
    )
    with backend:
        shapes = {s.name: s.shape for s in backend.weight_specs()}
        current: dict[str, torch.Tensor] = {}
        plain = backend.weight_sync_client(timeout_s=600.0)
        guarded = GuardedWeightSyncClient(plain, rollout=backend, timeout=600.0)
        engine = WeightTransferTrainerFactory.trainer_init(
            RolloutSyncTrainerInitInfo.on_this_host(timeout_s=600.0, **settings),
            client=guarded,
            source=MappingSource(current),
        )
        weights = [random_llama_weights(shapes, seed=s) for s in (1, 2)]
        nbytes = sum(t.numel() * t.element_size() for t in weights[0].values())
        rows: dict[str, list[float]] = {
            "guarded native": [],
            "unguarded native": [],
            "rpc": [],
            "engine wire": [],
            "engine wire, no checksums": [],
        }
        overheads: list[float] = []
        for i in range(iterations + 1):
            current.clear()
            current.update(weights[i % 2])
            pair = {}
            for name, client in (("guarded native", guarded), ("unguarded native", plain)):
                engine.client = client
                start = time.perf_counter()
                engine.send_weights()
                pair[name] = time.perf_counter() - start
            start = time.perf_counter()
            with backend.paused():
                backend.load_weights(weights[i % 2])
                backend.commit_weight_version(backend.weight_version + 1)
            pair["rpc"] = time.perf_counter() - start
            for name, checksums in (("engine wire", True), ("engine wire, no checksums", False)):
                version = 10_000 + 2 * i + checksums
                pair[name] = _engine_wire_s(
                    backend, engine, weights[i % 2], version, checksums=checksums
                )
            if i:  # the first round warms up
                for name, seconds in pair.items():
                    rows[name].append(seconds)
                overheads.append(pair["guarded native"] / pair["unguarded native"] - 1.0)
        state = backend.native_transfer_state()
        staged = _bench_staged(backend, engine, plain, weights, iterations, streams)
        engine.shutdown()
    raw = _raw_broadcast_s(nbytes, iterations)
    medians = {name: statistics.median(times) for name, times in rows.items()}
    medians["raw broadcast"] = statistics.median(raw)
    medians["staged"] = staged["staged_update_ms"] / 1e3
    medians["load alone"] = staged["load_alone_ms"] / 1e3
    return {
        **staged,
        "settings": settings,
        "engine_wire_ms": medians["engine wire"] * 1e3,
        "engine_wire_over_raw": medians["engine wire"] / medians["raw broadcast"],
        "engine_wire_unchecked_over_raw": medians["engine wire, no checksums"]
        / medians["raw broadcast"],
        "update_over_max_wire_load": medians["guarded native"]
        / max(medians["raw broadcast"], medians["load alone"]),
        "update_over_wire_plus_load": medians["guarded native"]
        / (medians["raw broadcast"] + medians["load alone"]),
        "model_mb": nbytes / 1e6,
        "median_s": medians,
        "mb_per_s": {name: nbytes / 1e6 / s for name, s in medians.items()},
        "native_over_raw": medians["raw broadcast"] / medians["guarded native"],
        "rpc_over_raw": medians["raw broadcast"] / medians["rpc"],
        "bracket_overhead": statistics.median(overheads),
        "engine_s": {
            "transfer": state["last_transfer_s"],
            "of which vllm load": state["last_load_s"],
            "finalize": state["last_finalize_s"],
            "read-back": state["last_verify_s"],
        },
    }


def _bench_staged(
    backend: VLLMAsyncBackend,
    engine: Any,
    plain: Any,
    weights: list[dict[str, torch.Tensor]],
    iterations: int,
    streams: int,
) -> dict[str, Any]:
    """The staged rows: staged updates while ``streams`` requests decode, alternating with
    vLLM's load alone of the served version's tensors (no wire), both on this engine."""
    from rollout_sync.backends.vllm.client import GuardedWeightSyncClient

    client = GuardedWeightSyncClient(plain, rollout=backend, timeout=600.0, staged=True)
    engine.client = client
    decoding = _Streams(backend, streams)
    rounds: list[dict[str, Any]] = []
    load_alone: list[float] = []
    steps: list[float] = []
    try:
        for i in range(iterations + 1):
            decoding.refill()
            steps.append(decoding.decode_step_s())
            version = engine.version + 1 + i
            seed = 1 + i % 2
            pushed = _staged_push(engine, client, decoding, weights[i % 2], version)
            # vLLM's load alone of the tensors just installed (the served version stays).
            with backend.paused():
                times = backend.run_on_loop(
                    backend.engine.collective_rpc(_load_alone, args=(seed, 1)),
                    600,
                    "load alone",
                )
            if i:  # the first round warms up
                rounds.append(pushed)
                load_alone.extend(times[0])
    finally:
        decoding.stop()
    update = statistics.median(r["update_s"] for r in rounds)
    stall = statistics.median(r["stall_s"] for r in rounds)
    state = backend.native_transfer_state() or {}
    return {
        "staged_update_ms": update * 1e3,
        "staged_stall_ms": stall * 1e3,
        "stall_over_update": statistics.median(r["stall_s"] / r["update_s"] for r in rounds),
        "load_alone_ms": statistics.median(load_alone) * 1e3,
        "decode_step_ms": statistics.median(steps) * 1e3,
        "tokens_during_wire": statistics.median(r["tokens_during_wire"] for r in rounds),
        "staged_rounds": rounds,
        "staged_engine_s": {
            "install": state.get("last_install_s"),
            "of which vllm load": state.get("last_load_s"),
            "finalize": state.get("last_finalize_s"),
            "read-back": state.get("last_verify_s"),
        },
    }


def _worker_bytes(worker: Any) -> tuple[int, int]:
    """In a worker (``collective_rpc``): the bytes its engine received in the last update, and
    the bytes of its shards of them (its read-back plan's boxes)."""
    engine = worker.weight_transfer_engine
    shard = 0
    for name, probes in engine._plan.probes.items():
        spec = engine._expected[name]
        part = probes[0].local_part(torch.empty(spec.shape, dtype=spec.dtype, device="meta"))
        shard += part.numel() * part.element_size()
    return round(engine.state()["last_mb"] * 1e6), shard


def _bench_tp(model_dir: Path, tp: int, iterations: int) -> dict[str, Any]:
    """The native write's time and each worker's bytes, at ``tensor_parallel_size=tp``."""
    from rollout_sync.backends.vllm import VLLMBlockingBackend

    backend = VLLMBlockingBackend(
        VLLMEngineConfig(
            model_dir, dtype="float32", kv_cache_memory_bytes=64 << 20, tensor_parallel_size=tp
        ),
        rpc_timeout=600.0,
    )
    try:
        start = time.perf_counter()
        backend.ensure_initialized()
        startup_s = time.perf_counter() - start
        shapes = {s.name: s.shape for s in backend.weight_specs()}
        weights = [random_llama_weights(shapes, seed=s) for s in (1, 2)]
        times = []
        for i in range(iterations + 1):
            start = time.perf_counter()
            backend.load_weights(weights[i % 2])
            backend.commit_weight_version(backend.weight_version + 1)
            if i:  # the first write also opens the transfer group
                times.append(time.perf_counter() - start)
        state = backend.native_transfer_state() or {}
        workers = backend.llm.collective_rpc(_worker_bytes, timeout=60)
    finally:
        backend.shutdown()
    nbytes = sum(t.numel() * t.element_size() for t in weights[0].values())
    return {
        "tp": tp,
        "model_bytes": nbytes,
        "startup_s": startup_s,
        "push_median_s": statistics.median(times),
        "received_bytes": [received for received, _ in workers],
        "shard_bytes": [shard for _, shard in workers],
        "engine_s": {
            "transfer": state.get("last_transfer_s"),
            "of which vllm load": state.get("last_load_s"),
            "finalize": state.get("last_finalize_s"),
            "read-back": state.get("last_verify_s"),
        },
    }


def main_tp(tp: int, iterations: int, skip_large: bool) -> int:
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="rollout_sync_bench_") as tmp:
        models = {"tiny": {}} if skip_large else {"tiny": {}, "large": LARGE}
        for label, overrides in models.items():
            model_dir = Path(tmp) / label
            build_tiny_llama(model_dir, seed=0, **overrides)
            try:
                results[label] = [_bench_tp(model_dir, n, iterations) for n in (1, tp)]
            except VLLMUnavailableError as exc:
                print(exc, file=sys.stderr)
                return 2
    print(f"{'model':<8}{'tp':>4}{'MB':>8}{'push ms':>10}  per worker: received / shard MB")
    for label, rows in results.items():
        for r in rows:
            per_worker = "  ".join(
                f"{got / 1e6:.2f} / {shard / 1e6:.2f}"
                for got, shard in zip(r["received_bytes"], r["shard_bytes"], strict=True)
            )
            print(
                f"{label:<8}{r['tp']:>4}{r['model_bytes'] / 1e6:>8.2f}"
                f"{r['push_median_s'] * 1e3:>10.1f}  {per_worker}"
            )
    print(json.dumps({"tp": tp, "models": results}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--skip-large", action="store_true", help="the tiny model only")
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=DEFAULT_BUCKET_BYTES / (1 << 20),
        help="the transfer's bucket size (RolloutSyncTrainerInitInfo.bucket_bytes)",
    )
    parser.add_argument(
        "--receive-ahead",
        type=int,
        default=DEFAULT_RECEIVE_AHEAD,
        help="buckets on the wire while vLLM loads (RolloutSyncTrainerInitInfo.receive_ahead)",
    )
    parser.add_argument(
        "--streams", type=int, default=4, help="requests decoding during the staged rows"
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=0,
        help="measure tensor_parallel_size=1 against this size instead (native write path)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.tp > 1:
        return main_tp(args.tp, args.iterations, args.skip_large)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rollout_sync_bench_") as tmp:
        models = {"tiny": {}} if args.skip_large else {"tiny": {}, "large": LARGE}
        for label, overrides in models.items():
            model_dir = Path(tmp) / label
            build_tiny_llama(model_dir, seed=0, **overrides)
            try:
                settings = {
                    "bucket_bytes": int(args.bucket_mb * (1 << 20)),
                    "receive_ahead": args.receive_ahead,
                }
                results[label] = _bench_model(model_dir, args.iterations, settings, args.streams)
            except VLLMUnavailableError as exc:
                print(exc, file=sys.stderr)
                return 2
    print(f"{'model':<8}{'MB':>8}  " + "".join(f"{n:>18}" for n in results["tiny"]["median_s"]))
    for label, r in results.items():
        cells = "".join(f"{s * 1e3:>15.1f} ms" for s in r["median_s"].values())
        print(f"{label:<8}{r['model_mb']:>8.1f}  {cells}")
    print()
    for label, r in results.items():
        print(
            f"{label}: native/raw {r['native_over_raw']:.3f}  rpc/raw {r['rpc_over_raw']:.3f}  "
            f"bracket overhead {r['bracket_overhead'] * 100:+.1f}%  "
            f"\n  engine wire {r['engine_wire_ms']:.1f} ms = {r['engine_wire_over_raw']:.2f} x raw "
            f"({r['engine_wire_unchecked_over_raw']:.2f} x without checksums); update / "
            f"max(raw, load alone) {r['update_over_max_wire_load']:.2f}, / (raw + load alone) "
            f"{r['update_over_wire_plus_load']:.2f}"
            "\n  in the engine, last update: "
            + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["engine_s"].items())
            + f"\n  staged: update {r['staged_update_ms']:.1f} ms, stall (parked) "
            f"{r['staged_stall_ms']:.1f} ms = {r['stall_over_update']:.2f} of the update; load "
            f"alone {r['load_alone_ms']:.1f} ms; decode step {r['decode_step_ms']:.2f} ms; "
            f"{r['tokens_during_wire']:.0f} tokens decoded during the wire"
            "\n  staged install in the engine, last: "
            + ", ".join(f"{k} {(v or 0.0) * 1e3:.1f} ms" for k, v in r["staged_engine_s"].items())
        )
    main_row = results.get("large", results["tiny"])
    print(
        json.dumps(
            {
                "native_over_raw": main_row["native_over_raw"],
                "rpc_over_raw": main_row["rpc_over_raw"],
                "bracket_overhead": main_row["bracket_overhead"],
                "stall_over_update": main_row["stall_over_update"],
                "staged_stall_ms": main_row["staged_stall_ms"],
                "staged_update_ms": main_row["staged_update_ms"],
                "load_alone_ms": main_row["load_alone_ms"],
                "decode_step_ms": main_row["decode_step_ms"],
                "tokens_during_wire": main_row["tokens_during_wire"],
                "engine_wire_ms": main_row["engine_wire_ms"],
                "engine_wire_over_raw": main_row["engine_wire_over_raw"],
                "engine_wire_unchecked_over_raw": main_row["engine_wire_unchecked_over_raw"],
                "update_over_max_wire_load": main_row["update_over_max_wire_load"],
                "update_over_wire_plus_load": main_row["update_over_wire_plus_load"],
                "model_mb": main_row["model_mb"],
                "models": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
