"""LoRA adapters as weight sets (rollout_sync.lora) and the worker's adapter commands, on a
small in-process engine: the manifest check, the adapter's own slot and version, always
staged, the whole set required, and the trainer's announcements naming the adapter."""

from __future__ import annotations

import queue
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from test_staged import WireTransfer

from rollout_sync import SyncMode
from rollout_sync.errors import (
    StagedCommitAborted,
    TwoCommunicatorsRefused,
    WeightMismatchError,
    WeightTransferError,
)
from rollout_sync.lora import (
    ALPHA_KEY,
    LoRAConfig,
    SupportsLoRA,
    adapter_specs,
    lora_delta,
    random_adapter,
    require_adapter,
)
from rollout_sync.testing import EventLog, RecordingRollout, run_group, weights_digest
from rollout_sync.trainer import BroadcastCommandChannel, CommandKind, WeightSyncCommand
from rollout_sync.transfer import TransferConfig, WeightTransfer
from rollout_sync.worker import P2R, R2R, RolloutWorker, WorkerCommandChannel

SHAPES = {"layer.0": (4, 6), "layer.1": (6, 4)}
CONFIG = LoRAConfig(rank=2, alpha=4.0, target_modules=("layer.0", "layer.1"))


class LoRAEngine(RecordingRollout):
    """A base weight and adapter slots, each with a version; its pause is logged."""

    def __init__(self) -> None:
        super().__init__(EventLog(), {"w": torch.zeros(3)})
        self.adapters: dict[str, tuple[LoRAConfig, dict[str, torch.Tensor]]] = {}
        self.versions: dict[str, int] = {}

    def adapter_names(self) -> Sequence[str]:
        return list(self.adapters)

    def add_adapter(self, name: str, config: LoRAConfig) -> None:
        specs = adapter_specs(config, SHAPES)
        self.adapters[name] = (
            config,
            {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in specs.items()},
        )
        self.versions[name] = 0

    def adapter_config(self, name: str) -> LoRAConfig:
        return self.adapters[name][0]

    def served_adapter(self, name: str) -> Mapping[str, torch.Tensor]:
        return self.adapters[name][1]

    def load_adapter(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        config, slot = self.adapters[name]
        config.check(tensors, SHAPES)
        for n, t in tensors.items():
            slot[n].copy_(t)
        self.log.add(f"load {name}")

    def adapter_version(self, name: str) -> int:
        return self.versions[name]

    def check_adapter_servable(self, name: str) -> None:
        self.adapters[name]  # noqa: B018 - KeyError for an unknown name; never torn here

    def commit_adapter_version(self, name: str, version: int) -> None:
        self.versions[name] = version


def _adapter(seed: int, config: LoRAConfig = CONFIG) -> dict[str, torch.Tensor]:
    return random_adapter(config, SHAPES, seed)


def _sync(worker: RolloutWorker, transfer: WireTransfer, adapter: str) -> Any:
    worker.p2r = transfer
    result = worker.handle(P2R(step=transfer.version, adapter=adapter))
    if not result.ok:
        raise result.exception  # type: ignore[misc]
    return result


def test_an_adapter_set_names_every_target_and_its_alpha_and_refuses_a_wrong_one() -> None:
    specs = adapter_specs(CONFIG, SHAPES)
    assert list(specs) == [
        "layer.0.lora_A",
        "layer.0.lora_B",
        "layer.1.lora_A",
        "layer.1.lora_B",
        ALPHA_KEY,
    ]
    assert specs["layer.0.lora_A"].shape == (2, 4) and specs["layer.0.lora_B"].shape == (6, 2)
    weights = _adapter(1)
    CONFIG.check(weights, SHAPES)
    assert float(weights[ALPHA_KEY]) == 4.0 and CONFIG.scaling == 2.0
    wrong_rank = _adapter(1, LoRAConfig(4, 4.0, CONFIG.target_modules))
    missing = {n: t for n, t in weights.items() if not n.startswith("layer.1")}
    for bad, problem in ((wrong_rank, "shape"), (missing, "missing")):
        with pytest.raises(WeightMismatchError, match=problem):
            CONFIG.check(bad, SHAPES)
    other_alpha = {**weights, ALPHA_KEY: torch.tensor(float("nan"))}
    with pytest.raises(WeightMismatchError, match="manifest's alpha"):
        CONFIG.check(other_alpha, SHAPES)
    with pytest.raises(ValueError, match="not linear layers"):
        adapter_specs(LoRAConfig(2, 4.0, ("layer.9",)), SHAPES)
    with pytest.raises(ValueError, match="rank"):
        LoRAConfig(0, 1.0, ("layer.0",))
    x = torch.randn(5, 4)
    a, b = weights["layer.0.lora_A"], weights["layer.0.lora_B"]
    assert torch.allclose(lora_delta(x, a, b, weights[ALPHA_KEY], 2), (x @ a.T @ b.T) * 2.0)


@pytest.mark.timeout(30)
def test_an_adapter_sync_lands_in_its_slot_staged_and_leaves_the_weights_alone() -> None:
    engine = LoRAEngine()
    engine.add_adapter("policy", CONFIG)
    assert isinstance(engine, SupportsLoRA) and require_adapter(engine, "policy") is engine
    worker = RolloutWorker(engine)  # SYNC mode: an adapter is staged all the same
    seen: list[tuple[int, dict[str, torch.Tensor]]] = []
    worker.on_transfer = lambda stats, tensors: seen.append((stats.version, dict(tensors)))
    wire = WireTransfer(7, _adapter(1))
    result = _sync(worker, wire, "policy")
    slot = engine.served_adapter("policy")
    assert wire.targets[0] is worker.adapter_staging("policy").tensors  # type: ignore[union-attr]
    assert all(torch.equal(slot[n], t) for n, t in _adapter(1).items())
    assert engine.adapter_version("policy") == 7 and engine.weight_version == 0
    assert result.committed_at is not None and result.weight_version == 0
    assert engine.log.events.count("load policy") == 1
    assert "pause:enter" in engine.log.events, "the install ran parked"
    assert seen[0][0] == 7 and weights_digest(seen[0][1]) == weights_digest(_adapter(1))
    assert worker.statistics().staging_bytes == sum(
        t.numel() * t.element_size() for t in _adapter(1).values()
    )


@pytest.mark.timeout(30)
def test_a_wrong_rank_or_a_missing_module_is_refused_whole_with_the_adapter_unchanged() -> None:
    engine = LoRAEngine()
    engine.add_adapter("policy", CONFIG)
    worker = RolloutWorker(engine, mode=SyncMode.STAGED)
    _sync(worker, WireTransfer(1, _adapter(1)), "policy")
    before = {n: t.clone() for n, t in engine.served_adapter("policy").items()}
    wrong_rank = _adapter(2, LoRAConfig(4, 4.0, CONFIG.target_modules))
    missing = {n: t for n, t in _adapter(2).items() if not n.startswith("layer.1")}
    for bad in (wrong_rank, missing):
        with pytest.raises(StagedCommitAborted, match="adapter 'policy'") as caught:
            _sync(worker, WireTransfer(2, bad), "policy")
        assert isinstance(caught.value.__cause__, WeightMismatchError)
        assert caught.value.kept_version == 1
        assert engine.adapter_version("policy") == 1
        slot = engine.served_adapter("policy")
        assert all(torch.equal(slot[n], t) for n, t in before.items())
    with pytest.raises(KeyError, match="add it first"):
        _sync(worker, WireTransfer(3, _adapter(3)), "other")
    with pytest.raises(TypeError, match="serves no LoRA"):
        require_adapter(RecordingRollout(EventLog()), "policy")


def test_the_trainer_announces_an_adapter_and_the_channel_makes_adapter_commands() -> None:
    queues: dict[int, Any] = {1: queue.Queue(), 2: queue.Queue()}
    channel = WorkerCommandChannel(queues)
    announcement = WeightSyncCommand(CommandKind.WEIGHTS, 3, 3, adapter="policy")
    assert channel.commands_for(announcement) == [
        (1, P2R(step=3, adapter="policy")),
        (1, R2R(step=3, adapter="policy")),
        (2, R2R(step=3, adapter="policy")),
    ]
    relay = WorkerCommandChannel(queues, pipelined_relay=True)
    assert relay.commands_for(announcement)[0] == (1, P2R(step=3, relay=True, adapter="policy"))
    with pytest.raises(ValueError, match="WorkerCommandChannel"):
        BroadcastCommandChannel().announce(announcement, 1.0)


def test_an_adapter_sync_keeps_the_nccl_rule_even_on_a_sync_mode_worker() -> None:
    """An adapter is staged in every mode, so its receive runs beside the forwards: over NCCL
    beside NCCL forwards it is refused, however the worker syncs the model."""

    class NcclForwards(LoRAEngine):
        def forward_collectives(self) -> frozenset[str]:
            return frozenset({"nccl"})

    engine = NcclForwards()
    engine.add_adapter("policy", CONFIG)
    nccl = WireTransfer(1, _adapter(1))
    nccl.backend = "nccl"  # type: ignore[misc]
    worker = RolloutWorker(engine, p2r=nccl)  # SYNC: the model's receive runs parked
    with pytest.raises(TwoCommunicatorsRefused, match="gloo"):
        _sync(worker, nccl, "policy")
    assert engine.adapter_version("policy") == 0


def _alpha_child(rank: int) -> dict[str, Any]:
    """Rank 0 trains (a real WeightTransfer over gloo), rank 1 serves adapter 'policy'."""
    transfer = WeightTransfer(None, 0, config=TransferConfig(timeout_s=20))
    other_alpha = {**_adapter(2), ALPHA_KEY: torch.tensor(32.0)}
    if rank == 0:
        transfer.send(_adapter(1), version=1)
        refused: BaseException | None = None
        try:
            transfer.send(other_alpha, version=2)
        except WeightTransferError as exc:
            refused = exc
        transfer.send(_adapter(3), version=3)  # the group is still usable
        return {"refused": refused}
    engine = LoRAEngine()
    engine.add_adapter("policy", CONFIG)
    worker = RolloutWorker(engine, p2r=transfer, weight_sync_timeout=20)
    try:
        assert worker.handle(P2R(step=1, adapter="policy")).ok
        aborted = worker.handle(P2R(step=2, adapter="policy")).exception
        kept = engine.adapter_version("policy")
        assert worker.handle(P2R(step=3, adapter="policy")).ok
        cause = aborted.__cause__ if aborted is not None else None  # not pickled: read here
        return {
            "aborted": aborted,
            "cause": (type(cause).__name__, str(cause)),
            "kept": kept,
            "final": engine.adapter_version("policy"),
        }
    finally:
        worker.close(10)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_set_with_another_alpha_is_voted_down_so_the_trainer_never_sees_success() -> None:
    results = run_group(_alpha_child, 2, timeout_s=60, group_timeout_s=20)
    # The replica checks lora_alpha (data, not shape) on the staged set before its commit
    # vote: the trainer's send fails instead of reporting a version no replica serves.
    refused = results[0]["refused"]
    assert isinstance(refused, WeightTransferError), refused
    assert "lora_alpha" in str(refused)
    aborted = results[1]["aborted"]
    assert isinstance(aborted, StagedCommitAborted), aborted
    assert "the version of step 2 of adapter 'policy'" in str(aborted), aborted
    assert "None" not in str(aborted) and "lora_alpha: 32.0" in str(aborted)
    cause_type, cause = results[1]["cause"]
    assert cause_type == WeightMismatchError.__name__
    assert "32.0 is not the manifest's alpha 4.0" in cause
    assert "not training-only" not in cause and "same LoRAConfig" in cause, cause
    assert results[1]["kept"] == 1 and results[1]["final"] == 3
