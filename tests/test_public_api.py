"""The public surface: one flat namespace, and ``__all__`` says exactly what is in it."""

from __future__ import annotations

import pytest

import rollout_sync

# The names each part of the package promises; a rename shows up here first.
PROMISED = {
    "core": [
        "Gate",
        "RolloutBase",
        "ThreadedRolloutBackend",
        "SupportsHoldSends",
        "SupportsFlushPendingSends",
        "payload_egress_held",
        "weight_sync_handler",
        "pauses_generation",
        "holds_payload_egress",
        "weight_sync_bracket",
        "SyncMode",
        "SyncReport",
        "Timeline",
        "find_overlaps",
        "PauseTimeout",
        "EgressHoldTimeout",
    ],
    "stream generation": [
        "RolloutTaskScheduler",
        "TorchLMBackend",
        "TorchLMStreamBackend",
        "TinyLMConfig",
        "KVCachePolicy",
        "GenerationRequest",
        "GenerationResult",
        "SamplingParams",
        "FinishReason",
        "ParkReport",
        "SchedulerStatistics",
        "SchedulerTimeout",
        "DecodeEngine",
        "tiny_lm_weights",
    ],
    "distributed weight sync": [
        "WeightTransfer",
        "TransferConfig",
        "WeightManifest",
        "WeightTransferError",
        "ManifestRejected",
        "ChecksumMismatchError",
        "RolloutWorker",
        "P2R",
        "R2R",
        "Stop",
        "build_sync_groups",
        "WeightBuffer",
        "WeightSyncThread",
        "install_inference_sync",
        "run_processes",
        "init_process_group",
        "find_free_port",
        "wait_work",
    ],
    "payload transport": [
        "NCCLRolloutMixin",
        "PayloadSender",
        "PayloadReceiver",
        "PayloadGroups",
        "new_payload_groups",
        "PayloadBackpressureTimeout",
        "IngressHoldTimeout",
    ],
    "trainer": [
        "TrainerCallback",
        "TrainerCallbacks",
        "WeightBroadcastCallback",
        "WeightSyncTimer",
        "WeightPusher",
        "TransferWeightPusher",
        "merge_step_metrics",
        "MetricKeyCollisionError",
        "MetricsLogger",
        "log_metrics",
    ],
}


def test_all_matches_the_names_the_package_exports() -> None:
    exported = {
        name
        for name, value in vars(rollout_sync).items()
        if not name.startswith("_") and not isinstance(value, type(rollout_sync))
    }
    assert sorted(rollout_sync.__all__) == sorted(exported)
    assert len(set(rollout_sync.__all__)) == len(rollout_sync.__all__)


@pytest.mark.parametrize("area", sorted(PROMISED))
def test_promised_names_are_public(area: str) -> None:
    missing = [n for n in PROMISED[area] if n not in rollout_sync.__all__]
    assert not missing
    assert all(getattr(rollout_sync, n) is not None for n in PROMISED[area])
