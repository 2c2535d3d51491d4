"""LoRA adapters as weight sets: what the trainer ships when it trains an adapter, not the model.

An adapter is a named set of tensors with a manifest of its own (:class:`LoRAConfig`: target
modules, rank, alpha, dtype) and a version of its own. For each target module ``m`` (a linear
layer's path in the model, ``"blocks.0.qkv"``) it holds ``m + ".lora_A"`` (``[rank, in]``) and
``m + ".lora_B"`` (``[out, rank]``), and one 0-d ``"lora_alpha"``, so that the scaling travels
with the weights it scales: a forward adds ``(x @ A.T @ B.T) * alpha / rank`` to the layer's
output. :func:`adapter_specs` names every tensor; :meth:`LoRAConfig.check` refuses, before any
byte is written, a set with a wrong rank, a missing or unknown target module or a wrong dtype.

Moving an adapter is moving any other set: a :class:`~rollout_sync.WeightTransfer` (buckets,
checksums, votes, the abort header, the relay), as ``P2R(adapter=name)`` and
``R2R(adapter=name)`` on a :class:`~rollout_sync.RolloutWorker`, which receives into the
engine's slot for that adapter (:class:`SupportsLoRA`) under the same guard (paused in place,
or staged and installed under a short pause), always requiring the whole set. docs/lora.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from .errors import WeightMismatchError
from .weights import WeightSpec, check_weights_match, specs_of

__all__ = [
    "ALPHA_KEY",
    "LoRAConfig",
    "SupportsLoRA",
    "adapter_specs",
    "iter_modules",
    "lora_delta",
    "random_adapter",
    "require_adapter",
]

ALPHA_KEY = "lora_alpha"
"""The 0-d tensor of an adapter set that holds its alpha (float32)."""


@dataclass(frozen=True)
class LoRAConfig:
    """An adapter's manifest: which linear layers it adapts, at what rank and scale.

    Args:
        rank: ``r``, the inner dimension of ``A`` and ``B``.
        alpha: the scale numerator: a forward scales ``B @ A`` by ``alpha / rank``.
        target_modules: the adapted linear layers' paths in the model, in order.
        dtype: of ``A`` and ``B``.
    """

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRAConfig.rank must be an int >= 1, got {self.rank!r}")
        if not self.target_modules:
            raise ValueError("LoRAConfig.target_modules names no module")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"LoRAConfig.target_modules repeats a module: {self.target_modules}")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def check(
        self,
        incoming: Mapping[str, torch.Tensor],
        shapes: Mapping[str, tuple[int, int]],
        *,
        context: str = "adapter",
    ) -> None:
        """Refuse ``incoming`` unless it is exactly this adapter's set for layers of
        ``shapes`` (module path -> ``(in_features, out_features)``).

        Raises:
            WeightMismatchError: every problem at once (a missing or unknown module, a wrong
                rank, shape or dtype, a ``lora_alpha`` other than this manifest's ``alpha``);
                nothing was written anywhere.
        """
        check_weights_match(
            specs_of(incoming), _as_specs(adapter_specs(self, shapes)), context=context
        )
        self.check_alpha(incoming, context=context)

    def check_alpha(
        self, incoming: Mapping[str, torch.Tensor], *, context: str = "adapter"
    ) -> None:
        """Refuse a set whose ``lora_alpha`` (data, not shape: readable only once received) is
        not this manifest's ``alpha``. A replica runs it on the staged set before its commit
        vote, so every replica refuses before the trainer is told of success.

        Raises:
            WeightMismatchError: the alpha differs; nothing was written anywhere.
        """
        alpha = incoming.get(ALPHA_KEY)
        if alpha is not None and alpha.device.type != "meta" and float(alpha) != self.alpha:
            raise WeightMismatchError(
                [f"{ALPHA_KEY}: {float(alpha)} is not the manifest's alpha {self.alpha}"],
                context=context,
                advice=(
                    f"Send the adapter with the {ALPHA_KEY} of the LoRAConfig it was added with "
                    f"(alpha {self.alpha}), or add it on the replicas with the trainer's "
                    "LoRAConfig: both sides must build the adapter from the same LoRAConfig."
                ),
            )


def adapter_specs(
    config: LoRAConfig, shapes: Mapping[str, tuple[int, int]]
) -> dict[str, WeightSpec]:
    """Every tensor of ``config``'s adapter, by name, for layers of ``shapes`` (module path ->
    ``(in_features, out_features)``), in order: each target's ``lora_A`` and ``lora_B``, then
    ``lora_alpha``.

    Raises:
        ValueError: a target module is not one of ``shapes``.
    """
    unknown = [m for m in config.target_modules if m not in shapes]
    if unknown:
        raise ValueError(
            f"LoRA target module(s) {unknown} are not linear layers of the model "
            f"(known: {sorted(shapes)[:8]}{' ...' if len(shapes) > 8 else ''})"
        )
    specs: dict[str, WeightSpec] = {}
    for module in config.target_modules:
        fan_in, fan_out = shapes[module]
        specs[f"{module}.lora_A"] = WeightSpec(
            f"{module}.lora_A", (config.rank, fan_in), config.dtype
        )
        specs[f"{module}.lora_B"] = WeightSpec(
            f"{module}.lora_B", (fan_out, config.rank), config.dtype
        )
    specs[ALPHA_KEY] = WeightSpec(ALPHA_KEY, (), torch.float32)
    return specs


def random_adapter(
    config: LoRAConfig,
    shapes: Mapping[str, tuple[int, int]],
    seed: int,
    *,
    scale: float = 0.05,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """A full adapter set drawn from ``seed``: ``A`` and ``B`` both non-zero (a freshly
    initialized adapter has ``B = 0``, which would change no token), ``alpha`` as configured."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, spec in adapter_specs(config, shapes).items():
        if name == ALPHA_KEY:
            out[name] = torch.tensor(float(config.alpha), dtype=torch.float32, device=device)
            continue
        noise = torch.randn(spec.shape, generator=gen, dtype=torch.float64) * scale
        out[name] = noise.to(dtype=spec.dtype, device=device)
    return out


def lora_delta(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, rank: int
) -> torch.Tensor:
    """``(x @ A.T @ B.T) * alpha / rank``: what the adapter adds to a linear layer's output."""
    return (x @ a.transpose(-1, -2).to(x.dtype) @ b.transpose(-1, -2).to(x.dtype)) * (
        alpha.to(x.dtype) / rank
    )


def _as_specs(specs: Mapping[str, WeightSpec]) -> dict[str, torch.Tensor]:
    """Meta tensors of ``specs`` (what :func:`check_weights_match` compares against)."""
    return {n: torch.empty(s.shape, dtype=s.dtype, device="meta") for n, s in specs.items()}


@runtime_checkable
class SupportsLoRA(Protocol):
    """An engine that serves LoRA adapters, each in a slot of its own, per request.

    The rollout worker receives an adapter straight into :meth:`served_adapter` (in place,
    parked) or into a staging copy it installs with :meth:`load_adapter` (staged). Requests
    name the adapter they use; requests on the base model or on other adapters read other
    slots.
    """

    def adapter_names(self) -> Sequence[str]:
        """The adapters served now."""
        ...

    def add_adapter(self, name: str, config: LoRAConfig) -> None:
        """Give ``name`` a slot (all zeros: it changes nothing until a version lands, at
        version 0). No request can use it yet, so it needs no pause.

        Raises:
            ValueError: the name is served already, or no slot is free, or ``config`` does not
                fit the model (its rank above the engine's most, an unknown module).
        """
        ...

    def adapter_config(self, name: str) -> LoRAConfig:
        """The manifest of adapter ``name``. Raises KeyError for an unknown name."""
        ...

    def served_adapter(self, name: str) -> Mapping[str, torch.Tensor]:
        """The tensors requests on ``name`` read (names as :func:`adapter_specs` gives them);
        a transfer writes them in place, inside the pause."""
        ...

    def load_adapter(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write ``tensors`` (the whole set, checked first) into ``name``'s slot; call inside
        the pause. Raises WeightMismatchError and writes nothing on a set that does not fit; a
        failure part-way tears the adapter alone (:meth:`check_adapter_servable`), not the
        model's weights, until a complete version of it commits."""
        ...

    def adapter_version(self, name: str) -> int:
        """The version of adapter ``name`` served now (0 before any landed)."""
        ...

    def check_adapter_servable(self, name: str) -> None:
        """Raise :class:`~rollout_sync.errors.TornWeightsError` when adapter ``name`` is torn
        (a load failed part-way, or the engine lost it) until a complete version of it lands;
        the worker calls it before it sends the adapter R2R."""
        ...

    def commit_adapter_version(self, name: str, version: int) -> None:
        """Record that a complete version of ``name`` landed."""
        ...

    def paused(self, timeout: float | None = None) -> AbstractContextManager[object]: ...


def iter_modules(config: LoRAConfig) -> Iterator[tuple[str, str, str]]:
    """``(module, A name, B name)`` per target module of ``config``."""
    for module in config.target_modules:
        yield module, f"{module}.lora_A", f"{module}.lora_B"


def require_adapter(rollout: object, name: str) -> SupportsLoRA:
    """``rollout`` as a LoRA engine serving ``name``.

    Raises:
        TypeError: the engine serves no adapters.
        KeyError: it does not serve ``name`` (add it first: ``add_adapter``).
    """
    if not isinstance(rollout, SupportsLoRA):
        raise TypeError(
            f"{type(rollout).__name__} serves no LoRA adapters (it does not implement "
            "rollout_sync.lora.SupportsLoRA); an adapter sync needs one that does"
        )
    if name not in rollout.adapter_names():
        raise KeyError(
            f"{type(rollout).__name__} serves no adapter {name!r} (serving "
            f"{list(rollout.adapter_names())}); add it first: add_adapter(name, config)"
        )
    return rollout
