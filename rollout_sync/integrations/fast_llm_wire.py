"""Fast-LLM's weight-streaming protocol, the receiving side's half (see ../shared/FASTLLM_WIRE.md).

* **Events** (Redis stream ``fast_llm_events``, one field ``event`` holding JSON):
  ``{"type": "weights_ready", "step": s, "documents_seen": d}`` before every broadcast (builds
  before mid-2026 send no ``documents_seen``) and ``{"type": "training_finished"}``.
  :func:`parse_event` reads one into :class:`WeightsReady` or :class:`TrainingFinished`.
* **The group**: ``torch.distributed.rendezvous(f"tcp://{host}:{port}", rank, W)`` (the trainer is
  rank 0 and hosts the store, or an agent's store does under torchrun), then a raw
  ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` on ``PrefixStore(f"range_0_{W}_1/", store)``:
  :class:`BroadcastGroup`.
* **The stream**, per tensor from rank 0: an int64 ``[1]`` length, ``uint8[n]`` holding
  ``pickle.dumps((shard, name, shape, dtype))``, then the tensor; ``pickle.dumps(None)`` in the
  header ends it. :func:`decode_header` unpickles a header with :class:`HeaderUnpickler`, which
  admits the protocol's types and nothing else.
* **Rollouts back** (Redis stream ``fast_llm_streaming``, consumer group ``fast_llm_group``):
  :func:`encode_rollout` / :func:`decode_rollout`.
"""

from __future__ import annotations

import io
import json
import pickle
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .._deadline import collective_failure, group_timedelta, wait_collective
from ..errors import FastLLMProtocolError, UnsafeHeaderError
from ..weights import WeightSpec

__all__ = [
    "DEFAULT_GROUP_PORT",
    "EVENTS_STREAM",
    "MAX_HEADER_BYTES",
    "ROLLOUTS_GROUP",
    "ROLLOUTS_STREAM",
    "BroadcastGroup",
    "FastLLMRollout",
    "HeaderUnpickler",
    "TensorHeader",
    "TrainingFinished",
    "WeightsReady",
    "decode_header",
    "decode_rollout",
    "encode_rollout",
    "group_store_prefix",
    "parse_event",
]

EVENTS_STREAM = "fast_llm_events"
ROLLOUTS_STREAM = "fast_llm_streaming"
ROLLOUTS_GROUP = "fast_llm_group"
DEFAULT_GROUP_PORT = 23456
MAX_HEADER_BYTES = 1 << 16
"""The longest header accepted (a real one is ~100 bytes); a longer length is refused before
anything is allocated (neither Fast-LLM's consumer nor PipelineRL caps it)."""


# -- events ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightsReady:
    """The trainer is about to broadcast the weights of ``step``."""

    step: int
    documents_seen: int | None = None

    @property
    def version(self) -> int:
        """The weight version to commit: ``documents_seen`` (what staleness is counted in),
        or ``step`` from a build that does not send it."""
        return self.documents_seen if self.documents_seen is not None else self.step


@dataclass(frozen=True)
class TrainingFinished:
    """The trainer is done; receivers leave the group."""


def parse_event(fields: Mapping[Any, Any]) -> WeightsReady | TrainingFinished:
    """One ``fast_llm_events`` message (its fields, bytes or str) as an event.

    Raises:
        FastLLMProtocolError: no ``event`` field, JSON that does not parse, or an unknown type.
    """
    raw = fields.get(b"event", fields.get("event"))
    if raw is None:
        raise FastLLMProtocolError(
            f"a fast_llm_events message without an 'event' field: {fields!r}"
        )
    try:
        event = json.loads(raw)
        kind = event["type"]
    except (ValueError, TypeError, KeyError) as exc:
        raise FastLLMProtocolError(
            f"a fast_llm_events message that is not an event: {raw!r}"
        ) from exc
    if kind == "weights_ready":
        step, seen = event.get("step"), event.get("documents_seen")
        if not _is_count(step) or not (seen is None or _is_count(seen)):
            raise FastLLMProtocolError(
                f"a weights_ready event needs an integer step (and documents_seen): {raw!r}"
            )
        return WeightsReady(step, seen)
    if kind == "training_finished":
        return TrainingFinished()
    raise FastLLMProtocolError(f"an unknown fast_llm_events type {kind!r}")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# -- tensor headers ----------------------------------------------------------------------------


_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}


class HeaderUnpickler(pickle.Unpickler):
    """Unpickles what a Fast-LLM header may hold and refuses everything else.

    Strings, tuples, ints and None need no global; the only globals admitted are
    ``torch.Size`` and the ``torch.<dtype>`` objects. Any other global (a function, a class
    whose reduce would run code) and any persistent id raise :class:`UnsafeHeaderError` before
    it is looked up.
    """

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name == "Size" or name in _DTYPES):
            return getattr(torch, name)
        raise UnsafeHeaderError(
            f"a Fast-LLM tensor header asked for the global {module}.{name}; only torch.Size "
            "and torch dtypes are allowed"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeHeaderError("a Fast-LLM tensor header used a persistent id")


@dataclass(frozen=True)
class TensorHeader(WeightSpec):
    """One tensor's header: its name in the export format, shape and dtype (a
    :class:`~rollout_sync.weights.WeightSpec`), and its shard category."""

    shard: str = "weights"


def decode_header(data: bytes) -> TensorHeader | None:
    """A header's bytes as a :class:`TensorHeader`, or ``None`` for the end marker.

    Raises:
        UnsafeHeaderError: a global or persistent id the protocol does not use, bytes that do
            not unpickle, or a value that is not ``(str, str, torch.Size, torch.dtype)``.
    """
    try:
        value = HeaderUnpickler(io.BytesIO(data)).load()
    except UnsafeHeaderError:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is the sender's fault
        raise UnsafeHeaderError(f"a Fast-LLM tensor header does not unpickle: {exc}") from exc
    if value is None:
        return None
    if not (isinstance(value, tuple) and len(value) == 4):
        raise UnsafeHeaderError(
            f"a Fast-LLM tensor header must be (shard, name, shape, dtype), got {type(value)}"
        )
    shard, name, shape, dtype = value
    if not (
        isinstance(shard, str)
        and isinstance(name, str)
        and isinstance(shape, torch.Size)
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        and isinstance(dtype, torch.dtype)
    ):
        raise UnsafeHeaderError(
            f"a Fast-LLM tensor header must be (str, str, torch.Size, torch.dtype), got "
            f"({type(shard).__name__}, {type(name).__name__}, {type(shape).__name__}, "
            f"{type(dtype).__name__})"
        )
    return TensorHeader(name, tuple(int(d) for d in shape), dtype, shard)


# -- the broadcast group -----------------------------------------------------------------------


def group_store_prefix(world_size: int) -> str:
    """The store prefix of Fast-LLM's broadcast group of ``world_size`` ranks."""
    return f"range_0_{world_size}_1/"


def _broadcast_from_trainer() -> Any:
    options = dist.BroadcastOptions()
    options.rootRank = 0  # the trainer
    options.rootTensor = 0
    return options


_FROM_TRAINER = _broadcast_from_trainer()
"""The options of every receive: a broadcast from rank 0, made once."""


class BroadcastGroup:
    """This receiver's membership in Fast-LLM's broadcast group, with bounded receives.

    :meth:`join` blocks in the rendezvous until every member (the trainer first of all) is
    there, up to ``timeout_s``. Receives are raw collectives on the backend, as Fast-LLM's own
    (``group.broadcast([t], opts)``; torch 2.13's wrappers reject such a group), each bounded
    by ``timeout_s``.
    """

    def __init__(
        self, group: Any, store: Any, rank: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        self.group, self.store = group, store
        self.rank, self.world_size, self.backend, self.timeout_s = (
            rank,
            world_size,
            backend,
            timeout_s,
        )
        self.device = torch.device("cuda" if backend == "nccl" else "cpu")

    @classmethod
    def join(
        cls,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout_s: float = 600.0,
    ) -> BroadcastGroup:
        """Join the trainer's group as ``rank`` (1 .. ``world_size`` - 1).

        Raises:
            ValueError: a bad rank or backend, or ``timeout_s`` not a positive finite number.
            RuntimeError / DistStoreError (torch): the rendezvous did not complete in time.
        """
        if not 0 < rank < world_size:
            raise ValueError(f"a Fast-LLM receiver's rank is 1 .. {world_size - 1}, got {rank}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        timeout = group_timedelta(timeout_s)
        rendezvous: Any = dist.rendezvous  # type: ignore[attr-defined]
        store, _, _ = next(rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        prefixed = dist.PrefixStore(group_store_prefix(world_size), store)  # type: ignore[attr-defined]
        if backend == "gloo":
            group: Any = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        return cls(group, store, rank, world_size, backend, timeout_s)

    def receive(self, tensor: torch.Tensor, what: str) -> None:
        """Fill ``tensor`` from the trainer's broadcast (rank 0), within ``timeout_s``.

        Raises:
            CollectiveTimeout / CollectiveError: the trainer did not send in time, or its
                connection broke (it died).
        """
        if self.group is None:
            raise FastLLMProtocolError(f"{what}: the Fast-LLM group was closed")
        start = time.monotonic()
        try:
            work = self.group.broadcast([tensor], _FROM_TRAINER)
        except Exception as exc:  # noqa: BLE001 - a group a dead peer already broke
            raise collective_failure(exc, what, (0, self.rank), self.timeout_s, start) from exc
        wait_collective([work], operation=what, timeout_s=self.timeout_s, ranks=(0, self.rank))

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None and hasattr(group, "shutdown"):
            try:
                group.shutdown()
            except Exception:  # noqa: BLE001, S110 - a group broken by a dead peer
                pass
        self.store = None


# -- rollouts back -----------------------------------------------------------------------------


@dataclass(frozen=True)
class FastLLMRollout:
    """One ``fast_llm_streaming`` record."""

    tokens: torch.Tensor
    """int64"""
    old_log_probabilities: torch.Tensor
    """float32, one per token"""
    model_version: torch.Tensor
    """int64, one per token, in ``documents_seen`` units"""
    data: dict[str, Any] = field(default_factory=dict)
    """``loss_masking_spans``, ``chosen_span``, ``rejected_span``, ``advantage``, ``reward``"""

    def staleness(self, documents_seen: int) -> int:
        """How far behind ``documents_seen`` its oldest token's weights were."""
        return documents_seen - int(self.model_version.min()) if self.model_version.numel() else 0


def encode_rollout(
    tokens: Sequence[int] | torch.Tensor,
    old_log_probabilities: Sequence[float] | torch.Tensor,
    model_version: Sequence[int] | torch.Tensor,
    data: Mapping[str, Any] | None = None,
) -> dict[str, bytes]:
    """A rollout as Fast-LLM's ``fast_llm_streaming`` fields.

    Raises:
        ValueError: the three per-token arrays differ in length.
    """
    t = torch.as_tensor(tokens).detach().to("cpu", torch.int64).flatten()
    lp = torch.as_tensor(old_log_probabilities).detach().to("cpu", torch.float32).flatten()
    mv = torch.as_tensor(model_version).detach().to("cpu", torch.int64).flatten()
    if not t.numel() == lp.numel() == mv.numel():
        raise ValueError(
            f"tokens ({t.numel()}), old_log_probabilities ({lp.numel()}) and model_version "
            f"({mv.numel()}) must have one entry per token"
        )
    return {
        "tokens": t.numpy().tobytes(),
        "old_log_probabilities": lp.numpy().tobytes(),
        "model_version": mv.numpy().tobytes(),
        "data": json.dumps(dict(data or {})).encode(),
    }


def decode_rollout(fields: Mapping[Any, Any]) -> FastLLMRollout:
    """A ``fast_llm_streaming`` record's fields (bytes keys as redis-py returns them, or str).

    Raises:
        FastLLMProtocolError: a field is missing or the arrays disagree in length.
    """

    def get(name: str) -> bytes:
        value = fields.get(name.encode(), fields.get(name))
        if value is None:
            raise FastLLMProtocolError(f"a fast_llm_streaming record without {name!r}")
        return bytes(value) if not isinstance(value, str) else value.encode()

    def array(name: str, dtype: torch.dtype) -> torch.Tensor:
        raw = get(name)
        return torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)

    try:
        tokens = array("tokens", torch.int64)
        logprobs = array("old_log_probabilities", torch.float32)
        versions = array("model_version", torch.int64)
        data = json.loads(get("data"))
    except (ValueError, RuntimeError) as exc:
        raise FastLLMProtocolError(f"a malformed fast_llm_streaming record: {exc}") from exc
    if not tokens.numel() == logprobs.numel() == versions.numel():
        raise FastLLMProtocolError(
            "a fast_llm_streaming record whose tokens, old_log_probabilities and model_version "
            "differ in length"
        )
    return FastLLMRollout(tokens, logprobs, versions, data)
