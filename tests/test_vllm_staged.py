"""Staged native updates on vLLM (vLLM for CPU): the wire runs while the engine decodes, and
only the install is parked.

One engine for the module (``AsyncLLM`` behind a ``VLLMAsyncBackend``, the tiny random Llama in
float32), updated by the ``"rollout_sync"`` trainer engine with ``staged=True`` through a
``GuardedWeightSyncClient(staged=True)``. Greedy float32 decoding makes every claim exact:
tokens are compared with a plain transformers forward of the same weights.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict
from typing import Any

import pytest
import torch
from vllm_helpers import (  # first: it sets the environment vLLM reads
    TrainerWeights,
    corrupted_in_transit,
    native_backend,
)

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from rollout_sync import SyncMode
from rollout_sync.backends.vllm import VLLMAsyncBackend, greedy_params
from rollout_sync.backends.vllm.client import GuardedWeightSyncClient
from rollout_sync.backends.vllm.engine import RolloutSyncUpdateInfo
from rollout_sync.backends.vllm.trainer import (
    MappingSource,
    RolloutSyncTrainerEngine,
    RolloutSyncTrainerInitInfo,
)
from rollout_sync.errors import ChecksumMismatchError
from rollout_sync.testing import build_tiny_llama, find_sync_split, greedy_reference

pytestmark = pytest.mark.vllm

PROMPT = [1, 5, 9, 33, 7]


class Staged(TrainerWeights):
    """The module's engine, the staged guard, the staged trainer engine and its weights."""

    def __init__(
        self,
        backend: VLLMAsyncBackend,
        client: GuardedWeightSyncClient,
        engine: RolloutSyncTrainerEngine,
        reference: Any,
        initial: Mapping[str, torch.Tensor],
    ) -> None:
        super().__init__(initial, seed=700)
        self.backend, self.client, self.engine, self.reference = backend, client, engine, reference

    def greedy(self, version: int, prompt: list[int], n: int) -> list[int]:
        return list(self.reference(self.weights_of(version), prompt, n))

    def served_label(self) -> str:
        label: str = self.backend.run_on_loop(
            self.backend.engine.get_weight_version(), 30, "get_weight_version"
        )
        return label

    def state(self) -> dict[str, Any]:
        state = self.backend.native_transfer_state()
        assert state is not None
        return state


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Staged]:
    model_dir = tmp_path_factory.mktemp("tiny_llama_staged")
    initial = build_tiny_llama(model_dir, seed=23)
    backend = native_backend(model_dir, "rollout_sync")
    client = GuardedWeightSyncClient(backend.weight_sync_client(), rollout=backend, staged=True)
    # 64 KiB buckets: layers span several buckets, as they do in a real model.
    info = RolloutSyncTrainerInitInfo.on_this_host(
        bucket_bytes=64 << 10, timeout_s=30.0, staged=True
    )
    current: dict[str, torch.Tensor] = {}
    engine = RolloutSyncTrainerEngine.trainer_init(
        info, client=client, source=MappingSource(current)
    )
    world = Staged(backend, client, engine, greedy_reference(model_dir), initial)
    world.current = current
    try:
        world.send(engine, 1)
        yield world
    finally:
        engine.shutdown()
        backend.shutdown()


@pytest.mark.timeout(120)
def test_a_staged_update_decodes_through_the_wire_then_continues_exactly_on_the_new_weights(
    staged: Staged,
) -> None:
    """Old weights' greedy tokens up to the install, exactly the new weights' after; the
    engine produced tokens while the receive was open in the worker."""
    old, new = staged.engine.version, staged.engine.version + 1
    request = staged.backend.submit(PROMPT, greedy_params(200))
    request.wait_for_tokens(8, timeout=60)
    info = staged.engine.init_info
    update = asdict(
        RolloutSyncUpdateInfo(group=f"{info.master_address}:{info.master_port}", staged=True)
    )
    staged.client.start_weight_update()
    staged.client.update_weights(update)
    # The worker's receive thread now waits in the transfer's first collective: the wire is
    # open. The engine is not parked and keeps decoding (a bounded wait on its output).
    assert not staged.backend.parked and staged.state()["staged"] == "receiving"
    wire_open_at = len(request.tokens())
    request.wait_for_tokens(wire_open_at + 16, timeout=60)
    transfer = staged.engine.transfer
    assert transfer is not None
    transfer.send(staged.weights_of(new), version=new)
    assert staged.state()["staged"] == "staged"  # whole and verified, not installed
    wire_closed_at = len(request.tokens())
    tokens_during_wire = wire_closed_at - wire_open_at
    assert tokens_during_wire >= 16
    staged.client.finish_weight_update(str(new))

    result = request.result(timeout=120)
    assert result.ok and len(result.token_ids) == 200
    tokens = list(result.token_ids)
    split = find_sync_split(
        tokens,
        staged.greedy(old, PROMPT, len(tokens)),
        lambda k: staged.greedy(new, PROMPT + tokens[:k], len(tokens) - k),
        at_least=wire_closed_at,
    )
    # Every token the wire saw came from the old weights; the install split the request.
    assert split is not None and wire_closed_at <= split < len(tokens)
    assert result.weight_versions == ((str(old), 0, split), (str(new), split, len(tokens)))
    assert staged.served_label() == str(new) and staged.backend.weight_version == new
    report = staged.client.reports[-1]
    assert report.error is None and report.mode is SyncMode.STAGED and report.paused
    # Parked for the install alone: the wire (which waited for 16 tokens) was not.
    assert 0 < report.stall_s < report.total_s
    state = staged.state()
    assert state["staged"] is None and state["torn"] is None and state["staged_installs"] >= 2


@pytest.mark.timeout(120)
def test_the_staged_trainer_engine_parks_only_for_the_install(staged: Staged) -> None:
    """``send_weights`` with ``staged=True``: the update lands, versioned, and the report's
    stall (the install) is a part of the whole update."""
    installs = staged.state()["staged_installs"]
    version = staged.send(staged.engine, staged.engine.version + 1)
    report = staged.client.reports[-1]
    assert report.error is None and report.mode is SyncMode.STAGED
    assert 0 < report.stall_s < report.total_s
    assert staged.state()["staged_installs"] == installs + 1
    results = staged.backend.generate([PROMPT, [3, 4, 5]], greedy_params(16), timeout=60)
    assert list(results[0].token_ids) == staged.greedy(version, PROMPT, 16)
    assert list(results[1].token_ids) == staged.greedy(version, [3, 4, 5], 16)
    assert (results[0].admitted_version, results[0].completed_version) == (version, version)


@pytest.mark.timeout(120)
def test_a_failed_staged_transfer_leaves_the_served_weights_and_version_untouched(
    staged: Staged,
) -> None:
    """A bucket damaged in transit fails the staged receive: nothing is installed, nothing is
    torn, generation never stopped, and the engine serves the version it served."""
    served = staged.engine.version
    state = staged.state()
    transfer = staged.engine.transfer
    assert transfer is not None
    request = staged.backend.submit(PROMPT, greedy_params(48))
    with corrupted_in_transit(transfer, bucket=2), pytest.raises(ChecksumMismatchError):
        staged.send(staged.engine, served + 1)
    after = staged.state()
    assert after["torn"] is None and after["updates"] == state["updates"]
    assert after["staged"] is None and after["staged_discarded"] == state["staged_discarded"] + 1
    assert not staged.backend.parked and not staged.backend.weights_torn
    assert staged.client.torn is None
    assert staged.backend.weight_version == served and staged.served_label() == str(served)
    # The request in flight and a new one run on the served weights, token for token.
    result = request.result(timeout=60)
    assert result.ok and list(result.token_ids) == staged.greedy(served, PROMPT, 48)
    again = staged.backend.generate([[3, 4, 5]], greedy_params(16), timeout=60)[0]
    assert list(again.token_ids) == staged.greedy(served, [3, 4, 5], 16)
    report = staged.client.reports[-1]
    assert report.error is not None and report.stall_s == 0.0
    # The next staged update lands whole.
    version = staged.send(staged.engine, served + 2)
    assert staged.state()["torn"] is None and staged.served_label() == str(version)
