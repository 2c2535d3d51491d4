"""In-process pieces that tests and demos build runs from: a minimal guarded worker, a digest.

* :class:`InProcessWorker` - a rollout worker reduced to one P2R handler, guarded by
  :func:`~rollout_sync.weight_sync_handler`, with an unguarded twin that reports alike.
* :func:`weights_digest` - equal for two sets of weights exactly when they are bit-identical.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from ..backend import RolloutBase
from ..guard import SyncReport, weight_sync_bracket, weight_sync_handler
from ..trace import Timeline

__all__ = ["InProcessWorker", "weights_digest"]


class InProcessWorker:
    """A rollout worker reduced to one P2R handler, for the in-process demos and tests.

    The guard finds ``rollout`` and ``data_packer``. :meth:`receive_weights` is the guarded
    handler; :meth:`receive_weights_unguarded` does the same write without pause or hold, and
    is reported alike, so a run can compare the two. Subclasses change how a version is
    written by overriding :meth:`write_weights`.
    """

    def __init__(
        self,
        rollout: RolloutBase,
        packer: object | None,
        timeline: Timeline | None,
        timeout_s: float,
    ) -> None:
        self.rollout = rollout
        self.data_packer = packer
        self.timeline = timeline
        self.weight_sync_timeout = timeout_s
        self.reports: list[SyncReport] = []

    def on_weight_sync_report(self, report: SyncReport) -> None:
        self.reports.append(report)

    def write_weights(self, version: int, weights: Mapping[str, torch.Tensor] | None) -> None:
        """Write ``weights`` (all of them, validated first) and commit ``version``."""
        if weights is None:
            raise ValueError(f"{type(self).__name__} needs the weights of version {version}")
        self.rollout.ensure_initialized()
        self.rollout.load_weights(weights)
        self.rollout.commit_weight_version(version)

    @weight_sync_handler
    def receive_weights(
        self, version: int, weights: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        self.write_weights(version, weights)

    def receive_weights_unguarded(
        self, version: int, weights: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        with weight_sync_bracket(
            None, name="receive_weights", pause=False, hold=False, timeline=self.timeline
        ) as bracket:
            self.write_weights(version, weights)
        assert bracket.report is not None
        self.on_weight_sync_report(bracket.report)


def weights_digest(weights: Mapping[str, torch.Tensor]) -> str:
    """A digest of names, dtypes, shapes and exact bytes: equal iff bit-identical (in any
    order of names)."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(weights.items()):
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}|".encode())
        digest.update(
            tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes()
        )
    return digest.hexdigest()
