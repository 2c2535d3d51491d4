"""The public surface: every name in __all__ is importable, and this issue's names are there."""

from __future__ import annotations

import rollout_sync


def test_all_names_resolve_and_every_reexport_is_listed() -> None:
    assert all(hasattr(rollout_sync, name) for name in rollout_sync.__all__)
    reexported = {name for name, value in vars(rollout_sync).items()
                  if not name.startswith("_") and getattr(value, "__module__", "").startswith(
                      "rollout_sync.")}
    assert reexported <= set(rollout_sync.__all__)


def test_distributed_weight_sync_names_are_public() -> None:
    for name in ("WeightTransfer", "TransferConfig", "WeightManifest", "WeightTransferError",
                 "ManifestRejected", "ChecksumMismatchError", "RolloutWorker", "P2R", "R2R",
                 "Stop", "build_sync_groups", "WeightBuffer", "WeightSyncThread",
                 "install_inference_sync", "run_processes", "init_process_group",
                 "find_free_port", "wait_work"):
        assert name in rollout_sync.__all__, name
