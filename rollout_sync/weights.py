"""Describing a set of named weights, and checking an incoming set against the served one.

Every path that writes served tensors (an in-place copy, a distributed transfer, a vLLM reload)
first checks *all* incoming names, shapes and dtypes against what is served, and only then
touches a tensor. A bad input gets one error listing every problem; nothing is half-written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from .errors import WeightMismatchError

__all__ = ["WeightMismatchError", "WeightSpec", "check_weights_match", "specs_of"]


@dataclass(frozen=True)
class WeightSpec:
    """What a receiver needs to know of one tensor before any byte arrives."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> WeightSpec:
        return cls(name, tuple(tensor.shape), tensor.dtype)


def specs_of(weights: Mapping[str, torch.Tensor]) -> list[WeightSpec]:
    """The specs of a name -> tensor mapping, in its order."""
    return [WeightSpec.of(name, t) for name, t in weights.items()]


def check_weights_match(
    incoming: Iterable[WeightSpec],
    served: Mapping[str, torch.Tensor],
    *,
    require_all: bool = True,
    context: str = "incoming weights",
) -> None:
    """Raise :class:`WeightMismatchError` unless every incoming spec fits a served tensor.

    Args:
        incoming: what is about to be written.
        served: the tensors it would be written into, by name.
        require_all: every served name must be in ``incoming`` (a full sync). Pass ``False``
            for a deliberate subset, such as trainable parameters only.
    """
    problems: list[str] = []
    seen: set[str] = set()
    for spec in incoming:
        if spec.name in seen:
            problems.append(f"{spec.name}: sent twice")
            continue
        seen.add(spec.name)
        target = served.get(spec.name)
        if target is None:
            problems.append(f"{spec.name}: not a served weight (unknown name)")
            continue
        if tuple(target.shape) != spec.shape:
            problems.append(
                f"{spec.name}: shape {list(spec.shape)} does not match served {list(target.shape)}"
            )
        if target.dtype != spec.dtype:
            problems.append(f"{spec.name}: dtype {spec.dtype} does not match served {target.dtype}")
    if require_all:
        problems.extend(
            f"{name}: missing (a full sync must send every served weight)"
            for name in served
            if name not in seen
        )
    if problems:
        raise WeightMismatchError(problems, context=context)
