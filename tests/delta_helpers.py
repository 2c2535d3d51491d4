"""Shared pieces of the delta tests: an apply that fails part-way (and a restore that fails)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rollout_sync.transfer import delta, delta_sync


def break_apply(
    monkeypatch: pytest.MonkeyPatch, *, restore_too: bool = False, after_write: bool = False
) -> list[int]:
    """Make ``ReceivedDelta.apply`` fail at its second tensor (``RuntimeError("the device went
    away")``) after writing the first, and with ``restore_too`` every restore fail as well
    (``RuntimeError("and stayed away")``). ``after_write``: the second tensor's write fails
    once it has written (a write that fails part-way), not before. Returns the list each write
    attempt appends to."""
    real, calls = delta_sync.apply_changes, []

    def failing(
        tensor: torch.Tensor, positions: torch.Tensor, bits: torch.Tensor, **kwargs: Any
    ) -> Any:
        calls.append(1)
        if len(calls) == 2 and not after_write:
            raise RuntimeError("the device went away")
        out = real(tensor, positions, bits, **kwargs)
        if len(calls) == 2:
            raise RuntimeError("the device went away")
        return out

    def restore_fails(self: Any) -> None:
        raise RuntimeError("and stayed away")

    monkeypatch.setattr(delta_sync, "apply_changes", failing)
    if restore_too:
        monkeypatch.setattr(delta.Overwritten, "restore", restore_fails)
    return calls
