"""The ``"rollout_sync"`` engine in a ``vllm serve`` process, updated over vLLM's HTTP client.

A real OpenAI-compatible vLLM server (``vllm.entrypoints.openai.api_server``, vLLM for CPU)
started with ``--weight-transfer-config '{"backend": "rollout_sync"}'`` and
``VLLM_SERVER_DEV_MODE=1``: the engine comes from this package's ``vllm.general_plugins``
entry point, in the server's own processes. The trainer drives it with vLLM's
``HTTPVLLMWeightSyncClient`` wrapped in ``GuardedWeightSyncClient``, which pauses through the
server's ``/pause`` and ``/resume`` routes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import NO_FORWARD_DURING  # noqa: F401 - first: sets vLLM's environment

pytest.importorskip("vllm")
pytest.importorskip("requests")

import requests
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from rollout_sync.backends.vllm.client import (
    GuardedWeightSyncClient,
    HTTPEngineState,
    HTTPGenerationPauser,
)
from rollout_sync.backends.vllm.trainer import MappingSource, RolloutSyncTrainerInitInfo
from rollout_sync.backends.vllm.worker import WORKER_EXTENSION
from rollout_sync.errors import ManifestRejected
from rollout_sync.testing import (
    build_tiny_llama,
    find_free_port,
    greedy_reference,
    random_llama_weights,
)
from rollout_sync.testing.processes import ServerOutput, stop_process

pytestmark = pytest.mark.vllm

STARTUP_S = 180.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    model_dir = tmp_path_factory.mktemp("tiny_llama_served")
    initial = build_tiny_llama(model_dir, seed=41)
    port = find_free_port()
    log = model_dir / "server.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--dtype",
            "float32",
            "--skip-tokenizer-init",
            "--enforce-eager",
            "--max-model-len",
            "512",
            "--kv-cache-memory-bytes",
            str(64 << 20),
            "--port",
            str(port),
            "--weight-transfer-config",
            '{"backend": "rollout_sync"}',
            # Reports the engine's state (/collective_rpc): a refused update resumes.
            "--worker-extension-cls",
            WORKER_EXTENSION,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    output = ServerOutput(process, "Application startup complete", log)  # uvicorn's line
    try:
        output.wait_ready(STARTUP_S, "vllm serve")
        assert requests.get(f"{base}/health", timeout=10).ok
        yield {"base": base, "model": str(model_dir), "initial": initial}
    finally:
        stop_process(process, 30)


def _complete(base: str, model: str, prompt: list[int], n: int) -> list[int]:
    response = requests.post(
        f"{base}/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "return_token_ids": True,
        },
        timeout=60,
    )
    response.raise_for_status()
    tokens: list[int] = response.json()["choices"][0]["token_ids"]
    return tokens


@pytest.mark.timeout(400)
def test_a_served_engine_takes_guarded_native_updates_over_http(server: dict[str, Any]) -> None:
    base, model = server["base"], server["model"]
    shapes = {n: tuple(t.shape) for n, t in server["initial"].items()}
    current: dict[str, Any] = {}
    client = GuardedWeightSyncClient(HTTPVLLMWeightSyncClient(base, timeout=120))
    assert isinstance(client.pauser, HTTPGenerationPauser)
    engine = WeightTransferTrainerFactory.trainer_init(
        RolloutSyncTrainerInitInfo.on_this_host(timeout_s=60.0),
        client=client,
        source=MappingSource(current),
    )
    reference = greedy_reference(Path(model))
    try:
        for version in (3, 4):
            current.clear()
            current.update(random_llama_weights(shapes, seed=version))
            engine.send_weights(version)
            assert client.reports[-1].error is None and not client.parked
            assert requests.get(f"{base}/weight_info", timeout=10).json() == {
                "weight_version": str(version)
            }
            assert _complete(base, model, [1, 5, 9], 12) == reference(current, [1, 5, 9], 12)

        # A wrong manifest: refused in the server's worker, nothing loaded. The server's
        # /collective_rpc says so (the worker extension's state), so generation resumes on
        # the version served, which is still served exactly.
        served = dict(current)
        name = "model.layers.0.mlp.up_proj.weight"
        current[name] = current[name][:-1].contiguous()
        with pytest.raises(ManifestRejected):
            engine.send_weights(5)
        assert client.torn is None and not client.parked, client.torn
        assert client.reports[-1].error is not None
        state = HTTPEngineState(base).native_transfer_state()
        assert state is not None and state["torn"] is None and state["updates"] == 2
        assert _complete(base, model, [2, 9, 4], 12) == reference(served, [2, 9, 4], 12)
        assert requests.get(f"{base}/weight_info", timeout=10).json() == {"weight_version": "4"}
        # The next complete update lands.
        current.clear()
        current.update(random_llama_weights(shapes, seed=6))
        engine.send_weights(6)
        assert client.torn is None and not client.parked
        assert _complete(base, model, [7, 7, 7], 12) == reference(current, [7, 7, 7], 12)
        metrics = engine.metrics()
        assert metrics is not None and metrics["weight_sync_time_ms"] > 0
    finally:
        engine.shutdown()
