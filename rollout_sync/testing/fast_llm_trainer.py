"""A stand-in for Fast-LLM's trainer side, written from the protocol (../shared/FASTLLM_WIRE.md),
not from this package's receiver: it imports nothing of it.

It does what ``StreamingTrainerCallback`` does on global rank 0: hosts the broadcast group's
store (``torch.distributed.rendezvous`` as rank 0; ``PrefixStore("range_0_{W}_1/")``; a raw
``ProcessGroupGloo`` or ``ProcessGroupNCCL``), ``XADD fast_llm_events * event <json>`` before
every broadcast, broadcasts each tensor as length / pickled header / tensor with raw
``group.broadcast([t], opts)``, ends with ``pickle.dumps(None)``, and announces
``training_finished``. Tests reach below it with :meth:`broadcast_raw` (any header bytes, any
tensor) to send what a broken or hostile trainer would.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["FastLLMTrainerStandIn"]


class FastLLMTrainerStandIn:
    """Rank 0 of a Fast-LLM weight broadcast, and its Redis side.

    Args:
        redis: a ``redis.Redis`` client (the trainer's ``callbacks.streaming`` Redis).
        host, port: where rank 0 hosts the rendezvous store.
        world_size: 1 + the receivers.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout_s: the rendezvous' and the group's timeout (Fast-LLM's default is 600 s).
    """

    def __init__(
        self,
        redis: Any,
        *,
        host: str,
        port: int,
        world_size: int = 2,
        backend: str = "gloo",
        timeout_s: float = 600.0,
    ) -> None:
        self.redis, self.host, self.port = redis, host, port
        self.world_size, self.backend, self.timeout_s = world_size, backend, timeout_s
        self.device = torch.device("cuda" if backend == "nccl" else "cpu")
        self.group: Any = None
        self._store: Any = None

    def connect(self) -> None:
        """Host the store and make the group: blocks until every receiver has joined."""
        timeout = timedelta(seconds=self.timeout_s)
        rendezvous: Any = dist.rendezvous  # type: ignore[attr-defined]
        store, _, _ = next(
            rendezvous(f"tcp://{self.host}:{self.port}", 0, self.world_size, timeout=timeout)
        )
        store.set_timeout(timeout)
        prefixed = dist.PrefixStore(f"range_0_{self.world_size}_1/", store)  # type: ignore[attr-defined]
        if self.backend == "gloo":
            self.group = dist.ProcessGroupGloo(prefixed, 0, self.world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(prefixed, 0, self.world_size, options)
        self._store = store

    def weights_ready(self, step: int, documents_seen: int | None = None) -> None:
        event: dict[str, Any] = {"type": "weights_ready", "step": step}
        if documents_seen is not None:
            event["documents_seen"] = documents_seen
        self.redis.xadd("fast_llm_events", {"event": json.dumps(event)})

    def training_finished(self) -> None:
        self.redis.xadd("fast_llm_events", {"event": json.dumps({"type": "training_finished"})})

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        self.group.broadcast([tensor], opts).wait()

    def broadcast_length(self, n: int) -> None:
        """A header's length frame alone (a receiver that refuses the length reads no more)."""
        self._broadcast(torch.tensor([n], dtype=torch.int64, device=self.device))

    def broadcast_raw(self, header: bytes, tensor: torch.Tensor | None = None) -> None:
        """One header (length, bytes) and, if given, one tensor, as the protocol frames them."""
        self.broadcast_length(len(header))
        self._broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device))
        if tensor is not None:
            self._broadcast(tensor.to(self.device).contiguous())

    def broadcast_weights(
        self, tensors: Iterable[tuple[str, str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> None:
        """The stream of ``(shard, layer_name, tensor)`` (a mapping is the ``"weights"``
        shard), then the end marker."""
        items = (
            [("weights", name, t) for name, t in tensors.items()]
            if isinstance(tensors, Mapping)
            else tensors
        )
        for shard, name, tensor in items:
            self.broadcast_raw(pickle.dumps((shard, name, tensor.shape, tensor.dtype)), tensor)
        self.broadcast_raw(pickle.dumps(None))

    def push(
        self,
        step: int,
        documents_seen: int,
        tensors: Iterable[tuple[str, str, torch.Tensor]] | Mapping[str, torch.Tensor],
    ) -> None:
        """``weights_ready``, then the broadcast: one training step's update."""
        self.weights_ready(step, documents_seen)
        self.broadcast_weights(tensors)

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None and hasattr(group, "shutdown"):
            try:
                group.shutdown()
            except Exception:  # noqa: BLE001, S110 - a group already broken
                pass
        self._store = None
