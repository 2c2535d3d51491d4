"""A LoRA adapter sync against a full model sync of the same base model, on vLLM (CPU build).

One engine (``VLLMAsyncBackend`` with ``VLLMEngineConfig(lora=...)``) serves a random Llama and
one adapter on every linear layer of it. A trainer process sends, alternating, the full model
and the adapter, each through a :class:`~rollout_sync.WeightTransfer` over a gloo group (the
trainer is rank 0), and this process runs the replica's staged path, as a ``RolloutWorker``
in ``SyncMode.STAGED`` does for ``P2R`` and ``P2R(adapter=...)``: receive into a
:class:`~rollout_sync.staging.StagingArea` while requests decode, then park and install
(``StagingArea.install_into``: the backend's ``load_weights`` / ``load_adapter``, each read
back) and commit. Two requests decode throughout, one on the adapter and one on the base
model; the longest gap between two of a request's tokens that overlaps the adapter's install
(parked to resumed), less the median decode step, is how long it was stalled (the raw gaps
are reported too: ``adapter_gap_ms``, ``base_gap_ms``).

The last line is one JSON object: ``adapter_over_full_sync`` (median adapter sync time over
median full sync time), ``adapter_stall_ms`` / ``base_stall_ms`` (medians),
``adapter_sync_ms``, ``full_sync_ms``, ``adapter_install_ms``, ``full_install_ms`` (parked,
medians), ``rounds``, ``rank`` (the adapter's),
``bit_identical`` (every adapter version read back from vLLM's slot equals the trainer's,
bit for bit), ``adapter_mb``, ``full_mb``, ``decode_step_ms``.

Run: ``python benchmarks/lora.py`` (``--rounds``, ``--rank``, ``--tiny``).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import argparse
import itertools
import json
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rollout_sync import WeightTransfer
from rollout_sync.backends.vllm import (
    VLLMAsyncBackend,
    VLLMEngineConfig,
    VLLMLoRASettings,
    greedy_params,
    vllm_lora_shapes,
)
from rollout_sync.backends.vllm.lora import expected_slot
from rollout_sync.distributed import find_free_port, standalone_group
from rollout_sync.lora import LoRAConfig, random_adapter
from rollout_sync.staging import StagingArea
from rollout_sync.testing.tiny_llama import build_tiny_llama, random_llama_weights
from rollout_sync.transfer.config import TransferConfig

MODEL = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}
"""~24M parameters, ~95 MB in float32 (benchmarks/vllm_native.py's larger model)."""
ADAPTER = "policy"
TIMEOUT = 120.0


def _mb(tensors: Mapping[str, torch.Tensor]) -> float:
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6


def _lora_config(model_dir: Path, rank: int) -> tuple[LoRAConfig, dict[str, tuple[int, int]]]:
    shapes = vllm_lora_shapes(model_dir)
    return LoRAConfig(rank=rank, alpha=2.0 * rank, target_modules=tuple(shapes)), shapes


def _trainer(model_dir: str, port: int, rank: int, rounds: int, shapes: dict[str, Any]) -> None:
    """Rank 0: per round, the full model (version r), then the adapter (version r)."""
    torch.set_num_threads(1)
    config, lora_shapes = _lora_config(Path(model_dir), rank)
    versions = [
        (
            random_llama_weights(shapes, seed=v),
            random_adapter(config, lora_shapes, seed=v, scale=0.05),
        )
        for v in range(1, rounds + 1)
    ]  # drawn before the clock runs on the other side
    group = standalone_group("127.0.0.1", port, 0, 2, timeout_s=TIMEOUT)
    transfer = WeightTransfer(group, 0, config=TransferConfig(bucket_bytes=8 << 20))
    for version, (weights, adapter) in enumerate(versions, start=1):
        transfer.send(weights, version=version)
        transfer.send(adapter, version=version)
    group.shutdown()


class _Stream:
    """Keeps one request decoding (on ``adapter`` or the base model) and records when each
    token arrived."""

    def __init__(self, backend: VLLMAsyncBackend, adapter: str | None) -> None:
        self.backend, self.adapter = backend, adapter
        self.arrivals: list[float] = []
        self._arrived = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            request = self.backend.submit(
                [1, 5, 9, 33, 7], greedy_params(400), adapter=self.adapter
            )
            seen = 0
            while not request.done and not self._stop.is_set():
                try:
                    tokens = request.wait_for_tokens(seen + 1, timeout=TIMEOUT)
                except Exception:  # noqa: BLE001 - the request ended
                    break
                now = time.perf_counter()
                with self._arrived:
                    self.arrivals.extend([now] * (len(tokens) - seen))
                    self._arrived.notify_all()
                seen = len(tokens)
            request.result(TIMEOUT)

    def wait_for_arrival_after(self, when: float, timeout: float) -> None:
        """Block until a token arrived after ``when`` (the gap over it is then closed)."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: self.arrivals[-1] > when, timeout):
                raise TimeoutError(f"no token arrived within {timeout} s after the install")

    def gap_during(self, start: float, end: float) -> float:
        """The longest interval between two tokens that overlaps ``[start, end]`` (the
        install: parked to resumed)."""
        times = self.arrivals
        gaps = [b - a for a, b in itertools.pairwise(times) if b >= start and a <= end]
        return max(gaps, default=0.0)

    def step(self) -> float:
        times = self.arrivals[-200:]
        return statistics.median(b - a for a, b in itertools.pairwise(times))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(TIMEOUT)


def _staged_sync(
    backend: VLLMAsyncBackend, transfer: WeightTransfer, staging: StagingArea, adapter: str | None
) -> dict[str, float]:
    """The replica's staged path: receive beside generation, park, install, commit."""
    start = time.perf_counter()
    served = backend.served_weights() if adapter is None else backend.served_adapter(adapter)
    staging.begin(served)
    stats = transfer.receive(staging.tensors, allow_subset=False)
    staging.staged(stats.version)
    received = time.perf_counter()
    with backend.paused():
        parked = time.perf_counter()
        staging.install_into(backend, adapter=adapter)
        installed = time.perf_counter()
    end = time.perf_counter()
    return {
        "sync_s": end - start,
        "wire_s": received - start,
        "install_s": installed - parked,
        "parked": parked,
        "installed": installed,
        "version": float(stats.version),
    }


def run(model_dir: Path, rounds: int, rank: int) -> dict[str, Any]:
    config, lora_shapes = _lora_config(model_dir, rank)
    backend = VLLMAsyncBackend(
        VLLMEngineConfig(
            model_dir,
            dtype="float32",
            kv_cache_memory_bytes=256 << 20,
            lora=VLLMLoRASettings(max_adapters=2, max_loras=1, max_lora_rank=max(8, rank)),
        ),
        pause_timeout=TIMEOUT,
        rpc_timeout=TIMEOUT,
    )
    backend.add_adapter(ADAPTER, config)
    backend.ensure_initialized()
    shapes = {n: tuple(t.shape) for n, t in backend.served_weights().items()}
    port = find_free_port()
    child = multiprocessing.get_context("spawn").Process(
        target=_trainer, args=(str(model_dir), port, rank, rounds, shapes)
    )
    child.start()
    rows: dict[str, list[dict[str, float]]] = {"full": [], "adapter": []}
    identical = True
    streams: list[_Stream] = []
    try:
        group = standalone_group("127.0.0.1", port, 1, 2, timeout_s=TIMEOUT)
        transfer = WeightTransfer(group, 0, config=TransferConfig(bucket_bytes=8 << 20))
        full_staging = StagingArea.of(backend)
        adapter_staging = StagingArea(backend.served_adapter(ADAPTER))
        streams = [_Stream(backend, ADAPTER), _Stream(backend, None)]
        while min(len(s.arrivals) for s in streams) < 20:
            time.sleep(0.01)  # a benchmark's warm-up, not a synchronization
        for _ in range(rounds):
            rows["full"].append(_staged_sync(backend, transfer, full_staging, None))
            row = _staged_sync(backend, transfer, adapter_staging, ADAPTER)
            for stream in streams:
                stream.wait_for_arrival_after(row["installed"], TIMEOUT)
            for stream, key in zip(streams, ("adapter_gap_s", "base_gap_s"), strict=True):
                row[key] = stream.gap_during(row["parked"], row["installed"])
            rows["adapter"].append(row)
            version = int(row["version"])
            want = expected_slot(
                config, random_adapter(config, lora_shapes, seed=version, scale=0.05)
            )
            slot = backend.read_adapter_slot(ADAPTER)
            identical &= all(torch.equal(slot[k], want[k]) for k in want)
        step = statistics.median(s.step() for s in streams)
        group.shutdown()
    finally:
        for stream in streams:
            stream.stop()
        child.join(TIMEOUT)
        backend.shutdown()

    def median(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[kind])

    adapter_tensors = random_adapter(config, lora_shapes, seed=0)
    full_mb = _mb(backend.served_weights())
    return {
        "adapter_over_full_sync": median("adapter", "sync_s") / median("full", "sync_s"),
        "adapter_stall_ms": (median("adapter", "adapter_gap_s") - step) * 1e3,
        "base_stall_ms": (median("adapter", "base_gap_s") - step) * 1e3,
        "adapter_gap_ms": median("adapter", "adapter_gap_s") * 1e3,
        "base_gap_ms": median("adapter", "base_gap_s") * 1e3,
        "adapter_sync_ms": median("adapter", "sync_s") * 1e3,
        "full_sync_ms": median("full", "sync_s") * 1e3,
        "adapter_install_ms": median("adapter", "install_s") * 1e3,
        "full_install_ms": median("full", "install_s") * 1e3,
        "bit_identical": identical,
        "adapter_mb": _mb(adapter_tensors),
        "full_mb": full_mb,
        "decode_step_ms": step * 1e3,
        "rounds": rounds,
        "rank": rank,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16, help="the adapter's rank")
    parser.add_argument("--tiny", action="store_true", help="the tiny Llama instead")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="rollout_sync_lora_") as tmp:
        model_dir = Path(tmp) / "model"
        build_tiny_llama(model_dir, seed=0, **({} if args.tiny else MODEL))
        result = run(model_dir, args.rounds, args.rank)
    print(
        f"adapter {result['adapter_mb']:.2f} MB: sync {result['adapter_sync_ms']:.1f} ms "
        f"(parked {result['adapter_install_ms']:.1f} ms); full {result['full_mb']:.1f} MB: sync "
        f"{result['full_sync_ms']:.1f} ms (parked {result['full_install_ms']:.1f} ms); stall of "
        f"requests on the adapter {result['adapter_stall_ms']:.1f} ms, on the base model "
        f"{result['base_stall_ms']:.1f} ms (decode step {result['decode_step_ms']:.1f} ms); "
        f"bit-identical: {result['bit_identical']}"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
