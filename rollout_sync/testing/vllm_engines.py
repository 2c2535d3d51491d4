"""Flawed variants of the ``"rollout_sync"`` vLLM weight-transfer engine, for tests.

Each variant does one of the things vLLM's own engines can do and this package's engine does
not, so a test shows the package's engine *catches* it (the read-back after ``finish``), on
the same harness as the correct engine. They are selected by the ``flaw`` field of the init
info; :data:`FLAWED_ENGINE_NAME` is the name they are registered under by
:mod:`rollout_sync.testing.vllm_worker` (imported by vLLM in each worker when it is the
worker extension).

* ``"reuse_buffer"``: every bucket is loaded from one shared staging buffer, as vLLM's packed
  NCCL consumer does; a layer spanning two buckets is overwritten before the reload processed
  it (silent corruption 3 of ``shared/VLLM_NATIVE.md``).
* ``"no_reload"``: the model's plain ``load_weights`` outside a layerwise reload; on vLLM for
  CPU the repacked ``lm_head`` keeps the old weights (silent corruption 1).
* ``"delta_read_back_error"``: the read-back of a delta's load raises an error of a type
  nobody raises on purpose (a bug): the engine must stay torn, its host copy claiming nothing.
* ``""``: no flaw (the production engine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends.vllm.engine import RolloutSyncInitInfo, RolloutSyncWeightTransferEngine

__all__ = ["FLAWED_ENGINE_NAME", "FLAWS", "FlawedInitInfo", "FlawedWeightTransferEngine"]

FLAWED_ENGINE_NAME = "rollout_sync_flawed"
FLAWS = ("", "reuse_buffer", "no_reload", "delta_read_back_error")


@dataclass
class FlawedInitInfo(RolloutSyncInitInfo):
    flaw: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.flaw not in FLAWS:
            raise ValueError(f"flaw must be one of {FLAWS}, got {self.flaw!r}")


class FlawedWeightTransferEngine(RolloutSyncWeightTransferEngine):
    """The production engine with one step done the way vLLM's built-in engines may do it."""

    init_info_cls = FlawedInitInfo

    flaw = ""
    _shared: torch.Tensor | None = None

    def init_transfer_engine(self, init_info: RolloutSyncInitInfo) -> None:
        self.shutdown()
        self.flaw = getattr(init_info, "flaw", "")
        super().init_transfer_engine(init_info)

    def _start_reload(self) -> None:
        if self.flaw != "no_reload":
            super()._start_reload()

    def _finish_reload(self) -> None:
        if self.flaw != "no_reload":
            super()._finish_reload()

    def _read_back(self) -> list[str]:
        if self.flaw == "delta_read_back_error" and self._delta_load is not None:
            raise RuntimeError("a read-back bug (test)")
        return super()._read_back()

    def _load_into_model(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        if self.flaw != "reuse_buffer":
            super()._load_into_model(names, tensors)
            return
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if self._shared is None or self._shared.numel() < nbytes:
            self._shared = torch.empty(nbytes, dtype=torch.uint8, device=tensors[0].device)
        views, offset = [], 0
        for tensor in tensors:
            size = tensor.numel() * tensor.element_size()
            view = self._shared[offset : offset + size].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            views.append(view)
            offset += size
        super()._load_into_model(names, views)
